"""Re-rotation of cached RoPE keys, the heart of the position contract.

Keys are cached after RoPE. Rotations compose, so moving a key from position p to q is one more
rotation by q - p; doing it in fp32 keeps kept tokens at contiguous positions without recomputing
them from hidden states. Shifts are integers, so their cos/sin come from a table, not from
transcendental calls on every eviction.
"""

import torch


def _apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate (..., T, D) keys by per-token angles given as (..., T, D/2) cos and sin (half-split layout); into
    `out` (keys' shape, any strides) when given, which must not overlap `keys`: an fp32 eviction rotates the
    rows it took straight into the layer's buffer instead of through a copy of them."""
    k = keys.to(torch.float32)
    h = k.shape[-1] // 2
    k1, k2 = k[..., :h], k[..., h:]
    res = out if out is not None and out.dtype == torch.float32 else torch.empty_like(k)
    torch.mul(k1, cos, out=res[..., :h]).addcmul_(k2, sin, value=-1)
    torch.mul(k2, cos, out=res[..., h:]).addcmul_(k1, sin)
    if out is None:
        return res.to(keys.dtype)
    return out if res is out else out.copy_(res)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys`` (..., T, D) by ``delta`` positions (broadcastable to (..., T)), in fp32.

    ``inv_freq`` is the model's own (already scaled) inverse frequency vector of length D/2; the
    attention scaling some RoPE variants apply to cos/sin is not re-applied: it is already in the key.
    """
    angles = delta.to(torch.float32).unsqueeze(-1) * inv_freq.to(keys.device, torch.float32)
    return _apply(keys, angles.cos(), angles.sin())


class RotationTable:
    """cos/sin of every backward shift 0..size-1, grown on demand; `rotate` equals `rerotate`.

    Callers say how far and which way their shifts go (`reach`, `forward`): both follow from token counts
    and start positions the cache keeps on the host, so no value is read back from the device, which on a
    GPU would stall every re-rotation until the queued kernels finish."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.to(torch.float32)
        self.table = torch.empty(0, 2 * inv_freq.numel())  # row s: cos of shift -s, then its sin

    def _grow(self, size: int, device) -> None:
        size = max(size, 2 * self.table.shape[0], 1024)
        shifts = -torch.arange(size, dtype=torch.float64, device=device)[:, None]
        angles = shifts * self.inv_freq.to(device, torch.float64)
        self.table = torch.cat([angles.cos(), angles.sin()], dim=-1).float()

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor, reach: int, forward: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate `keys` by `delta` positions, every shift in (-reach, 0] unless `forward` (some may be
        positive: computed, not looked up); into `out` if given (see `_apply`)."""
        if forward:
            rotated = rerotate(keys, delta, self.inv_freq)
            return rotated if out is None else out.copy_(rotated)
        if reach > self.table.shape[0] or self.table.device != keys.device:
            self._grow(reach, keys.device)
        back = (-delta).clamp_min(0)
        # one index_select of whole rows (cos and sin together): cheaper than advanced indexing by a (.., T) tensor
        both = self.table.index_select(0, back.reshape(-1)).view(*back.shape, self.table.shape[1])
        h = self.table.shape[1] // 2
        return _apply(keys, both[..., :h], both[..., h:], out)


def _rotary(model):
    base = getattr(model, "model", model)
    if not hasattr(base, "rotary_emb") and hasattr(model, "get_decoder"):
        base = model.get_decoder()  # a vision-language model: its language model holds the rotary embedding
    return getattr(base, "rotary_emb", None)


def rope_inv_freq(model) -> torch.Tensor:
    """The inverse frequencies of a transformers RoPE model, or a clear ValueError if it has none."""
    inv_freq = getattr(_rotary(model), "inv_freq", None)
    if inv_freq is None:
        name = type(model).__name__
        raise ValueError(f"{name} has no rotary position embedding: the streaming cache needs a RoPE model")
    return inv_freq.detach().to(torch.float32).clone()


def multimodal_rope(model) -> bool:
    """Whether the model's language model takes multimodal RoPE position ids (Qwen-VL's sections of the
    rotary dimensions per time, height and width axis)."""
    return hasattr(_rotary(model), "mrope_section")
