"""SnapKV (Li et al. 2024): the attention the last `window` prompt queries (its observation window) pay
each earlier token, per KV head (its per-head selection, GQA groups averaged), smoothed by a 1-D
pooling of kernel `pool` (its clustering step; average pooling as its released default), top-k of
those plus the observation window itself."""

from dataclasses import dataclass
from typing import ClassVar

from .base import WindowScored


@dataclass
class SnapKV(WindowScored):
    name: ClassVar[str] = "snapkv"
    window: int = 32
    pool: int = 5
    pool_mode: str = "avg"
    per_head: bool = True
    window_role: ClassVar[str] = "observation window"
