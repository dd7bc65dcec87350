"""The attention function that lets a streaming cache see its layer's queries.

Registered with transformers' AttentionInterface as ``inf_mllm_sdpa``. A plain forward is exactly
transformers' SDPA. When the cache layer just updated asks for window scores (the last l queries of
a prompt), those l queries' attention is computed by `scoring.window_attention`, which returns the
scores as a by-product, and SDPA handles the rest of the prompt; on CUDA, SDPA computes everything
and the Triton kernel adds the scores. No model code is patched.
"""

import time
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .scoring import window_attention, window_scores

ATTN_IMPLEMENTATION = "inf_mllm_sdpa"

# The cache layer whose `update` ran last in this thread; the attention call that follows belongs to it.
_active_layer: ContextVar = ContextVar("inf_mllm_active_layer", default=None)


def announce(layer) -> None:
    _active_layer.set(layer)


def _bool_mask(attention_mask, b, q_len, n, device):
    """The 4D keep-mask (B, 1, q, n) for the prompt, causal when transformers passed none."""
    if attention_mask is None:
        q_pos = torch.arange(q_len, device=device) + n - q_len
        return (torch.arange(n, device=device)[None, :] <= q_pos[:, None]).expand(b, 1, q_len, n)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def observing_sdpa(module, query, key, value, attention_mask, **kwargs):
    layer = _active_layer.get()
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _active_layer.set(None)
    t0 = time.perf_counter()
    try:
        return _observed_attention(layer, module, query, key, value, attention_mask, **kwargs)
    finally:
        layer.cache.score_s += time.perf_counter() - t0


def _observed_attention(layer, module, query, key, value, attention_mask, **kwargs):
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    l = layer.window_len(query.shape[2])
    if l == 0 or query.is_cuda:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if l:
            layer.observe_scores(window_scores(query[:, :, -l:], key, scaling), l)
        return out
    b, _, q_len, _ = query.shape
    n = key.shape[2]
    mask = _bool_mask(attention_mask, b, q_len, n, query.device)
    win_mask = mask[:, :, -l:] if attention_mask is not None else None  # padding; causality is built in
    win_out, scores = window_attention(query[:, :, -l:], key, value, scaling, win_mask)
    layer.observe_scores(scores, l)
    win_out = win_out.transpose(1, 2)
    if l == q_len:
        return win_out.contiguous(), None
    head_out, _ = sdpa_attention_forward(module, query[:, :, :-l], key, value, mask[:, :, :-l], **kwargs)
    return torch.cat([head_out, win_out.to(head_out.dtype)], dim=1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, observing_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_observing_attention(model) -> None:
    """Switch a loaded model to the observing SDPA attention (same numbers as plain SDPA)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
