"""Flash-VStream's small trained modules besides the LLM: the projector and the abstract-memory attention.

Shapes and parameter names follow `flash_vstream/model/multimodal_projector/builder.py`
(`mm_projector_type`: linear, mlp<N>x_gelu, identity) and the `NeuralTuringMachine` of
`flash_vstream/model/vstream_arch.py` (`compress_Turing_hidden_dim`, default 32), so a checkpoint's
`model.mm_projector.*` and `model.attention_model.*` tensors load into them unchanged.
"""

import math
import re

import torch
from torch import nn


def build_projector(kind: str, features: int, hidden: int) -> nn.Module:
    """The vision → LLM projector named by `mm_projector_type`; Flash-VStream-7B uses mlp2x_gelu."""
    if kind == "linear":
        return nn.Linear(features, hidden)
    if kind == "identity":
        return nn.Identity()
    match = re.fullmatch(r"mlp(\d+)x_gelu", kind)
    if not match:
        raise ValueError(f"unknown mm_projector_type {kind!r}")
    layers: list[nn.Module] = [nn.Linear(features, hidden)]
    for _ in range(int(match.group(1)) - 1):
        layers += [nn.GELU(), nn.Linear(hidden, hidden)]
    return nn.Sequential(*layers)


class TuringAttention(nn.Module):
    """The abstract memory's attention (their `NeuralTuringMachine`).

    Only the query/key projections shape the streaming update (`weights`); the value/output layers
    exist so the checkpoint's tensors have a home, and are unused at inference as in their code.
    """

    def __init__(self, features: int = 1024, hidden: int = 32):
        super().__init__()
        self.hidden = hidden
        self.q_proj = nn.Linear(features, hidden)
        self.k_proj = nn.Linear(features, hidden)
        self.v_proj = nn.Linear(features, hidden)
        self.out_proj = nn.Linear(hidden, features)
        self.out_ln = nn.LayerNorm(features, eps=1e-12)

    @torch.no_grad()
    def weights(self, memory: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """(M, D) memory slots, (N, D) new tokens → (M, N) softmax weights over the new tokens."""
        dtype = self.q_proj.weight.dtype
        query, key = self.q_proj(memory.to(dtype)), self.k_proj(new.to(dtype))
        return torch.softmax((query @ key.T).float() / math.sqrt(self.hidden), dim=-1)
