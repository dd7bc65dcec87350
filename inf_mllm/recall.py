"""Recall: evicted turns come back from the span store when a question needs them.

When the caller has resolved which stored turns a question needs (`named`: a predicate on a span's meta, e.g.
the clips whose words name what it asks about, or the clip or time it names), exactly those no longer cached
are linked, and none for a question about the present. Otherwise it ranks the stored turns by similarity and
links those that beat every turn still cached. A probe forward of the question over the cache runs up to the
last scoring layer and stops (leaving no trace); the question's keys there, with RoPE removed, are compared
with each stored span's summary keys (cosine, best span key per question token). Each question token's
similarities are z-normalised over the candidate spans, so tokens every turn shares (the chat template) weigh
nothing and the distinctive ones ("clip", a number, a key word) decide; a span scores by its best token,
averaged over heads, summed over the scoring layers. Keys of the middle layers carry a token together with its
neighbours, so they match "clip 13" rather than any 1 and 3 (the layer choice is measured in
benchmarks/results/README.md). The spans are linked back in time order as one block, re-rotated to fresh
contiguous positions (at the end of the cache, just before the question, or at its front after the sinks),
with no re-encoding (MPIC's full reuse), or with part of them recomputed in the question's own forward
(`recompute_rows`: MPIC-k, CacheBlend-r, or all of them). The question turn does not evict, so the answer sees
them; they leave again at the next turn boundary. `oracle` links exactly the right span and `random` k random
ones: the references recall is measured against. The options are `spec.Recall`."""

from collections.abc import Callable

import torch

from .observers import WindowObserver, declared
from .rope import rerotate
from .spec import Recall
from .store import Span, SpanStore

# --- storing a turn ---------------------------------------------------------------------------------


def observers(observed: list, recall: Recall) -> list:
    """The observers a cache with recall runs: a span's representative keys are those its own turn's window
    attended to most, so the window statistic is kept for every turn (a policy without it gets a window of
    recall's own)."""
    if any("window" in declared([obs]) for obs in observed):
        return observed
    return [*observed, WindowObserver(window=recall.window)]



def scoring_layers(recall: Recall, num_layers: int) -> list[int]:
    """The layers whose keys score spans in a model `num_layers` deep: the given ones, or the depth fractions'."""
    if recall.layers is not None:
        if max(recall.layers) >= num_layers:
            raise ValueError(f"recall layers must lie in 0..{num_layers - 1} for this {num_layers}-layer model, "
                             f"got {recall.layers}")
        return sorted(set(recall.layers))
    if not recall.depth:
        return list(range(num_layers))
    return sorted({min(round(f * num_layers), num_layers - 1) for f in recall.depth})


def make_span(cache, span_id: int, length: int, recall: Recall, meta: dict, inputs: torch.Tensor | None = None,
              vision: tuple[int, int] | None = None) -> Span:
    """The last `length` tokens of every layer as a span, as the cache holds them: keys rotated at their positions
    (`origin`: where each layer holds the first), so storing rotates nothing and linking rotates once. In the
    scoring layers, a summary of the mean key plus `reps` keys the turn's own window attended to most (all of
    them for a short turn), per KV head, without RoPE. `inputs` (length, hidden), the turn's input embeddings, and
    `vision`, where its visual tokens sit, are kept for a recall that recomputes linked tokens."""
    keys, values, summary = [], [], []
    scoring = set(scoring_layers(recall, len(cache.layers)))
    origins, own, bases = cache.rope.span(cache, length)  # multimodal: the turn's units from 0, then its extent
    own = own.to(cache.layers[0].keys.device)  # once, not in every scoring layer
    for i, layer in enumerate(cache.layers):
        n = layer.get_seq_length()
        k = layer.keys[0, :, n - length:]  # (H, L, d), at positions origin..origin+L-1 (under 1-D RoPE)
        keys.append(k)
        values.append(layer.values[0, :, n - length:])
        if i not in scoring:
            continue
        first = origins[i]
        k = cache.rotations.rotate(k, torch.full((1, length), -first, device=k.device), first + 1) if first else k
        bare = rerotate(k, -own, cache.inv_freq)  # no RoPE (a vision token keeps its offsets in its unit)
        h = k.shape[0]
        scores = layer.stats.get("window")  # the statistic `observers` makes sure is kept
        if scores is not None and scores.shape[-1] == n:
            s = scores[0, :, n - length:].reshape(h, -1, length).mean(dim=1)  # (Hkv, L)
        else:  # no observation: the keys with the largest norm stand out in q·k
            s = bare.float().norm(dim=-1)
        top = s.topk(min(recall.reps, length), dim=-1).indices
        top = torch.cat([top, top[:, -1:].expand(-1, recall.reps - top.shape[1])], dim=-1)
        picked = bare.gather(1, top[..., None].expand(-1, -1, bare.shape[-1]))
        summary.append(torch.cat([bare.mean(dim=1, keepdim=True), picked], dim=1))
    # in host memory: a GPU's memory holds the bounded cache alone, however many turns are stored
    return Span(span_id, length, torch.stack(summary).to("cpu", torch.float16), meta,
                torch.stack(keys).to("cpu"), torch.stack(values).to("cpu"), bases, torch.tensor(origins),
                None if inputs is None else inputs.to("cpu"), None if vision is None else torch.tensor(vision))


# --- choosing spans ---------------------------------------------------------------------------------


def resident_spans(cache, store: SpanStore, share: float) -> set[int]:
    """Stored spans with at least `share` of their tokens still cached (over layers and heads)."""
    ids = torch.cat([layer.turn_ids.reshape(-1) for layer in cache.layers if layer.turn_ids is not None])
    ids = ids[ids >= 0]
    if not ids.numel():
        return set()
    slots = sum(layer.turn_ids.shape[1] for layer in cache.layers if layer.turn_ids is not None)  # layers x heads
    stored = torch.tensor(list(store.spans), dtype=torch.long)
    lengths = torch.tensor([span.length for span in store.spans.values()], dtype=torch.float32)
    counts = torch.bincount(ids, minlength=int(stored.max()) + 1 if len(stored) else 0).cpu()  # one read back
    kept = counts[stored].float() >= share * lengths * slots  # the same test, for every span at once
    return set(stored[kept].tolist())


def span_scores(question_keys: list[torch.Tensor], store: SpanStore, candidates: list[int]) -> torch.Tensor:
    """(N, scoring layers) scores of the candidate spans: `question_keys` holds per scoring layer the
    question's keys without RoPE, (Hkv, M, d)."""
    rows, summaries = store.summary_rows(candidates)
    q = torch.nn.functional.normalize(torch.stack(question_keys).float(), dim=-1)  # (L, Hkv, M, d)
    every = len(rows) == summaries.shape[0] and bool((rows == torch.arange(len(rows))).all())
    s = (summaries if every else summaries[rows]).to(q.device)  # (N, L, Hkv, R, d), unit fp32 (store.summaries)
    sim = torch.einsum("nlhrd,lhmd->nlhmr", s, q).amax(dim=-1)  # each question token's best span key
    if sim.shape[0] > 1:  # per question token over the spans: shared tokens cancel, distinctive ones count
        sim = (sim - sim.mean(dim=0)) / sim.std(dim=0).clamp_min(1e-4)
    return sim.amax(dim=-1).mean(dim=-1)  # best token, mean over heads: (N, L)


def choose(store: SpanStore, resident: set[int], recall: Recall, question_keys=None,
           named: Callable[[dict], bool] | None = None, oracle: Callable[[dict], bool] | None = None) -> list[int]:
    """Span ids to link for a question, in time order. When the caller resolved the turns the question
    needs (`named`, a predicate on a span's meta), it gets those no longer cached, and nothing else:
    none for a question about the present. Otherwise the k best matches of its keys among all stored
    turns, linked only where they beat every turn still cached (the gate: a question the cache can
    answer links nothing)."""
    candidates = [i for i in sorted(store.spans) if i not in resident]
    if not candidates:
        return []
    if recall.mode == "oracle":
        if oracle is None:
            raise ValueError("recall mode 'oracle' needs the question's target (oracle=)")
        return [i for i in candidates if oracle(store.spans[i].meta)][: recall.k]
    if recall.mode == "random":
        return sorted(recall.rng.sample(candidates, min(recall.k, len(candidates))))
    if named is not None and recall.named:
        return [i for i in candidates if named(store.spans[i].meta)][-recall.k:]
    if question_keys is None:
        return []
    everyone = sorted(store.spans)
    scores = span_scores(question_keys, store, everyone).sum(dim=1)
    cached = [j for j, i in enumerate(everyone) if i in resident]
    bar = scores[cached].max() if cached else -float("inf")
    order = scores.topk(min(recall.k, len(everyone))).indices.tolist()
    return sorted(everyone[j] for j in order if everyone[j] not in resident and scores[j] > bar)


# --- linking and unlinking --------------------------------------------------------------------------


def link(cache, store: SpanStore, span_ids: list[int], at: str, recalled: bool = True, device=None) -> list[int]:
    """Insert the spans' KV as one block (in the given order) into every layer; returns those linked. Each span's
    keys are rotated once, from where they were stored to where they now sit. Recalled tokens are tagged to leave
    at the next turn; others (a restored session) stay as turns. `device`: where the cache lives, for a cache that
    holds nothing yet (default: where its first layer's keys are)."""
    blocks = [(i, store.kv(i)) for i in span_ids]
    blocks = [(i, kv) for i, kv in blocks if kv is not None]  # a corrupt file drops its span
    if not blocks:
        return []
    keys, values, tags, bases, moves, offset = [], [], [], [], [], 0
    device, layers = device or cache.layers[0].keys.device, len(cache.layers)
    for span_id, (k, v) in blocks:  # (layers, H, m, d) each, keys at origin..origin+m-1 → offset..offset+m-1
        span, m = store.spans[span_id], k.shape[2]
        keys.append(k.to(device))  # stored in host memory
        values.append(v.to(device))
        tags.append(torch.full((m,), -1 - span_id if recalled else span_id, dtype=torch.long))
        origin = span.origin if span.origin is not None else torch.zeros(layers, dtype=torch.long)  # older files
        moves.append((offset - origin)[:, None].expand(layers, m))
        own = span.bases  # multimodal RoPE: its units from 0, then its extent
        own = torch.arange(m + 1) if own is None else own
        bases.append(own[:-1] + offset)
        offset += int(own[-1])
    keys, values, tag, moves = torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(tags), torch.cat(moves, 1)
    bases = torch.cat([*bases, torch.tensor([offset])])
    for i, layer in enumerate(cache.layers):
        n = layer.get_seq_length()
        pos = n if at == "end" else min(4, n)
        layer.insert(pos, keys[i][None], values[i][None], tag, moves[i], bases, recalled=recalled)
    return [i for i, _ in blocks]


def recompute_rows(store: SpanStore, span_ids: list[int], recall: Recall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of the linked block (`span_ids` as `link` returned them, in that order) that the question's forward
    may recompute, and their input embeddings (rows, hidden): under MPIC-k each turn's text tokens and its first
    `mpic_k` visual tokens (MPIC's Insights 2-3: the first visual tokens draw the most attention and move the most
    with their context); under CacheBlend-r and re-encoding every token (CacheBlend keeps those that deviate most:
    `most_deviating`). A turn stored without its inputs is reused as stored."""
    rows, inputs, offset = [], [], 0
    for span_id in span_ids:
        span = store.spans[span_id]
        store.kv(span_id)  # its inputs come back with its KV, if the RAM tier let them go
        if span.inputs is not None and recall.reuse != "full":
            own = torch.arange(span.length)
            if recall.reuse == "mpic" and span.vision is not None:
                start, end = span.vision.tolist()
                own = own[(own < start) | (own >= end) | (own < start + recall.mpic_k)]
            rows.append(own + offset)
            inputs.append(span.inputs[own])
        offset += span.length
    if not rows:
        return torch.zeros(0, dtype=torch.long), None
    return torch.cat(rows), torch.cat(inputs)


def most_deviating(rows: torch.Tensor, inputs: torch.Tensor, deviation: torch.Tensor, share: float):
    """CacheBlend-r: the `share` of the rows whose recomputed KV moved furthest from the stored one, in order."""
    keep = deviation.topk(max(1, round(share * len(rows))) if share > 0 else 0).indices.sort().values.cpu()
    return rows[keep], inputs[keep]


def unlink(cache) -> None:
    """Take linked (recalled) tokens out of every layer; the rest close up to contiguous positions. Each layer
    knows where its linked block sits (host counts), so nothing is read back from the device."""
    for layer in cache.layers:
        layer.unlink()
