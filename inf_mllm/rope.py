"""Re-rotation of cached RoPE keys, the heart of the position contract.

Keys are cached after RoPE. Rotations compose, so moving a key from position p to q is one more
rotation by q - p; doing it in fp32 keeps kept tokens at contiguous positions without recomputing
them from hidden states.
"""

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys`` (..., T, D) by ``delta`` positions (broadcastable to (..., T)), in fp32.

    ``inv_freq`` is the model's own (already scaled) inverse frequency vector of length D/2; the
    attention scaling some RoPE variants apply to cos/sin is not re-applied: it is already in the key.
    """
    angles = delta.to(torch.float32).unsqueeze(-1) * inv_freq.to(keys.device, torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    k = keys.to(torch.float32)
    out = k * angles.cos() + rotate_half(k) * angles.sin()
    return out.to(keys.dtype)


def rope_inv_freq(model) -> torch.Tensor:
    """The inverse frequencies of a transformers RoPE model, or a clear ValueError if it has none."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        name = type(model).__name__
        raise ValueError(f"{name} has no rotary position embedding: the streaming cache needs a RoPE model")
    return inv_freq.detach().to(torch.float32).clone()
