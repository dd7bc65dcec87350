"""The full cache: no eviction, the reference every bounded policy is compared with."""

from dataclasses import dataclass
from typing import ClassVar

from .base import Policy


@dataclass
class Full(Policy):
    name: ClassVar[str] = "full"

    def select(self, view, budget):
        return None
