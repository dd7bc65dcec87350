"""VL-Cache (Tu et al. 2024): tokens ranked by post-vision attention (the mean attention of the text
queries after the last visual token, its modality-aware scoring, Sec. 4.2), layer budgets by its
sparsity-aware Algorithm 1 (`vl_cache_budgets`). Without a known vision span (a text stream) the
post-vision queries fall back to the last `window` queries, i.e. SnapKV-style window scores. One
index set per layer, nothing protected: the top-k of the whole cache."""

from dataclasses import dataclass
from typing import ClassVar

from ..observers import PostVisionObserver
from .base import Scored


@dataclass
class VLCache(Scored):
    name: ClassVar[str] = "vl_cache"
    default_allocator: ClassVar[str] = "vl_cache_budgets"
    window: int = 64

    def observers(self):
        return [PostVisionObserver(window=self.window, p=getattr(self.allocator, "p", 0.01))]

    def score(self, view, c):
        return view.require("post", self.name)[..., :c]
