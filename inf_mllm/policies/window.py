"""Window attention: the most recent `budget` tokens, nothing older."""

from dataclasses import dataclass
from typing import ClassVar

from .base import Policy, newest


@dataclass
class Window(Policy):
    name: ClassVar[str] = "window"

    def select(self, view, budget):
        return newest(view.n, budget, "cpu").expand(1, -1)
