"""The policy protocol and the one selector every scoring policy shares.

A policy decides what one layer keeps (`select`, at a turn boundary; `decode_select`, after a decode
step for the policies that evict while decoding) and names the observers it needs to see attention.
A scoring policy (`Scored`) only says how much each old token matters (`score`); the selector does
the rest, with composable protections: attention `sinks`, pooling over neighbours, one set per KV head
(`per_head`) or per layer, and the newest tokens it always keeps (`kept_recent`). Options are
dataclass fields, checked in `__post_init__`; what a budget must at least hold is `min_budget`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observers import AccumulatedObserver, Observer, WindowObserver
from .registry import allocator_class
from .view import LayerView


def newest(n: int, count: int, device) -> torch.Tensor:
    """Indices of the last `count` of n tokens."""
    return torch.arange(n - count, n, device=device)


def keep_sorted(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=-1).sort(dim=-1).values


@dataclass
class Policy(ABC):
    """What to keep in one layer, with the budget allocator and reducer it runs with (set from the spec
    when built; a plain construction gets the defaults)."""

    name: ClassVar[str] = "base"
    default_allocator: ClassVar[str] = "uniform"
    default_reducer: ClassVar[str] = "evict"
    evict_while_decoding: ClassVar[bool] = False

    def __post_init__(self):
        self.allocator = allocator_class(self.default_allocator)()
        self.reducer: str = self.default_reducer

    def observers(self) -> list[Observer]:
        """What the scorer must see of attention."""
        return []

    def all_observers(self) -> list[Observer]:
        found = {}
        for obs in [*self.observers(), *self.allocator.observers()]:
            found.setdefault(obs.key, obs)
        return list(found.values())

    def min_budget(self) -> int:
        return 1

    def always_kept(self) -> str:
        """What `min_budget` holds, in words, for the error a too-small budget gets."""
        return "one token"

    def check(self, budget: int) -> None:
        """Raise ValueError if this policy cannot work inside `budget` tokens."""
        if budget < self.min_budget():
            raise ValueError(f"budget {budget} is smaller than what {self.name} always keeps: "
                             f"{self.always_kept()} ({self.min_budget()} tokens)")

    @abstractmethod
    def select(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices to keep, (B, K) or (B, Hkv, K), sorted; None keeps everything."""

    def select_layers(self, views: list[LayerView], budgets: list[int]) -> list[torch.Tensor | None]:
        """`select` for every layer over its budget (None for the others)."""
        return [self.select(v, b) if v.n > b else None for v, b in zip(views, budgets, strict=True)]

    def decode_select(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """What to keep after a decode step (only for policies that evict while decoding)."""
        return self.select(view, budget)

    def importance(self, view: LayerView) -> torch.Tensor:
        raise ValueError(f"{self.name} has no token scores for a budget allocator that needs them "
                         "(use a scoring policy, or prefixkv_budgets with a calibration file)")


@dataclass
class Scored(Policy):
    """Ranked by `score`: raw per-head scores of the candidates -> heads averaged per layer, or per KV head
    (`per_head`) -> pooled over `pool` neighbours -> `adjust` (e.g. a recency bias) -> `sinks` forced in
    -> top (budget - kept_recent) plus the `kept_recent(view, budget)` newest tokens, in order."""

    sinks: int = 0
    pool: int = 1
    pool_mode: str = "max"
    per_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.pool_mode not in ("max", "avg"):
            raise ValueError(f"{self.name} pool_mode must be 'max' or 'avg', got {self.pool_mode!r}")
        if self.pool < 1 or self.sinks < 0:
            raise ValueError(f"{self.name} pool must be >= 1 and sinks >= 0")

    @abstractmethod
    def score(self, view: LayerView, c: int) -> torch.Tensor:
        """Raw scores of the c oldest tokens, (B, H, c) per query head (or per KV head)."""

    def kept_recent(self, view: LayerView, budget: int) -> int:
        """How many of the newest tokens are always kept."""
        return 0

    def protected(self) -> int:
        """Tokens every budget must leave to `kept_recent`, besides the sinks."""
        return 0

    def protected_text(self) -> str:
        return f"{self.protected()} recent tokens"

    def adjust(self, s: torch.Tensor) -> torch.Tensor:
        return s

    def min_budget(self):
        return max(1, self.sinks + self.protected())

    def always_kept(self):
        parts = [f"{self.sinks} sink tokens"] if self.sinks else []
        parts += [self.protected_text()] if self.protected() else []
        return " and ".join(parts) or super().always_kept()

    def importance(self, view):
        """Raw scores of all n tokens, averaged over heads and batch: what an allocator ranks (n,)."""
        return self.score(view, view.n).float().mean(dim=(0, 1))

    def select(self, view, budget):
        l = self.kept_recent(view, budget)
        return self._ranked(self.score(view, view.n - l), view, budget, l)

    def select_layers(self, views, budgets):
        """Layers of one length, prompt and budget (all of them, under a uniform budget) are ranked as one stack:
        one mean, top-k and sort for the model instead of one per layer, the same indices (every step works
        row by row); 30 SmolLM2 layers' selection took ~5 ms of a ~25 ms eviction on 2 CPU cores, one by one."""
        over = [i for i, (v, b) in enumerate(zip(views, budgets, strict=True)) if v.n > b]
        if (type(self).select is not Scored.select or len(over) < 2
                or len({(views[i].n, views[i].prompt_len, budgets[i]) for i in over}) > 1):
            return super().select_layers(views, budgets)
        view, budget = views[over[0]], budgets[over[0]]
        l = self.kept_recent(view, budget)
        raw = [self.score(views[i], view.n - l) for i in over]
        if len({r.shape for r in raw}) > 1:
            return super().select_layers(views, budgets)
        b, h, c = raw[0].shape
        kept = self._ranked(torch.stack(raw).view(len(over) * b, h, c), view, budget, l)
        plans = [None] * len(views)
        for i, plan in zip(over, kept.view(len(over), b, *kept.shape[1:]).unbind(0), strict=True):
            plans[i] = plan
        return plans

    def _ranked(self, raw: torch.Tensor, view: LayerView, budget: int, l: int) -> torch.Tensor:
        """The kept indices from raw scores (B, H, c) of the c = view.n - l candidates, sorted."""
        c = raw.shape[-1]
        s = heads(raw, view.num_kv_heads, self.per_head)
        if self.pool > 1:
            s = pooled(s, self.pool, self.pool_mode)
        s = self.adjust(s)
        if self.sinks:
            s[..., :min(self.sinks, c)] = float("inf")
        top = s.topk(min(budget - l, c), dim=-1).indices
        return keep_sorted(top, newest(view.n, l, top.device).expand(*top.shape[:-1], -1))


def heads(s: torch.Tensor, num_kv_heads: int, per_head: bool) -> torch.Tensor:
    """(B, H, c) -> (B, c) averaged over all heads, or (B, Hkv, c) averaged over each KV head's group."""
    if not per_head:
        return s.mean(dim=1)
    b, h, c = s.shape
    return s.reshape(b, num_kv_heads, h // num_kv_heads, c).mean(dim=2)


def pooled(s: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Scores pooled over `kernel` neighbours (same length): a token near a strong one counts too."""
    squeeze = s.dim() == 2
    x = s[:, None] if squeeze else s
    if mode == "max":
        x = torch.nn.functional.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = torch.nn.functional.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)  # zeros past the ends
    x = x[..., : s.shape[-1]]  # an even kernel yields one extra position
    return x[:, 0] if squeeze else x


@dataclass
class WindowScored(Scored):
    """Ranked by the attention of the last `window` prompt queries (Inf-MLLM's retrieval window, SnapKV's
    observation window), which are always kept."""

    window: int = 64
    window_role: ClassVar[str] = "window"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"{self.name} window must be at least 1, got {self.window}")

    def observers(self):
        return [WindowObserver(window=self.window)]

    def protected(self):
        return self.window

    def protected_text(self):
        return f"its {self.window}-token {self.window_role}"

    def score(self, view, c):
        return view.require("window", self.name)[..., :c]

    def kept_recent(self, view, budget):
        return min(self.window, view.prompt_len)


@dataclass
class AccScored(Scored):
    """Ranked by the attention every query paid each token, accumulated per KV head (H2O, PrefixKV,
    Elastic Cache)."""

    def observers(self):
        return [AccumulatedObserver()]

    def score(self, view, c):
        return view.require("acc", self.name)[..., :c]
