"""StreamingLLM (Xiao et al. 2023): the first `sinks` tokens, which soak up attention however
irrelevant they are (attention sinks), plus the most recent ones."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, newest


@dataclass
class StreamingLLM(Policy):
    name: ClassVar[str] = "streaming_llm"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"streaming_llm sinks must be >= 0, got {self.sinks}")

    def min_budget(self):
        return self.sinks + 1

    def always_kept(self):
        return f"its {self.sinks} sink tokens and one recent token"

    def select(self, view, budget):
        return torch.cat([torch.arange(self.sinks), newest(view.n, budget - self.sinks, "cpu")]).expand(1, -1)
