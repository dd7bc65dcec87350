"""Cache policies in three independent parts: a scorer, a budget allocator and a reducer.

- A **scorer** is a small dataclass with one `score(view, c)`: how much each of the c oldest tokens
  (the candidates) of a layer matters, per head. One shared `select` turns scores into kept indices
  with composable protections: the `recent(view, budget)` tokens at the end, attention `sinks`,
  pooling over neighbours (`pool`, `pool_mode`), and one set per KV head (`per_head`) or per layer.
- An **allocator** splits the nominal per-layer budgets across layers at each eviction (`uniform`,
  PrefixKV's `prefixkv_budgets`, VL-Cache's `vl_cache_budgets`); the total never grows.
- A **reducer** applies the kept indices: `evict` gathers them, `merge` (Elastic Cache) averages every
  other token into its nearest kept one (see `StreamingLayer.merge`).

A policy string is a registered scorer, then optionally `+<allocator>` and `+<reducer>`:
``inf_mllm+vl_cache_budgets+merge``. Indices come back sorted, shape (B, K) for one set per layer
shared by its heads or (B, Hkv, K) for one per KV head; None keeps everything. What a scorer needs to
see of attention is named by its `observers()` (see observers.py).
"""

import dataclasses
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .observers import AccumulatedObserver, Observer, PostVisionObserver, WindowObserver

POLICIES: dict[str, type["Policy"]] = {}
ALLOCATORS: dict[str, type["Allocator"]] = {}
REDUCERS = ("evict", "merge")


def _add(table: dict, cls):
    if cls.name in table:
        raise ValueError(f"{cls.name!r} is registered already (by {table[cls.name].__name__})")
    table[cls.name] = cls
    return cls


def register(cls):
    """Class decorator: a named policy (scorer with its default allocator and reducer)."""
    return _add(POLICIES, cls)


def register_allocator(cls):
    return _add(ALLOCATORS, cls)


def parse_name(name: str) -> tuple[str, str | None, str | None]:
    """'inf_mllm+vl_cache_budgets+merge' -> ('inf_mllm', 'vl_cache_budgets', 'merge'); parts may be omitted."""
    base, *parts = name.split("+")
    if base not in POLICIES:
        raise ValueError(f"unknown policy {base!r}; choose one of: {', '.join(POLICIES)}")
    allocator = reducer = None
    for part in parts:
        if part in ALLOCATORS and allocator is None and reducer is None:
            allocator = part
        elif part in REDUCERS and reducer is None:
            reducer = part
        else:
            raise ValueError(f"unknown or misplaced policy part {'+' + part!r} in {name!r}: write "
                             f"<policy>[+<allocator>][+<reducer>] with allocators {', '.join(ALLOCATORS)} "
                             f"and reducers {', '.join(REDUCERS)}")
    return base, allocator, reducer


def make_policy(name: str, **kwargs) -> "Policy":
    """The policy a string names; options go to the scorer, or to the allocator that declares them."""
    base, allocator, reducer = parse_name(name)
    cls = POLICIES[base]
    alloc_cls = ALLOCATORS[allocator] if allocator else cls.default_allocator
    alloc_opts = {k: kwargs.pop(k) for k in list(kwargs) if k in cls_fields(alloc_cls) and k not in cls_fields(cls)}
    unknown = set(kwargs) - cls_fields(cls)
    if unknown:
        raise ValueError(f"policy {name!r} takes no option {', '.join(sorted(unknown))}"
                         f" (it takes: {', '.join(sorted(cls_fields(cls) | cls_fields(alloc_cls))) or 'none'})")
    policy = cls(**kwargs)
    policy.allocator = alloc_cls(**alloc_opts)
    policy.reducer = reducer or cls.default_reducer
    policy.name = name if (allocator or reducer) else cls.name
    return policy


def cls_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def policy_options(name: str) -> set[str]:
    """The options a policy string accepts (its scorer's and its allocator's)."""
    base, allocator, _ = parse_name(name)
    cls = POLICIES[base]
    return cls_fields(cls) | cls_fields(ALLOCATORS[allocator] if allocator else cls.default_allocator)


@dataclass
class LayerView:
    """What a policy may look at: the layer's length and the statistics its observers recorded."""

    n: int
    prompt_len: int
    num_kv_heads: int
    window_scores: torch.Tensor | None = None  # (B, Hq, n): mean attention of the window queries
    acc_scores: torch.Tensor | None = None  # (B, Hkv, n): attention accumulated since arrival
    post_scores: torch.Tensor | None = None  # (B, Hq, n): mean post-vision attention (VL-Cache)
    sparsity: torch.Tensor | None = None  # (B, Hq): thresholded post-vision sparsity (VL-Cache)


def recent(n: int, count: int, device) -> torch.Tensor:
    return torch.arange(n - count, n, device=device)


def keep_sorted(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=-1).sort(dim=-1).values


def _require(scores, name):
    if scores is None:
        raise RuntimeError(
            f"{name} needs attention scores but none were observed: load the model through "
            "inf_mllm (or call use_observing_attention(model)) so its attention reports to the cache"
        )
    return scores


# --- allocators --------------------------------------------------------------------------------------


@dataclass
class Allocator:
    """Per-layer budgets for one eviction from the nominal ones; their sum never exceeds the nominal sum."""

    name: ClassVar[str] = "base"

    def observers(self) -> list[Observer]:
        return []

    def allocate(self, policy: "Policy", views: list[LayerView | None], budgets: list[int]) -> list[int]:
        return list(budgets)


@register_allocator
@dataclass
class Uniform(Allocator):
    """Every layer keeps its nominal budget (Inf-MLLM, H2O, StreamingLLM)."""

    name: ClassVar[str] = "uniform"


def _fit(tokens: list[float], views, budgets, floor: int, cap: float) -> list[int]:
    """Whole budgets: at least the policy's floor, at most `cap` x the nominal and the layer's length,
    and never more in all than the nominal total (what floors add is taken from the largest layers)."""
    out = []
    for t, view, nominal in zip(tokens, views, budgets, strict=True):
        n = view.n if view is not None else nominal
        out.append(int(min(max(int(t), floor, 1), int(cap * nominal), max(n, floor))))
    excess = sum(out) - sum(budgets)
    for i in sorted(range(len(out)), key=lambda i: out[i], reverse=True):
        if excess <= 0:
            break
        take = min(excess, out[i] - max(floor, 1))
        out[i] -= take
        excess -= take
    return out


@register_allocator
@dataclass
class VLCacheBudgets(Allocator):
    """VL-Cache's sparsity-aware budgets (its Algorithm 1, SkewedCacheBudgetAllocation): gamma_l, the
    head-mean share of post-vision attention entries that ThresholdFilter(A', p) zeroes, then
    beta_l = clip((1 - gamma_l) / Z * alpha * L, 0.01, 1) with Z = sum_l (1 - gamma_l) and alpha the
    overall kept ratio (nominal tokens over cached tokens); a layer keeps beta_l of its tokens.

    Ours: `cap` bounds a layer at cap x its nominal budget so positions stay inside the trained context,
    and no layer goes below the scorer's own minimum (its recent window and sinks)."""

    name: ClassVar[str] = "vl_cache_budgets"
    p: float = 0.01
    cap: float = 4.0

    def observers(self):
        return [PostVisionObserver(p=self.p)]

    def allocate(self, policy, views, budgets):
        if any(v is None or v.sparsity is None for v in views):
            return list(budgets)  # a layer saw no post-vision queries (a restore, an OOM retry): stay uniform
        density = torch.stack([1 - v.sparsity.float().mean() for v in views])  # 1 - gamma_l
        alpha = sum(budgets) / sum(v.n for v in views)
        beta = (density / density.sum() * alpha * len(views)).clamp(0.01, 1.0)
        tokens = [float(b) * v.n for b, v in zip(beta, views, strict=True)]
        return _fit(tokens, views, budgets, policy.min_budget(), self.cap)


def priority_counts(curves: list[torch.Tensor], p: float) -> list[int]:
    """PrefixKV's R_l = min{o | P_l^o >= p} as a token count, per layer: curves[l][j] is the cumulative
    normalised importance of the layer's j + 1 most important tokens."""
    return [min(int(torch.searchsorted(c, torch.tensor(p, dtype=c.dtype), side="left")) + 1, len(c)) for c in curves]


def search_retention(curves: list[torch.Tensor], target: int, steps: int = 60) -> tuple[float, list[int]]:
    """PrefixKV's Algorithm 1: binary search for the global information retention ratio p so that the
    per-layer prefix sizes sum to the target (sum_l R_l N = r L N). Returns p and the counts; when no p
    hits the target exactly, the largest p found whose counts stay within it."""
    lo, hi = 0.0, 1.0
    best = priority_counts(curves, 0.0)
    for _ in range(steps):
        p = (lo + hi) / 2
        counts = priority_counts(curves, p)
        delta = sum(counts) - target
        if delta == 0:
            return p, counts
        if delta < 0:
            lo, best = p, counts
        else:
            hi = p
    return lo, best


def priority_curve(importance: torch.Tensor) -> torch.Tensor:
    """PrefixKV's cumulative priority: importance normalised over the layer (I / sum I), sorted
    descending, cumulated. (n,) -> (n,), ending at 1."""
    imp = importance.double().clamp_min(0)
    imp = imp / imp.sum().clamp_min(1e-30)
    return imp.sort(descending=True).values.cumsum(0)


def resample_curve(curve: torch.Tensor, points: int) -> torch.Tensor:
    """The curve at prefix ratios o = 0, 1/(points-1), ..., 1 (0 at o = 0): layers of any length compare."""
    n = len(curve)
    full = torch.cat([curve.new_zeros(1), curve])
    where = torch.linspace(0, n, points, dtype=torch.float64)
    left = where.floor().long().clamp(max=n - 1)
    frac = where - left
    return full[left] * (1 - frac) + full[left + 1] * frac


@register_allocator
@dataclass
class PrefixKVBudgets(Allocator):
    """PrefixKV's adaptive prefix sizes: per layer the normalised importance and its cumulative priority
    curve P_l^o; a binary search (its Algorithm 1) for the retention ratio p with sum_l R_l N = r L N,
    R_l = min{o | P_l^o >= p}, r the overall kept ratio.

    With `calibration` (a file written by `python -m inf_mllm calibrate`), the curves are the offline
    estimate averaged over calibration samples, as the paper does; without it, each eviction uses the
    layer's own importance (the scorer's raw scores, head-averaged): PrefixKV's online variant."""

    name: ClassVar[str] = "prefixkv_budgets"
    calibration: str | None = None
    cap: float = 4.0

    def __post_init__(self):
        self._curves = load_calibration(self.calibration) if self.calibration else None

    def allocate(self, policy, views, budgets):
        if any(v is None for v in views):
            return list(budgets)
        if self._curves is None:
            curves = [priority_curve(policy.importance(v)) for v in views]
            _, counts = search_retention(curves, sum(budgets))
            tokens = [float(c) for c in counts]
        else:  # offline curves at prefix ratios o = k / grid: search in grid steps, sum_l k_l = r L grid
            if len(self._curves) != len(views):
                raise ValueError(f"calibration {self.calibration} has {len(self._curves)} layers, "
                                 f"the model {len(views)}")
            grid = len(self._curves[0]) - 1
            r = sum(budgets) / sum(v.n for v in views)
            _, steps = search_retention([c[1:] for c in self._curves], int(r * len(views) * grid))
            tokens = [k / grid * v.n for k, v in zip(steps, views, strict=True)]
        return _fit(tokens, views, budgets, policy.min_budget(), self.cap)


def load_calibration(path: str) -> list[torch.Tensor]:
    """Per-layer cumulative priority curves at evenly spaced prefix ratios (see `calibrate`)."""
    try:
        data = json.loads(Path(path).read_text())
        curves = [torch.tensor(c, dtype=torch.float64) for c in data["curves"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read PrefixKV calibration {path}: {err}") from err
    if not curves or any(len(c) != len(curves[0]) or len(c) < 3 for c in curves):
        raise ValueError(f"PrefixKV calibration {path} holds no usable curves")
    return curves


# --- scorers -----------------------------------------------------------------------------------------


@dataclass
class Policy(ABC):
    """A named policy: what to keep in one layer (`select`), with its allocator and reducer."""

    name: ClassVar[str] = "base"
    default_allocator: ClassVar[type[Allocator]] = Uniform
    default_reducer: ClassVar[str] = "evict"
    evict_while_decoding: ClassVar[bool] = False

    def __post_init__(self):
        # set by make_policy; plain construction gets the defaults (not options: they are chosen by name)
        self.allocator: Allocator = self.default_allocator()
        self.reducer: str = self.default_reducer

    def observers(self) -> list[Observer]:
        """What the scorer must see of attention."""
        return []

    def all_observers(self) -> list[Observer]:
        found = {}
        for obs in [*self.observers(), *self.allocator.observers()]:
            found.setdefault(obs.key, obs)
        return list(found.values())

    def check(self, budget: int) -> None:
        """Raise ValueError if this policy cannot work inside `budget` tokens."""
        if budget < self.min_budget():
            raise ValueError(f"{self.name} needs a budget of at least {self.min_budget()} tokens, got {budget}")

    def min_budget(self) -> int:
        return 1

    @abstractmethod
    def select(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """Indices to keep, (B, K) or (B, Hkv, K), sorted; None keeps everything."""

    def decode_select(self, view: LayerView, budget: int) -> torch.Tensor | None:
        """What to keep after a decode step (only for policies that evict while decoding)."""
        return self.select(view, budget)

    def importance(self, view: LayerView) -> torch.Tensor:
        raise ValueError(f"{self.name} has no token scores for a budget allocator that needs them "
                         "(use a scoring policy, or prefixkv_budgets with a calibration file)")


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

    def min_budget(self):
        return self.sinks + 1

    def select(self, view, budget):
        return torch.cat([torch.arange(self.sinks), recent(view.n, budget - self.sinks, "cpu")]).expand(1, -1)


@dataclass
class Scored(Policy):
    """A policy that ranks tokens by `score`, through the shared selector:

    raw per-head scores of the candidates -> heads averaged per layer, or per KV head (`per_head`)
    -> pooled over `pool` neighbours -> `adjust` (e.g. a recency bias) -> `sinks` forced in
    -> top (budget - recent) plus the `recent(view, budget)` last tokens, in order."""

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

    def recent(self, view: LayerView, budget: int) -> int:
        """How many of the newest tokens are always kept."""
        return 0

    def adjust(self, s: torch.Tensor) -> torch.Tensor:
        return s

    def min_budget(self):
        return max(1, self.sinks + self.protected())

    def protected(self) -> int:
        return 0

    def importance(self, view):
        """Raw scores of all n tokens, averaged over heads and batch: what an allocator ranks (n,)."""
        return self.score(view, view.n).float().mean(dim=(0, 1))

    def select(self, view, budget):
        l = self.recent(view, budget)
        c = view.n - l
        s = heads(self.score(view, c), view.num_kv_heads, self.per_head)
        if self.pool > 1:
            s = pooled(s, self.pool, self.pool_mode)
        s = self.adjust(s)
        if self.sinks:
            s[..., :min(self.sinks, c)] = float("inf")
        top = s.topk(min(budget - l, c), dim=-1).indices
        return keep_sorted(top, recent(view.n, l, top.device).expand(*top.shape[:-1], -1))


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


def recency_bias(candidates: int, bias: float, device) -> torch.Tensor:
    """D_j = -(c - 1 - j) * b / c: the oldest candidate gets about -b, the newest 0."""
    return -torch.arange(candidates - 1, -1, -1, device=device, dtype=torch.float32) * (bias / candidates)


@dataclass
class AccScored(Scored):
    """Ranked by the attention every query paid each token, accumulated per KV head (H2O, PrefixKV,
    Elastic Cache)."""

    def observers(self):
        return [AccumulatedObserver()]

    def score(self, view, c):
        return _require(view.acc_scores, self.name)[..., :c]


@register
@dataclass
class H2O(AccScored):
    """H2O: heavy hitters by accumulated attention plus a recent window, per KV head; evicts at
    every decode step as the paper does."""

    name: ClassVar[str] = "h2o"
    evict_while_decoding: ClassVar[bool] = True
    recent_ratio: float = 0.5
    per_head: bool = True

    def check(self, budget):
        if budget < 2:
            raise ValueError("h2o needs a budget of at least 2 tokens")
        if not 0 < self.recent_ratio < 1:
            raise ValueError("h2o recent_ratio must lie strictly between 0 and 1")

    def min_budget(self):
        return 2

    def recent(self, view, budget):
        return max(1, int(budget * self.recent_ratio))


@dataclass
class WindowScored(Scored):
    """Ranked by the attention of the last `window` prompt queries (Inf-MLLM's retrieval window, SnapKV's
    observation window), which are always kept."""

    window: int = 64

    def observers(self):
        return [WindowObserver(window=self.window)]

    def check_window(self):
        if self.window < 1:
            raise ValueError(f"{self.name} window must be at least 1, got {self.window}")

    def check(self, budget):
        self.check_window()
        super().check(budget)

    def protected(self):
        return self.window

    def score(self, view, c):
        return _require(view.window_scores, self.name)[..., :c]

    def recent(self, view, budget):
        return min(self.window, view.prompt_len)


@register
@dataclass
class InfMLLM(WindowScored):
    """Inf-MLLM, Algorithm 1: window scores S averaged over all query heads, recency bias D,
    top-r of S + D plus the l window tokens; one index set per layer."""

    name: ClassVar[str] = "inf_mllm"
    window: int = 64
    bias: float = 0.01

    def check(self, budget):  # its own budget messages, before the generic minimum
        self.check_window()
        if self.bias < 0:
            raise ValueError(f"{self.name} bias must be >= 0, got {self.bias}")
        if budget < self.window:
            raise ValueError(f"budget {budget} is smaller than the {self.name} retrieval window {self.window}")
        if budget < self.window + self.sinks:
            raise ValueError(f"budget {budget} is smaller than {self.name} window + sinks")

    def adjust(self, s):
        return s + recency_bias(s.shape[-1], self.bias, s.device)


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
    per_head: bool = True

    def adjust(self, s):
        return s + recency_bias(s.shape[-1], self.bias, s.device) * s.mean(dim=-1, keepdim=True)


@register
@dataclass
class SnapKV(WindowScored):
    """SnapKV (Li et al. 2024): the attention the last `window` prompt queries (its observation window)
    pay each earlier token, per KV head (its per-head selection, GQA groups averaged), smoothed by a
    1-D pooling of kernel `pool` (its clustering step; average pooling as its released default), top-k
    of those plus the observation window itself."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    pool: int = 5
    pool_mode: str = "avg"
    per_head: bool = True


@register
@dataclass
class VLCache(Scored):
    """VL-Cache (Tu et al. 2024): tokens ranked by post-vision attention (the mean attention of the text
    queries after the last visual token, its modality-aware scoring, Sec. 4.2), layer budgets by its
    sparsity-aware Algorithm 1 (`vl_cache_budgets`). Without a known vision span (a text stream) the
    post-vision queries fall back to the last `window` queries, i.e. SnapKV-style window scores. One
    index set per layer, nothing protected: the top-k of the whole cache."""

    name: ClassVar[str] = "vl_cache"
    default_allocator: ClassVar[type[Allocator]] = VLCacheBudgets
    window: int = 64

    def observers(self):
        return [PostVisionObserver(window=self.window, p=getattr(self.allocator, "p", 0.01))]

    def score(self, view, c):
        return _require(view.post_scores, self.name)[..., :c]


@register
@dataclass
class PrefixKV(AccScored):
    """PrefixKV (Wang et al. 2024): importance I_l^n = mean over heads of the attention summed over all
    queries, normalised per layer; layer budgets from the cumulative priority curves and a binary
    search for the global retention ratio (`prefixkv_budgets`, optionally calibrated offline); each
    layer keeps its top R_l N tokens. Evicts at turn boundaries only (as Inf-MLLM does)."""

    name: ClassVar[str] = "prefixkv"
    default_allocator: ClassVar[type[Allocator]] = PrefixKVBudgets


@register
@dataclass
class Elastic(AccScored):
    """Elastic Cache (Liu et al. 2024), importance-driven cache merging.

    Instruction encoding (each turn boundary): importance I_n = layer-wise sum of attention over every
    query, averaged over heads (its Eq. 1 and I_n^i); anchors = the top gamma*T tokens, gamma*T being
    the layer's budget; one bucket layout per layer shared by its heads; every token goes to its
    nearest anchor's bucket (midpoints, Eq. 2) and each bucket's K/V is its mean (Eq. 3) — the `merge`
    reducer. Output generation: fixed-point elimination — once a layer is over budget, each decode
    step removes the token `truncation` places from the end (the paper fixes it at the 25 most recent),
    so the first tokens (the instruction) and the most recent ones stay."""

    name: ClassVar[str] = "elastic"
    default_reducer: ClassVar[str] = "merge"
    evict_while_decoding: ClassVar[bool] = True
    truncation: int = 25

    def decode_select(self, view, budget):
        excess = view.n - budget
        if excess <= 0:
            return None
        cut = max(view.n - self.truncation, excess)  # the fixed truncation point (a short layer: its oldest go)
        return torch.cat([torch.arange(cut - excess), torch.arange(cut, view.n)]).expand(1, -1)


# the combinations the tests run on the real model, listed by `python -m inf_mllm policies`
COMBINATIONS = (
    "inf_mllm+merge",
    "inf_mllm+vl_cache_budgets",
    "inf_mllm+prefixkv_budgets",
    "inf_mllm+vl_cache_budgets+merge",
    "inf_mllm_plus+vl_cache_budgets",
    "snapkv+vl_cache_budgets",
    "vl_cache+merge",
    "elastic+prefixkv_budgets",
    "h2o+vl_cache_budgets",
)
