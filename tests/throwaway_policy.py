"""A policy written outside the core, with a statistic the core has never heard of: registered by one line in
`inf_mllm.spec.SCORERS` (tests/test_new_policy.py), it runs on the real model with no edit to the cache, the
layer, the view or the observers' module.

"peak" ranks tokens by the highest mean attention any forward (prompt or decode step) paid them, per KV head; a
merged bucket keeps its members' highest."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from inf_mllm.observers import Observer, Statistic
from inf_mllm.policies import Scored


@dataclass(frozen=True)
class PeakObserver(Observer):
    key: str = "peak"
    stats: ClassVar = (Statistic("peak", lasting=True, merge="max"),)

    def queries(self, forward, q_len):
        return q_len

    def record(self, stats, scores, l, query, keys, scaling):
        b, hq, n = scores.shape
        peak = stats["peak"]
        torch.maximum(peak, scores.reshape(b, keys.shape[1], hq // keys.shape[1], n).amax(dim=2), out=peak)


@dataclass
class Peak(Scored):
    name: ClassVar[str] = "peak"

    def observers(self):
        return [PeakObserver()]

    def score(self, view, c):
        return view.require("peak", self.name)[..., :c]
