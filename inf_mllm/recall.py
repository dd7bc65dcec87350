"""Recall: evicted turns come back from the span store when a question needs them.

Before a question turn is prefilled, a probe forward of the question over the cache captures its
queries in the scoring layers (and stops there, leaving no trace). The queries, with RoPE removed,
score each stored span that is no longer in the cache by its summary (the max over its
representative keys and the question's queries of q·k, averaged over heads); scores are
z-normalised per layer, because raw query–key similarity drifts with the stream (MemStream), then
combined over layers: summed into one ranking (`scoring="sum"`), or each layer votes for its own
top k (`"vote"`). By default only the first layer scores: its keys are a linear map of the token
embeddings, so position-free q·k there matches what the question names ("clip 7", a key word)
against the stored turn's own tokens; deeper layers mix context in and rank stored spans worse
(measured per layer in benchmarks/results/README.md). The top k spans are
linked back in time order as one block, re-rotated to fresh contiguous positions (at the end of the
cache, just before the question, or at its front after the sinks), with no re-encoding. The question
turn does not evict, so the answer sees them; they leave again at the next turn boundary. `oracle`
links exactly the right span and `random` k random ones: the references recall is measured against.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .rope import rerotate
from .store import Span, SpanStore

MODES = ("attention", "oracle", "random")


@dataclass
class Recall:
    mode: str = "attention"
    k: int = 4
    scoring: str = "sum"  # "sum": one ranking summed over layers; "vote": each layer votes for its top k
    at: str = "end"  # where recalled spans sit: "end" (before the question) or "front" (after the sinks)
    reps: int = 32  # representative keys per scoring layer and KV head, besides the mean key
    layers: tuple[int, ...] | None = (0,)  # the layers whose queries score spans (None: every layer)
    window: int = 64  # turn queries observed to pick representatives (policies without a window of their own)
    resident: float = 0.5  # a span with at least this share of its tokens still cached is not recalled
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"recall mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.scoring not in ("sum", "vote"):
            raise ValueError(f"recall scoring must be 'sum' or 'vote', got {self.scoring!r}")
        if self.at not in ("end", "front"):
            raise ValueError(f"recall placement must be 'end' or 'front', got {self.at!r}")
        if self.k < 1 or self.reps < 1 or self.window < 1:
            raise ValueError("recall k, reps and window must be at least 1")
        self.rng = random.Random(self.seed)


def parse_policy(name: str) -> tuple[str, Recall | None]:
    """'inf_mllm+recall' → ('inf_mllm', Recall()); '+recall_oracle' / '+recall_random' pick the mode."""
    base, plus, extra = name.partition("+")
    if not plus:
        return base, None
    mode = {"recall": "attention", "recall_oracle": "oracle", "recall_random": "random"}.get(extra)
    if mode is None:
        raise ValueError(f"unknown policy suffix {'+' + extra!r}; use +recall, +recall_oracle or +recall_random")
    return base, Recall(mode=mode)


# --- storing a turn ---------------------------------------------------------------------------------


def scoring_layers(recall: Recall, num_layers: int) -> list[int]:
    layers = range(num_layers) if recall.layers is None else recall.layers
    if not layers or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"recall layers must lie in 0..{num_layers - 1}, got {recall.layers}")
    return sorted(set(layers))


def make_span(cache, span_id: int, length: int, recall: Recall, meta: dict) -> Span:
    """The last `length` tokens of every layer as a span: keys de-rotated to 0..length-1, and, in the
    scoring layers, a summary of the mean key plus `reps` keys the turn's own window attended to most
    (all of them for a short turn), per KV head, without RoPE."""
    keys, values, summary = [], [], []
    scoring = set(scoring_layers(recall, len(cache.layers)))
    for i, layer in enumerate(cache.layers):
        n = layer.get_seq_length()
        k = layer.keys[0, :, n - length:]  # (H, L, d), at positions n-L..n-1
        k = cache.rotations.rotate(k, torch.full((1, length), -(n - length), device=k.device)) if n > length else k
        keys.append(k)
        values.append(layer.values[0, :, n - length:])
        if i not in scoring:
            continue
        bare = rerotate(k, -torch.arange(length, device=k.device), cache.inv_freq)  # no RoPE at all
        h = k.shape[0]
        scores = layer.window_scores
        if scores is not None and scores.shape[-1] == n:
            s = scores[0, :, n - length:].reshape(h, -1, length).mean(dim=1)  # (Hkv, L)
        else:  # no observation: the keys with the largest norm stand out in q·k
            s = bare.float().norm(dim=-1)
        top = s.topk(min(recall.reps, length), dim=-1).indices
        top = torch.cat([top, top[:, -1:].expand(-1, recall.reps - top.shape[1])], dim=-1)
        picked = bare.gather(1, top[..., None].expand(-1, -1, bare.shape[-1]))
        summary.append(torch.cat([bare.mean(dim=1, keepdim=True), picked], dim=1))
    return Span(span_id, length, torch.stack(summary).to(torch.float16), meta,
                torch.stack(keys).clone(), torch.stack(values).clone())


# --- choosing spans ---------------------------------------------------------------------------------


def resident_spans(cache, store: SpanStore, share: float) -> set[int]:
    """Stored spans with at least `share` of their tokens still cached (over layers and heads)."""
    ids = torch.cat([layer.turn_ids.reshape(-1) for layer in cache.layers if layer.turn_ids is not None])
    ids = ids[ids >= 0]
    if not ids.numel():
        return set()
    counts = torch.bincount(ids)
    slots = sum(layer.turn_ids.shape[1] for layer in cache.layers if layer.turn_ids is not None)  # layers x heads
    return {i for i in store.spans if i < len(counts) and counts[i] >= share * store.spans[i].length * slots}


def span_scores(cache, store: SpanStore, candidates: list[int], recall: Recall) -> torch.Tensor:
    """(N, scoring layers) z-normalised scores of the candidate spans against the captured question queries."""
    ids, summaries = store.summaries()
    rows = torch.tensor([ids.index(i) for i in candidates])
    s = summaries[rows].float()  # (N, layers, Hkv, R, d)
    queries = []
    for i in scoring_layers(recall, len(cache.layers)):
        q, first = cache.layers[i].queries  # (1, Hq, l, d), positions first..first+l-1
        pos = first + torch.arange(q.shape[2], device=q.device)
        bare = rerotate(q[0], -pos, cache.inv_freq).float()  # (Hq, l, d)
        hkv = s.shape[2]
        queries.append(bare.reshape(hkv, -1, *bare.shape[1:]))  # query head h belongs to KV head h // groups
    q = torch.stack(queries)  # (scoring layers, Hkv, query heads per KV head, queries, d)
    # each query head's best match (over the span's keys and the question's queries), z-normalised over
    # the spans so that no head's scale dominates, then averaged over heads
    logits = torch.einsum("nlhrd,lhgmd->nlhgmr", s, q).amax(dim=(-1, -2))  # (N, L, Hkv, G)
    if logits.shape[0] > 1:
        logits = (logits - logits.mean(dim=0)) / logits.std(dim=0).clamp_min(1e-6)
    return logits.mean(dim=(2, 3))


def choose(cache, store: SpanStore, recall: Recall, oracle: Callable[[dict], bool] | None = None) -> list[int]:
    """Span ids to link for the question whose queries the cache just captured, in time order."""
    resident = resident_spans(cache, store, recall.resident)
    candidates = [i for i in sorted(store.spans) if i not in resident]
    if not candidates:
        return []
    if recall.mode == "oracle":
        if oracle is None:
            raise ValueError("recall mode 'oracle' needs the question's target (oracle=)")
        return [i for i in candidates if oracle(store.spans[i].meta)][: recall.k]
    if recall.mode == "random":
        return sorted(recall.rng.sample(candidates, min(recall.k, len(candidates))))
    z = span_scores(cache, store, candidates, recall)
    k = min(recall.k, len(candidates))
    if recall.scoring == "sum":
        order = z.sum(dim=1).topk(k).indices
    else:
        votes = torch.zeros(len(candidates))
        votes.index_add_(0, z.topk(k, dim=0).indices.reshape(-1), torch.ones(k * z.shape[1]))
        order = (votes + 1e-3 * z.sum(dim=1).softmax(dim=0)).topk(k).indices
    return sorted(candidates[i] for i in order.tolist())


# --- linking and unlinking --------------------------------------------------------------------------


def link(cache, store: SpanStore, span_ids: list[int], at: str) -> list[int]:
    """Insert the spans' KV as one block (in the given order) into every layer; returns those linked."""
    blocks = [(i, store.kv(i)) for i in span_ids]
    blocks = [(i, kv) for i, kv in blocks if kv is not None]  # a corrupt file drops its span
    if not blocks:
        return []
    keys, values, tags, offset = [], [], [], 0
    for span_id, (k, v) in blocks:  # (layers, H, k, d) each, keys at 0..k-1 → offset..offset+k-1
        shift = torch.full((1, 1, k.shape[2]), offset, device=k.device)
        keys.append(cache.rotations.rotate(k, shift) if offset else k)
        values.append(v)
        tags.append(torch.full((k.shape[2],), -1 - span_id, dtype=torch.long))
        offset += k.shape[2]
    keys, values, tag = torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(tags)
    for i, layer in enumerate(cache.layers):
        n = layer.get_seq_length()
        pos = n if at == "end" else min(4, n)
        layer.insert(pos, keys[i][None], values[i][None], tag)
    return [i for i, _ in blocks]


def unlink(cache) -> None:
    """Take linked (recalled) tokens out of every layer; the rest close up to contiguous positions."""
    for layer in cache.layers:
        ids = layer.turn_ids
        if ids is None or not bool((ids < 0).any()):
            continue
        keep = (ids[:, 0] >= 0).nonzero()[:, 1][None]  # linking is uniform over heads and batch 1
        layer.keep(keep)
