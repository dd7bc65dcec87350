"""PrefixKV's maths: cumulative priority curves, the retention-ratio search, the calibration file.

A layer's curve P_l^o is the cumulative share of its importance held by its most important tokens;
one global retention ratio p gives each layer the prefix R_l = min{o | P_l^o >= p}, and a binary
search finds the p whose prefixes sum to the budget (the paper's Algorithm 1)."""

import json
from pathlib import Path

import torch


def priority_counts(curves: list[torch.Tensor], p: float) -> list[int]:
    """R_l as a token count, per layer: curves[l][j] is the cumulative normalised importance of the
    layer's j + 1 most important tokens."""
    return [min(int(torch.searchsorted(c, torch.tensor(p, dtype=c.dtype), side="left")) + 1, len(c)) for c in curves]


def search_retention(curves: list[torch.Tensor], target: int, steps: int = 60) -> tuple[float, list[int]]:
    """Binary search for the retention ratio p so that the per-layer prefix sizes sum to the target
    (sum_l R_l N = r L N). Returns p and the counts; when no p hits the target exactly, the largest p
    found whose counts stay within it."""
    curves = [c.cpu() for c in curves]  # sixty rounds of one search per layer: on the host, not a GPU sync each
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
    """Importance normalised over the layer (I / sum I), sorted descending, cumulated: (n,) -> (n,),
    ending at 1."""
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


def load_calibration(path: str) -> list[torch.Tensor]:
    """Per-layer cumulative priority curves at evenly spaced prefix ratios (written by calibrate.py)."""
    try:
        data = json.loads(Path(path).read_text())
        curves = [torch.tensor(c, dtype=torch.float64) for c in data["curves"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read PrefixKV calibration {path}: {err}") from err
    if not curves or any(len(c) != len(curves[0]) or len(c) < 3 for c in curves):
        raise ValueError(f"PrefixKV calibration {path} holds no usable curves")
    return curves
