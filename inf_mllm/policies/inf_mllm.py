"""Inf-MLLM (Ning et al. 2024), Algorithm 1: at each new prompt, the last l = window prompt queries score
every older token (S, mean attention over all query heads), a recency bias D_j = -(c - 1 - j) b / c
favours newer candidates, and a layer keeps the top r = budget - l of S + D plus the l window tokens,
one index set shared by its heads."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import WindowScored


def recency_bias(candidates: int, bias: float, device) -> torch.Tensor:
    """D_j = -(c - 1 - j) * b / c: the oldest candidate gets about -b, the newest 0."""
    return -torch.arange(candidates - 1, -1, -1, device=device, dtype=torch.float32) * (bias / candidates)


MAX_BIAS = 1e6


@dataclass
class InfMLLM(WindowScored):
    name: ClassVar[str] = "inf_mllm"
    window: int = 64
    bias: float = 0.01
    window_role: ClassVar[str] = "retrieval window"

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.bias <= MAX_BIAS:  # NaN fails too; a huge b overflows the float32 scores into NaN
            raise ValueError(f"{self.name} bias must be a number from 0 to {MAX_BIAS:g}, got {self.bias}")

    def adjust(self, s):
        return s + recency_bias(s.shape[-1], self.bias, s.device)
