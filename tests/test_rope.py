import torch

from inf_mllm.rope import RotationTable, rerotate, rope_inv_freq


def fresh_keys(model, hidden, positions):
    """Keys of layer 0 computed from scratch at `positions` (the model's own k_proj and RoPE)."""
    attn = model.model.layers[0].self_attn
    k = attn.k_proj(hidden).view(1, hidden.shape[1], -1, attn.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(hidden, positions[None])
    cos, sin = cos[:, None], sin[:, None]
    half = k.shape[-1] // 2
    rot = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return k * cos + rot * sin


def test_rerotated_keys_equal_keys_computed_at_new_positions(smol):
    model, _ = smol
    torch.manual_seed(0)
    hidden = torch.randn(1, 40, model.config.hidden_size)
    old = torch.arange(40) * 37 + 5  # scattered old positions, as after evictions
    new = torch.arange(40)  # contiguous positions after re-rotation
    with torch.no_grad():
        at_old, at_new = fresh_keys(model, hidden, old), fresh_keys(model, hidden, new)
    inv_freq = rope_inv_freq(model)
    moved = rerotate(at_old, new - old, inv_freq)
    # fp32 RoPE itself is only accurate to ~1e-4 of the key's scale at positions near 1.5K
    scale = float(at_new.abs().max())
    assert (moved - at_new).abs().max() <= 2e-4 * scale
    assert not torch.allclose(at_old, at_new, atol=1e-2)  # the check is not vacuous
    table = RotationTable(inv_freq).rotate(at_old, new - old)
    assert (table - at_new).abs().max() <= 2e-4 * scale
