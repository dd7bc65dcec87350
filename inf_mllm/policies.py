"""Eviction policies: small dataclasses with one `select()` each, and one registry.

A policy sees one layer at a turn boundary (or, for H2O, after each decode step) and returns the
indices of the tokens to keep, in their original order: shape (B, K) for one index set per layer
shared by its heads, or (B, Hkv, K) for a set per KV head. None means keep everything.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

POLICIES: dict[str, type["Policy"]] = {}


def register(cls):
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, **kwargs) -> "Policy":
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    fields = cls_fields(POLICIES[name])
    unknown = set(kwargs) - fields
    if unknown:
        raise ValueError(f"policy {name!r} takes no option {', '.join(sorted(unknown))}")
    return POLICIES[name](**kwargs)


def cls_fields(cls) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}))


@dataclass
class LayerView:
    """What a policy may look at: the layer's length and the scores its attention produced."""

    n: int
    prompt_len: int
    num_kv_heads: int
    window_scores: torch.Tensor | None = None  # (B, Hq, n): mean attention of the window queries
    acc_scores: torch.Tensor | None = None  # (B, Hkv, n): attention accumulated since arrival


def recent(n: int, count: int, device) -> torch.Tensor:
    return torch.arange(n - count, n, device=device)


def keep_sorted(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=-1).sort(dim=-1).values


@dataclass
class Policy(ABC):
    name: ClassVar[str] = "base"
    observe: ClassVar[str | None] = None  # "window": last prompt's window queries; "all": every query
    evict_while_decoding: ClassVar[bool] = False
    window: int = 0  # retrieval window l (only for "window" observers)

    def check(self, budget: int) -> None:  # noqa: B027 - most policies fit any budget
        """Raise ValueError if this policy cannot work inside `budget` tokens."""

    @abstractmethod
    def select(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices to keep, (B, K) or (B, Hkv, K), sorted; None keeps everything."""


@register
@dataclass
class Full(Policy):
    """No eviction: the reference every bounded policy is compared with."""

    name: ClassVar[str] = "full"

    def select(self, view, budget):
        return None


@register
@dataclass
class Window(Policy):
    """Window attention: the most recent `budget` tokens."""

    name: ClassVar[str] = "window"

    def check(self, budget):
        if budget < 1:
            raise ValueError("window needs a budget of at least 1 token")

    def select(self, view, budget):
        return recent(view.n, budget, "cpu").expand(1, -1)


@register
@dataclass
class StreamingLLM(Policy):
    """StreamingLLM: the first `sinks` tokens (attention sinks) plus the most recent ones."""

    name: ClassVar[str] = "streaming_llm"
    sinks: int = 4

    def check(self, budget):
        if budget <= self.sinks:
            raise ValueError(f"streaming_llm budget {budget} must exceed its {self.sinks} sink tokens")

    def select(self, view, budget):
        return torch.cat([torch.arange(self.sinks), recent(view.n, budget - self.sinks, "cpu")]).expand(1, -1)


@register
@dataclass
class H2O(Policy):
    """H2O: heavy hitters by accumulated attention plus a recent window, per KV head; evicts at
    every decode step as the paper does."""

    name: ClassVar[str] = "h2o"
    observe: ClassVar[str | None] = "all"
    evict_while_decoding: ClassVar[bool] = True
    recent_ratio: float = 0.5

    def check(self, budget):
        if budget < 2:
            raise ValueError("h2o needs a budget of at least 2 tokens")
        if not 0 < self.recent_ratio < 1:
            raise ValueError("h2o recent_ratio must lie strictly between 0 and 1")

    def select(self, view, budget):
        acc = _require(view.acc_scores, self.name)
        n_recent = max(1, int(budget * self.recent_ratio))
        heavy = acc[..., : view.n - n_recent].topk(budget - n_recent, dim=-1).indices
        tail = recent(view.n, n_recent, acc.device).expand(*heavy.shape[:-1], -1)
        return keep_sorted(heavy, tail)


@register
@dataclass
class InfMLLM(Policy):
    """Inf-MLLM, Algorithm 1: window scores S averaged over all query heads, recency bias D,
    top-r of S + D plus the l window tokens; one index set per layer."""

    name: ClassVar[str] = "inf_mllm"
    observe: ClassVar[str | None] = "window"
    window: int = 64
    bias: float = 0.01

    def check(self, budget):
        if self.window < 1:
            raise ValueError(f"{self.name} window must be at least 1, got {self.window}")
        if self.bias < 0:
            raise ValueError(f"{self.name} bias must be >= 0, got {self.bias}")
        if budget < self.window:
            raise ValueError(f"budget {budget} is smaller than the {self.name} retrieval window {self.window}")

    def candidate_scores(self, view: LayerView, l: int) -> torch.Tensor:
        """S + D over the n - l candidates, (B, n - l)."""
        s = _require(view.window_scores, self.name)[..., : view.n - l].mean(dim=1)
        return s + recency_bias(view.n - l, self.bias, s.device)

    def select(self, view, budget):
        l = min(self.window, view.prompt_len)
        scores = self.candidate_scores(view, l)
        top = scores.topk(budget - l, dim=-1).indices
        return keep_sorted(top, recent(view.n, l, top.device).expand(top.shape[0], -1))


def recency_bias(candidates: int, bias: float, device) -> torch.Tensor:
    """D_j = -(c - 1 - j) * b / c: the oldest candidate gets about -b, the newest 0."""
    return -torch.arange(candidates - 1, -1, -1, device=device, dtype=torch.float32) * (bias / candidates)


def _require(scores, name):
    if scores is None:
        raise RuntimeError(
            f"{name} needs attention scores but none were observed: load the model through "
            "inf_mllm (or call use_observing_attention(model)) so its attention reports to the cache"
        )
    return scores


@register
@dataclass
class InfMLLMPlus(InfMLLM):
    """Inf-MLLM with the fixes our measurements called for (see ARCHITECTURE.md):

    - attention sinks are always kept (the first tokens soak up attention; evicting them hurts);
    - the bias is relative: the oldest candidate loses `bias` x the mean candidate score, so the
      same b works whether averaged attention is 1e-2 or 1e-4 (it falls as 1/n);
    - scores are max-pooled over `pool` neighbours, keeping spans rather than lone tokens;
    - each KV head keeps its own set, scored by its own query group (GQA).
    """

    name: ClassVar[str] = "inf_mllm_plus"
    bias: float = 1.0
    sinks: int = 4
    pool: int = 7

    def check(self, budget):
        super().check(budget)
        if budget < self.window + self.sinks:
            raise ValueError(f"budget {budget} is smaller than {self.name} window + sinks")

    def select(self, view, budget):
        l = min(self.window, view.prompt_len)
        c = view.n - l
        s = _require(view.window_scores, self.name)[..., :c]
        b, hq, _ = s.shape
        s = s.reshape(b, view.num_kv_heads, hq // view.num_kv_heads, c).mean(dim=2)  # (B, Hkv, c)
        if self.pool > 1:
            s = torch.nn.functional.max_pool1d(s, self.pool, stride=1, padding=self.pool // 2)
        s = s + recency_bias(c, self.bias, s.device) * s.mean(dim=-1, keepdim=True)
        sinks = min(self.sinks, c)
        s[..., :sinks] = float("inf")
        top = s.topk(min(budget - l, c), dim=-1).indices
        return keep_sorted(top, recent(view.n, l, top.device).expand(*top.shape[:-1], -1))
