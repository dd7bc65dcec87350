"""PrefixKV (Wang et al. 2024): importance I_l^n = mean over heads of the attention summed over all
queries, normalised per layer; layer budgets from the cumulative priority curves and a binary search
for the global retention ratio (`prefixkv_budgets`, optionally calibrated offline: priority.py); each
layer keeps its top R_l N tokens. Evicts at turn boundaries only (as Inf-MLLM does)."""

from dataclasses import dataclass
from typing import ClassVar

from .base import AccScored


@dataclass
class PrefixKV(AccScored):
    name: ClassVar[str] = "prefixkv"
    default_allocator: ClassVar[str] = "prefixkv_budgets"
