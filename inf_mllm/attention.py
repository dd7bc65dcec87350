"""The attention function that lets a streaming cache see its layer's queries.

Registered with transformers' AttentionInterface as ``inf_mllm_sdpa``: it computes attention with
transformers' own SDPA function, and first hands the RoPE'd queries and the layer's full keys to
the cache layer that was just updated, if that layer asked for them. No model code is patched.
"""

from contextvars import ContextVar

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "inf_mllm_sdpa"

# The cache layer whose `update` ran last in this thread; the attention call that follows belongs to it.
_active_layer: ContextVar = ContextVar("inf_mllm_active_layer", default=None)


def announce(layer) -> None:
    _active_layer.set(layer)


def observing_sdpa(module, query, key, value, attention_mask, **kwargs):
    layer = _active_layer.get()
    if layer is not None:
        _active_layer.set(None)
        if layer.layer_idx == getattr(module, "layer_idx", None):
            layer.observe(query, key, kwargs.get("scaling") or query.shape[-1] ** -0.5)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, observing_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_observing_attention(model) -> None:
    """Switch a loaded model to the observing SDPA attention (same numbers as plain SDPA)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
