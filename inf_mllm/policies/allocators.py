"""Budget allocators: per-layer budgets for one eviction from the nominal ones, never more in total.

`uniform` keeps every layer at its nominal budget (Inf-MLLM, H2O, StreamingLLM); PrefixKV and
VL-Cache move tokens between layers by what each layer's attention looks like. Ours in both: a layer
gets at most `cap` x its nominal budget, so positions stay inside the trained context, and never less
than its scorer's own minimum (recent window and sinks)."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observers import Observer, PostVisionObserver
from .priority import load_calibration, priority_curve, search_retention
from .view import LayerView


@dataclass
class Allocator:
    name: ClassVar[str] = "base"

    def observers(self) -> list[Observer]:
        return []

    def allocate(self, policy, views: list[LayerView | None], budgets: list[int]) -> list[int]:
        return list(budgets)


@dataclass
class Uniform(Allocator):
    """Every layer keeps its nominal budget."""

    name: ClassVar[str] = "uniform"


def fit(tokens: list[float], views, budgets, floor: int, cap: float) -> list[int]:
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


@dataclass
class VLCacheBudgets(Allocator):
    """VL-Cache's sparsity-aware budgets (its Algorithm 1, SkewedCacheBudgetAllocation): gamma_l, the
    head-mean share of post-vision attention entries that ThresholdFilter(A', p) zeroes, then
    beta_l = clip((1 - gamma_l) / Z * alpha * L, 0.01, 1) with Z = sum_l (1 - gamma_l) and alpha the
    overall kept ratio (nominal tokens over cached tokens); a layer keeps beta_l of its tokens."""

    name: ClassVar[str] = "vl_cache_budgets"
    p: float = 0.01
    cap: float = 4.0

    def observers(self):
        return [PostVisionObserver(p=self.p)]

    def allocate(self, policy, views, budgets):
        if any(v is None or v.stat("sparsity") is None for v in views):
            return list(budgets)  # a layer saw no post-vision queries (a restore, an OOM retry): stay uniform
        density = torch.stack([1 - v.stat("sparsity").float().mean() for v in views])  # 1 - gamma_l
        alpha = sum(budgets) / sum(v.n for v in views)
        beta = (density / density.sum() * alpha * len(views)).clamp(0.01, 1.0)
        tokens = [float(b) * v.n for b, v in zip(beta, views, strict=True)]
        return fit(tokens, views, budgets, policy.min_budget(), self.cap)


@dataclass
class PrefixKVBudgets(Allocator):
    """PrefixKV's adaptive prefix sizes (see priority.py). With `calibration` (a file written by
    `python -m inf_mllm calibrate`), the curves are the offline estimate averaged over calibration
    samples, as the paper does; without it, each eviction uses the layer's own importance (the
    scorer's raw scores, head-averaged): PrefixKV's online variant."""

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
        return fit(tokens, views, budgets, policy.min_budget(), self.cap)
