"""What a policy needs to see of its layer's attention, as small objects the cache consults.

A policy (and its budget allocator) names the observers it needs; each observer declares the statistics it
keeps (`Statistic`: per token or not, lasting or spent by an eviction, how a merge combines it), says how many
of a forward's last queries it wants scored (`queries`), and records what the attention function computed
(`record`) into the layer's `stats`. The layer treats every statistic by its declaration alone (`Statistics`),
so a new statistic is a new observer, with no edit to the cache, the layer or the view.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

MERGES = ("sum", "max")  # how a merge combines a bucket of a lasting per-token statistic


@dataclass(frozen=True)
class Statistic:
    """One statistic a layer keeps for its observers.

    `per_token`: a value per cached token, (B, H, n), which follows the tokens when they are kept, merged,
    linked or rolled back (else a value per layer or head, such as VL-Cache's sparsity). `lasting`: it holds
    across turns and decode steps, grown by zeros for each new token (H2O's accumulated attention, per KV head);
    otherwise it belongs to the last prompt, is current only while its length is the layer's, and an eviction
    spends it. `merge`: how Elastic's merge combines a bucket's values of a lasting per-token statistic (`MERGES`)."""

    key: str
    per_token: bool = True
    lasting: bool = False
    merge: str = "sum"

    def __post_init__(self):
        if self.merge not in MERGES:
            raise ValueError(f"statistic {self.key}: merge must be one of {', '.join(MERGES)}, got {self.merge!r}")

    @property
    def grows(self) -> bool:
        return self.per_token and self.lasting


@dataclass(frozen=True)
class Observer:
    key: str = "base"  # its primary statistic: what a policy ranks by, and what says whether scores are current
    stats: ClassVar[tuple[Statistic, ...]] = ()

    def queries(self, forward, q_len: int) -> int:
        """How many of this forward's last queries this observer wants scored (0: none); `forward` is the
        cache's `Forward` (decoding or not, the prompt's vision span)."""
        return 0

    def record(self, stats: "Statistics", scores: torch.Tensor, l: int, query: torch.Tensor, keys: torch.Tensor,
               scaling: float) -> None:
        """scores (B, Hq, n): mean attention of the last l queries; query (B, Hq, l, D) are those queries."""


@dataclass(frozen=True)
class WindowObserver(Observer):
    """Mean attention of each prompt's last `window` queries (Inf-MLLM's retrieval window, SnapKV's
    observation window); nothing while decoding."""

    key: str = "window"
    window: int = 64
    stats: ClassVar = (Statistic("window"),)

    def queries(self, forward, q_len):
        return 0 if forward.decoding else min(self.window, q_len)

    def record(self, stats, scores, l, query, keys, scaling):
        stats["window"] = scores


@dataclass(frozen=True)
class AccumulatedObserver(Observer):
    """Attention summed over every query since each token arrived, per KV head (H2O, Elastic Cache,
    PrefixKV); decode steps count too. The prompt's mean attention is also kept as the window scores."""

    key: str = "acc"
    stats: ClassVar = (Statistic("acc", lasting=True), Statistic("window"))

    def queries(self, forward, q_len):
        return q_len

    def record(self, stats, scores, l, query, keys, scaling):
        stats["window"] = scores
        b, hq, n = scores.shape
        hkv = keys.shape[1]
        stats["acc"] += scores.reshape(b, hkv, hq // hkv, n).sum(dim=2) * l


@dataclass(frozen=True)
class PostVisionObserver(Observer):
    """VL-Cache's post-vision attention: the queries of the text after the last visual token.

    In a turn whose vision span the session announced (`forward.vision_end`), those are the turn's tokens
    after the span; in a text turn after any visual one, the whole turn. With no vision span known at
    all (a text stream) there is no modality boundary, so it falls back to the last `window` queries.
    Records the mean post-vision attention ("post") and the per-head sparsity of the thresholded
    post-vision attention matrix ("sparsity", (B, Hq)), VL-Cache's gamma before the head average.
    """

    key: str = "post"
    window: int = 64
    p: float = 0.01
    stats: ClassVar = (Statistic("post"), Statistic("sparsity", per_token=False))

    def queries(self, forward, q_len):
        if forward.decoding:
            return 0
        end = forward.vision_end
        if end is not None:  # this turn holds visual tokens: the text after the last one
            tail = q_len - end
            return tail if tail > 0 else min(self.window, q_len)
        if forward.vision_seen:
            return q_len
        return min(self.window, q_len)

    def record(self, stats, scores, l, query, keys, scaling):
        stats["post"] = scores
        stats["sparsity"] = threshold_sparsity(query, keys, scaling, self.p)


def declared(observers) -> dict[str, Statistic]:
    """Every statistic the observers keep, by key (the first declaration of a key wins)."""
    found: dict[str, Statistic] = {}
    for obs in observers:
        for stat in obs.stats:
            found.setdefault(stat.key, stat)
    return found


class Statistics(dict):
    """A layer's statistics by key, treated by their declarations (`Statistic`). A lasting per-token statistic
    lives in a buffer of its own (buffer.py) that grows by decode steps without a new tensor each step."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self._buffers: dict = {}

    def __getstate__(self) -> dict:
        """Pickled without its layer, which points it back at itself when unpickled (`StreamingLayer.__setstate__`)."""
        return {k: v for k, v in vars(self).items() if k != "layer"}

    def _declared(self) -> dict[str, Statistic]:
        return self.layer.setup.statistics

    def put(self, key: str, value: torch.Tensor) -> None:
        """stats[key] = value, written into the statistic's buffer when it has one (an eviction's kept rows)."""
        buf = self._buffers.get(key)
        if buf is not None:
            buf.set(value)
            value = buf.get()
        self[key] = value

    def grow(self, new: int) -> None:
        """Zeros for the `new` tokens just appended, in every lasting per-token statistic (one row per KV head)."""
        from .buffer import KVBuffer

        keys = self.layer.keys
        for key, stat in self._declared().items():
            if not stat.grows:
                continue
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = KVBuffer(self.layer.setup.static)
                buf.least = self.layer.least
            buf.set(self.get(key))
            self[key] = buf.append(torch.zeros((*keys.shape[:2], new), dtype=torch.float32, device=keys.device))

    def insert(self, at: int, m: int) -> None:
        """Zeros for m tokens linked in at index `at`, in every lasting per-token statistic."""
        for key, value in self.lasting():
            buf = self._buffers[key]
            buf.insert(at, torch.zeros((*value.shape[:2], m), dtype=value.dtype, device=value.device))
            self[key] = buf.get()

    def cut(self, at: int, m: int) -> None:
        """The m tokens from index `at` taken out of every lasting per-token statistic."""
        for key, _ in self.lasting():
            buf = self._buffers[key]
            buf.cut(at, m)
            self[key] = buf.get()

    def lasting(self):
        """(key, value) of the per-token statistics that follow the tokens across evictions."""
        declared = self._declared()
        return [(k, v) for k, v in self.items() if k in declared and declared[k].grows]

    def spend(self) -> None:
        """An eviction spends the prompt's statistics."""
        declared = self._declared()
        for key in [k for k in self if not (k in declared and declared[k].lasting)]:
            del self[key]

    def current(self, key: str, n: int) -> bool:
        """Whether statistic `key` is there and belongs to the layer's n tokens (a prompt's statistic is stale once
        the layer's length changed: answer tokens came in, or an eviction)."""
        value = self.get(key)
        if value is None:
            return False
        stat = self._declared().get(key, Statistic(key))
        return stat.lasting or not stat.per_token or value.shape[-1] == n

    def mark(self) -> dict:
        """A copy to roll back to: lasting statistics are added to in place, so they are cloned."""
        declared = self._declared()
        return {k: v.clone() if k in declared and declared[k].lasting else v for k, v in self.items()}

    def buffers(self) -> list:
        return list(self._buffers.values())

    def restore(self, mark: dict) -> None:
        self.clear()
        self.update(mark)


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
