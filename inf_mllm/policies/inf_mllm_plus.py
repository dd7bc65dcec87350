"""Inf-MLLM with the fixes our measurements called for (see ARCHITECTURE.md):

- attention sinks are always kept (the first tokens soak up attention; evicting them hurts);
- the bias is relative: the oldest candidate loses `bias` x the mean candidate score, so the same b
  works whether averaged attention is 1e-2 or 1e-4 (it falls as 1/n);
- scores are max-pooled over `pool` neighbours, keeping spans rather than lone tokens;
- each KV head keeps its own set, scored by its own query group (GQA).
"""

from dataclasses import dataclass
from typing import ClassVar

from .inf_mllm import InfMLLM, recency_bias


@dataclass
class InfMLLMPlus(InfMLLM):
    name: ClassVar[str] = "inf_mllm_plus"
    bias: float = 1.0
    sinks: int = 4
    pool: int = 7
    per_head: bool = True

    def adjust(self, s):
        return s + recency_bias(s.shape[-1], self.bias, s.device) * s.mean(dim=-1, keepdim=True)
