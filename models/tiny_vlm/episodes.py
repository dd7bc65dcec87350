"""Episodes as model inputs: the exact turns a streaming session would see, as one embedded sequence.

Training and evaluation build their inputs here from the adapter's own turn texts, so the model
is trained on the format it is later asked in.
"""

from functools import lru_cache

import torch

IGNORE = -100


class EpisodeBuilder:
    """`labels`: image id → its classifier labels, for clip turns that do not carry their own
    (("clip", id) rather than ("clip", id, labels)); a clip turn with labels None has no label text."""

    def __init__(self, vlm, features: dict[int, torch.Tensor], labels: dict[int, tuple] | None = None):
        self.vlm, self.features, self.labels = vlm, features, labels or {}
        self.eos = vlm.model.generation_config.eos_token_id
        if isinstance(self.eos, (list, tuple)):
            self.eos = self.eos[0]
        self._label_cache: dict[tuple, torch.Tensor] = {}
        self._ids = lru_cache(maxsize=None)(lambda text: vlm.tokenizer(text, add_special_tokens=False).input_ids)

    def pieces(self, turns, with_answers: bool = True, first: int = 1):
        """[(kind, payload)]: ("text", ids), ("visual", image id), ("labels", class ids), ("answer", ids)
        in stream order."""
        out = [("text", self._ids(self.vlm.system_text()))]
        clip = first - 1
        for turn in turns:
            if turn[0] == "clip":
                clip += 1
                before, after = self.vlm.clip_text(clip, 0.0)
                labels = turn[2] if len(turn) > 2 else self.labels.get(turn[1], ())
                out += [("text", self._ids(before)), ("visual", turn[1])]
                if labels is not None and getattr(self.vlm, "label_mode", "none") != "none":
                    out.append(("labels", tuple(labels)))
                out.append(("text", self._ids(after)))
            else:
                out.append(("text", self._ids(self.vlm.question_text(turn[1]))))
                if with_answers:
                    out.append(("answer", self._ids(turn[2]) + [self.eos]))
        return out

    def _labels(self, labels: tuple) -> torch.Tensor:
        if labels not in self._label_cache:
            with torch.no_grad():
                self._label_cache[labels] = self.vlm.label_embeddings(labels)
        return self._label_cache[labels]

    def visual(self, images) -> dict[int, torch.Tensor]:
        """image id → (tokens, hidden) visual embeddings, projected in one call (the vocabulary-wide
        softmax of a snapping projector costs far less once per batch than once per clip)."""
        images = sorted(set(images))
        if not images:
            return {}
        projected = self.vlm.project(torch.stack([self.features[i].float() for i in images]))
        return dict(zip(images, projected, strict=True))

    def embed_batch(self, pieces_list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        visual = self.visual(p for pieces in pieces_list for kind, p in pieces if kind == "visual")
        return [self.embed(pieces, visual) for pieces in pieces_list]

    def embed(self, pieces, visual: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, hidden) input embeddings and (L,) next-token targets (IGNORE outside answers)."""
        embed_tokens = self.vlm.model.get_input_embeddings()
        if visual is None:
            visual = self.visual(p for kind, p in pieces if kind == "visual")
        chunks, targets = [], []
        for kind, payload in pieces:
            if kind == "visual":
                vis = visual[payload]
                chunks.append(vis)
                targets += [IGNORE] * vis.shape[0]
                continue
            if kind == "labels":
                lab = self._labels(payload)
                chunks.append(lab)
                targets += [IGNORE] * lab.shape[0]
                continue
            ids = torch.tensor(payload, device=self.vlm.device)
            chunks.append(embed_tokens(ids))
            targets += list(payload) if kind == "answer" else [IGNORE] * len(payload)
        # the target at position t is the token at t + 1
        targets = targets[1:] + [IGNORE]
        return torch.cat(chunks), torch.tensor(targets, device=self.vlm.device)


def pad_batch(items: list[tuple[torch.Tensor, torch.Tensor]]):
    """Right-padded (B, L, H) embeddings, (B, L) targets and (B, L) attention mask."""
    length = max(e.shape[0] for e, _ in items)
    hidden = items[0][0].shape[1]
    embeds = items[0][0].new_zeros(len(items), length, hidden)
    targets = torch.full((len(items), length), IGNORE, dtype=torch.long, device=embeds.device)
    mask = torch.zeros(len(items), length, dtype=torch.long, device=embeds.device)
    for i, (e, t) in enumerate(items):
        embeds[i, : e.shape[0]], targets[i, : t.shape[0]], mask[i, : e.shape[0]] = e, t, 1
    return embeds, targets, mask
