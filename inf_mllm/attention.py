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
from torch.nn.attention import SDPBackend, sdpa_kernel
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


# (transformers' mask, (the window's keep-mask if it hides more than causality else None, its shape)): one mask
# serves every layer of a forward, so it is checked once; the tuple is replaced whole, safe across threads
_last_window_mask: tuple = (None, (None, None))


def _beyond_causality(attention_mask, win_mask):
    """`win_mask` (B, 1, l, n) if it hides a key that causality alone would show (padding, a sliding window),
    else None: the window attention builds causality in, and masking its (heads x l x n) logits a second time
    for nothing cost ~5 ms of a SmolLM2 prompt on 2 CPU cores."""
    global _last_window_mask
    seen, (needed, shape) = _last_window_mask
    if seen is attention_mask and shape == win_mask.shape:
        return needed
    l, n = win_mask.shape[-2:]
    shown = torch.arange(n, device=win_mask.device)[None, :] <= torch.arange(n - l, n, device=win_mask.device)[:, None]
    needed = None if bool((win_mask | ~shown).all()) else win_mask
    _last_window_mask = (attention_mask, (needed, win_mask.shape))
    return needed


# SDPA's kernels on a GPU, cuDNN's left out: cuDNN plans its attention for each new key length, and a streaming
# cache gives it a new one at every decode step (1.5 ms of host time per layer on an H100, ~3x a 7B model's
# decode step); flash and memory-efficient attention take any length as it comes.
GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def observing_sdpa(module, query, key, value, attention_mask, **kwargs):
    if query.is_cuda and not torch.compiler.is_compiling():  # a compiled step's key length never changes
        with sdpa_kernel(GPU_SDPA_BACKENDS):
            return _observing_sdpa(module, query, key, value, attention_mask, **kwargs)
    return _observing_sdpa(module, query, key, value, attention_mask, **kwargs)


def _observing_sdpa(module, query, key, value, attention_mask, **kwargs):
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
        # layers hold different token counts (per-layer budgets) but end at one position: the mask,
        # built for the cache's position length, is this layer's on its last columns
        attention_mask = attention_mask[..., -key.shape[2]:]
    if torch.compiler.is_compiling():  # a compiled decode step (compiled.py) observes nothing
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = _active_layer.get()
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _active_layer.set(None)
    l = layer.window_len(query.shape[2])
    if l == 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    cache = layer.cache
    if query.is_cuda:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        t0 = measured_clock(cache, query.device)
        layer.observe_scores(window_scores(query[:, :, -l:], key, scaling), l, query[:, :, -l:], key, scaling)
        cache.score_s += measured_clock(cache, query.device) - t0
        return out
    b, _, q_len, _ = query.shape
    # transformers' mask matters in the window only for padding (causality is built in there); the
    # causal mask for SDPA is built only when SDPA runs on part of the prompt
    def full_mask():
        return _bool_mask(attention_mask, b, q_len, key.shape[2], query.device)

    win_mask = None if attention_mask is None else _beyond_causality(attention_mask, full_mask()[:, :, -l:])
    t0 = time.perf_counter()
    win_out, scores = window_attention(query[:, :, -l:], key, value, scaling, win_mask)
    layer.observe_scores(scores, l, query[:, :, -l:], key, scaling)
    fused = time.perf_counter() - t0
    if cache.measure_overhead:  # what plain SDPA would have spent on these queries: the scores cost the rest
        t0 = time.perf_counter()
        sdpa_attention_forward(module, query[:, :, -l:], key, value, full_mask()[:, :, -l:], **kwargs)
        plain = time.perf_counter() - t0
        cache.probe_s += plain
        fused = max(0.0, fused - plain)
    cache.score_s += fused
    win_out = win_out.transpose(1, 2)
    if l == q_len:
        return win_out.contiguous(), None
    head_out, _ = sdpa_attention_forward(module, query[:, :, :-l], key, value, full_mask()[:, :, :-l], **kwargs)
    return torch.cat([head_out, win_out.to(head_out.dtype)], dim=1), None


def measured_clock(cache, device) -> float:
    """The time, after the GPU's queued work when a benchmark measures (`cache.measure_overhead`): CUDA runs
    asynchronously, and without a sync one step's kernels would be timed as the next step."""
    if cache.measure_overhead and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


AttentionInterface.register(ATTN_IMPLEMENTATION, observing_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_observing_attention(model) -> None:
    """Switch a loaded model to the observing SDPA attention (same numbers as plain SDPA)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
