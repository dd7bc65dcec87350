"""Elastic Cache (Liu et al. 2024), importance-driven cache merging.

Instruction encoding (each turn boundary): importance I_n = layer-wise sum of attention over every
query, averaged over heads (its Eq. 1 and I_n^i); anchors = the top gamma*T tokens, gamma*T being the
layer's budget; one bucket layout per layer shared by its heads; every token goes to its nearest
anchor's bucket (midpoints, Eq. 2) and each bucket's K/V is its mean (Eq. 3) — the `merge` reducer
(`StreamingLayer.merge`). As its Sec. 4 implements it (after StreamingLLM), the first and the most recent
token are protected: always anchors, each a bucket of its own; the other anchors and buckets share the rest.
Output generation: fixed-point elimination — once a layer is over budget, each decode step removes the token
`truncation` places from the end (the paper fixes it at the 25 most recent), so the first tokens (the
instruction) and the most recent ones stay."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import AccScored


@dataclass
class Elastic(AccScored):
    name: ClassVar[str] = "elastic"
    default_reducer: ClassVar[str] = "merge"
    evict_while_decoding: ClassVar[bool] = True
    merge_protects_ends: ClassVar[bool] = True  # merge.py: the first and last anchors merge nothing into them
    truncation: int = 25
    sinks: int = 1  # the first token, protected

    def kept_recent(self, view, budget):
        return 1  # the most recent token, protected

    def protected(self):
        return 1

    def protected_text(self):
        return "the most recent token"

    def decode_select(self, view, budget):
        excess = view.n - budget
        if excess <= 0:
            return None
        cut = max(view.n - self.truncation, excess)  # the fixed truncation point (a short layer: its oldest go)
        return torch.cat([torch.arange(cut - excess), torch.arange(cut, view.n)]).expand(1, -1)
