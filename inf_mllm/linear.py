"""The language model's matrix products on oneDNN, on a CPU (issue 70): an opt-in, measured, not the default.

A decode step on a CPU is matrix products of one row (a lone stream) or a few (a pool's streams) against every
weight. torch sends `nn.Linear` to MKL, whose small-row products on the AMD EPYC measured here read the weights at a
third of the machine's bandwidth, and two rows cost about twice one (`python -m benchmarks cpu_step`). oneDNN, which
torch ships too, runs the same products from a weight packed once for it at up to 2.5x the speed, and a few rows for
little more than one. Its sums run in another order, so logits differ from the default's in their last bits (~1e-4)
and a greedy token can differ; hence an option, its tokens and answers measured beside its speed (results README
"cpu_step"), while the default stays torch's own.

`INF_MLLM_LINEAR=onednn` turns it on for tiny-vlm (after its LoRA is merged into the weights); `use_onednn(model)`
for any Llama-like model. Inference only: a packed weight has no gradient. The output head gets a packed copy of its
matrix (SmolLM2 shares it with the input embeddings: 113 MB more).
"""

import os

import torch
from torch import nn

ENV = "INF_MLLM_LINEAR"  # "onednn" to opt in; "torch" (the default) keeps nn.Linear


class OneDnnLinear(nn.Module):
    """An `nn.Linear` (no bias) whose weight is packed for oneDNN's products."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("OneDnnLinear takes a layer without a bias")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)  # packed for one row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, None, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def chosen() -> str:
    """"onednn" or "torch", from `ENV`; ValueError (one line) for another value or where oneDNN cannot run."""
    value = os.environ.get(ENV, "torch")
    if value not in ("torch", "onednn"):
        raise ValueError(f"{ENV}={value!r}: choose torch or onednn")
    if value == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError(f"{ENV}=onednn: this torch has no oneDNN")
    return value


def use_onednn(model: nn.Module) -> nn.Module:
    """`model` (on the CPU, fp32) with its decoder layers' projections and its output head on oneDNN, in place."""
    for parent in list(model.model.layers.modules()) + [model]:
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and child.weight.dtype == torch.float32:
                setattr(parent, name, OneDnnLinear(child))
    return model


def as_chosen(model: nn.Module) -> nn.Module:
    """`model` on oneDNN where `ENV` asks for it and the model is on a CPU; else as it is."""
    if chosen() == "onednn" and next(model.parameters()).device.type == "cpu":
        use_onednn(model)
    return model
