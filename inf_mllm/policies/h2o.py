"""H2O (Zhang et al. 2023, Heavy-Hitter Oracle): per KV head, the tokens with the most attention
accumulated over every query so far (heavy hitters) plus a recent window, `recent_ratio` of the
budget; it evicts at every decode step, as the paper does."""

from dataclasses import dataclass
from typing import ClassVar

from .base import AccScored


@dataclass
class H2O(AccScored):
    name: ClassVar[str] = "h2o"
    evict_while_decoding: ClassVar[bool] = True
    recent_ratio: float = 0.5
    per_head: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.recent_ratio < 1:
            raise ValueError("h2o recent_ratio must lie strictly between 0 and 1")

    def min_budget(self):
        return 2

    def always_kept(self):
        return "one heavy hitter and one recent token"

    def kept_recent(self, view, budget):
        return max(1, int(budget * self.recent_ratio))
