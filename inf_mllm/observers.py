"""What a policy needs to see of its layer's attention, as small objects the cache consults.

A policy (and its budget allocator) names the observers it needs; the cache asks them how many of a
forward's last queries to score (`queries`), lets them grow their state with the layer (`grow`), and
hands them the scores the attention function computed (`record`). What they record lives in the
layer's `seen` dict under the observer's `key`, so a new statistic is a new observer, not an edit
to the cache.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Observer:
    key: str = "base"

    def queries(self, layer, q_len: int, decoding: bool) -> int:
        """How many of this forward's last queries this observer wants scored (0: none)."""
        return 0

    def grow(self, layer, new: int) -> None:  # noqa: B027 - most observers keep nothing per token
        """`new` tokens were appended to the layer."""

    def record(self, layer, scores: torch.Tensor, l: int, query: torch.Tensor, keys: torch.Tensor,
               scaling: float) -> None:
        """scores (B, Hq, n): mean attention of the last l queries; query (B, Hq, l, D) are those queries."""


@dataclass(frozen=True)
class WindowObserver(Observer):
    """Mean attention of each prompt's last `window` queries (Inf-MLLM's retrieval window, SnapKV's
    observation window); nothing while decoding."""

    key: str = "window"
    window: int = 64

    def queries(self, layer, q_len, decoding):
        return 0 if decoding else min(self.window, q_len)

    def record(self, layer, scores, l, query, keys, scaling):
        layer.seen["window"] = scores


@dataclass(frozen=True)
class AccumulatedObserver(Observer):
    """Attention summed over every query since each token arrived, per KV head (H2O, Elastic Cache,
    PrefixKV); decode steps count too. The prompt's mean attention is also kept as the window scores."""

    key: str = "acc"

    def queries(self, layer, q_len, decoding):
        return q_len

    def grow(self, layer, new):
        keys = layer.keys
        layer.grow_seen("acc", torch.zeros((*keys.shape[:2], new), dtype=torch.float32, device=keys.device))

    def record(self, layer, scores, l, query, keys, scaling):
        layer.seen["window"] = scores
        b, hq, n = scores.shape
        hkv = keys.shape[1]
        layer.seen["acc"] += scores.reshape(b, hkv, hq // hkv, n).sum(dim=2) * l


@dataclass(frozen=True)
class PostVisionObserver(Observer):
    """VL-Cache's post-vision attention: the queries of the text after the last visual token.

    In a turn whose vision span the session announced (`cache.vision_end`), those are the turn's tokens
    after the span; in a text turn after any visual one, the whole turn. With no vision span known at
    all (a text stream) there is no modality boundary, so it falls back to the last `window` queries.
    Records the mean post-vision attention ("post") and the per-head sparsity of the thresholded
    post-vision attention matrix ("sparsity", (B, Hq)), VL-Cache's gamma before the head average.
    """

    key: str = "post"
    window: int = 64
    p: float = 0.01

    def queries(self, layer, q_len, decoding):
        if decoding:
            return 0
        cache = layer.cache
        end = cache.vision_end
        if end is not None:  # this turn holds visual tokens: the text after the last one
            tail = q_len - end
            return tail if tail > 0 else min(self.window, q_len)
        if cache.vision_seen:
            return q_len
        return min(self.window, q_len)

    def record(self, layer, scores, l, query, keys, scaling):
        layer.seen["post"] = scores
        layer.seen["sparsity"] = threshold_sparsity(query, keys, scaling, self.p)


def threshold_sparsity(query: torch.Tensor, keys: torch.Tensor, scaling: float, p: float,
                       chunk: int = 128) -> torch.Tensor:
    """VL-Cache's ComputePostVisionSparsity: the share of causal (unmasked) entries of the softmax
    attention A' of the l last queries that ThresholdFilter(A', p) zeroes, i.e. A'_ij < p * max_j A'_ij.
    Compared as logits (a softmax keeps order and ratios), so no softmax is taken. (B, Hq, l, D),
    (B, Hkv, n, D) -> (B, Hq)."""
    b, hq, l, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    cut = math.log(p)
    zeros = torch.zeros(b, hq, device=query.device)
    for s in range(0, l, chunk):
        q = query[:, :, s:s + chunk]
        m = q.shape[2]
        logits = torch.matmul(q.reshape(b, hkv, g * m, d), keys.transpose(-1, -2)).float().mul_(scaling)
        logits = logits.view(b, hkv, g, m, n)
        q_pos = torch.arange(s, s + m, device=keys.device) + n - l
        visible = torch.arange(n, device=keys.device)[None, :] <= q_pos[:, None]  # (m, n)
        logits = logits.masked_fill(~visible, float("-inf"))
        low = logits < logits.amax(dim=-1, keepdim=True) + cut
        zeros += (low & visible).sum(dim=(-1, -2)).reshape(b, hq).float()
    entries = l * (n - l) + l * (l + 1) // 2  # visible keys summed over the l queries
    return zeros / entries
