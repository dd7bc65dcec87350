"""The attention function that lets a streaming cache see its layer's queries.

Registered with transformers' AttentionInterface as ``inf_mllm_sdpa``. A plain forward is exactly
transformers' SDPA. The cache's open forward arrives as a keyword argument of the call (`FORWARD_KWARG`, put
into the model call by `StreamingCache.forward`), which names the cache; the module's `layer_idx` names its
layer. When that layer asks for window scores (the last l queries of
a prompt), those l queries' attention is computed by `scoring.window_attention`, which returns the
scores as a by-product, and SDPA handles the rest of the prompt; on CUDA, SDPA computes everything
and the Triton kernel adds the scores. No model code is patched.
"""

import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .scoring import window_attention, window_scores

ATTN_IMPLEMENTATION = "inf_mllm_sdpa"
# the keyword argument that carries a streaming cache's open forward (cache.Forward) from the model call to every
# attention call of that forward: transformers hands a model's extra keyword arguments down to its attention
FORWARD_KWARG = "inf_mllm_forward"


def _bool_mask(attention_mask, b, q_len, n, device):
    """The 4D keep-mask (B, 1, q, n) for the prompt, causal when transformers passed none."""
    if attention_mask is None:
        q_pos = torch.arange(q_len, device=device) + n - q_len
        return (torch.arange(n, device=device)[None, :] <= q_pos[:, None]).expand(b, 1, q_len, n)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _beyond_causality(forward, attention_mask, win_mask):
    """`win_mask` (B, 1, l, n) if it hides a key that causality alone would show (padding, a sliding window),
    else None: the window attention builds causality in, and masking its (heads x l x n) logits a second time
    for nothing cost ~5 ms of a SmolLM2 prompt on 2 CPU cores. One mask serves every layer of a forward, so it is
    checked once per forward (kept on the forward: (transformers' mask, (the answer, its shape)))."""
    seen, (needed, shape) = forward.window_mask
    if seen is attention_mask and shape == win_mask.shape:
        return needed
    l, n = win_mask.shape[-2:]
    shown = torch.arange(n, device=win_mask.device)[None, :] <= torch.arange(n - l, n, device=win_mask.device)[:, None]
    needed = None if bool((win_mask | ~shown).all()) else win_mask
    forward.window_mask = (attention_mask, (needed, win_mask.shape))
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
    forward = kwargs.get(FORWARD_KWARG)
    if getattr(forward, "batched", False):  # many sessions in one forward (rows.py): each row on its own cache
        return forward.attention(module, query, _observing_sdpa, **kwargs)
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
        # layers hold different token counts (per-layer budgets) but end at one position: the mask,
        # built for the cache's position length, is this layer's on its last columns
        attention_mask = attention_mask[..., -key.shape[2]:]
    forward = kwargs.pop(FORWARD_KWARG, None)
    if torch.compiler.is_compiling():  # a compiled decode step (compiled.py) observes nothing
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    index = getattr(module, "layer_idx", None)
    if forward is None or not forward.observers or index is None:  # nothing observes it (or a call outside the seam)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = forward.cache.layers[index]
    l = layer.window_len(query.shape[2], forward)
    if l == 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    timing = forward.cache.timing
    if query.is_cuda:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        t0 = measured_clock(timing, query.device)
        layer.observe_scores(window_scores(query[:, :, -l:], key, scaling), l, query[:, :, -l:], key, scaling)
        timing.score_s += measured_clock(timing, query.device) - t0
        return out
    b, _, q_len, _ = query.shape
    # transformers' mask matters in the window only for padding (causality is built in there); the
    # causal mask for SDPA is built only when SDPA runs on part of the prompt
    def full_mask():
        return _bool_mask(attention_mask, b, q_len, key.shape[2], query.device)

    win_mask = None if attention_mask is None else _beyond_causality(forward, attention_mask, full_mask()[:, :, -l:])
    t0 = time.perf_counter()
    win_out, scores = window_attention(query[:, :, -l:], key, value, scaling, win_mask)
    layer.observe_scores(scores, l, query[:, :, -l:], key, scaling)
    fused = time.perf_counter() - t0
    if timing.measure:  # what plain SDPA would have spent on these queries: the scores cost the rest
        t0 = time.perf_counter()
        sdpa_attention_forward(module, query[:, :, -l:], key, value, full_mask()[:, :, -l:], **kwargs)
        plain = time.perf_counter() - t0
        timing.probe_s += plain
        fused = max(0.0, fused - plain)
    timing.score_s += fused
    win_out = win_out.transpose(1, 2)
    if l == q_len:
        return win_out.contiguous(), None
    head_out, _ = sdpa_attention_forward(module, query[:, :, :-l], key, value, full_mask()[:, :, :-l], **kwargs)
    return torch.cat([head_out, win_out.to(head_out.dtype)], dim=1), None


def measured_clock(timing, device, clock=time.perf_counter) -> float:
    """The time, after the GPU's queued work when a benchmark measures (`cache.timing.measure`): CUDA runs
    asynchronously, and without a sync one step's kernels would be timed as the next step."""
    if timing.measure and device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


AttentionInterface.register(ATTN_IMPLEMENTATION, observing_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_observing_attention(model) -> None:
    """Switch a loaded model to the observing SDPA attention (same numbers as plain SDPA)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
