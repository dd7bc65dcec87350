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
    table = RotationTable(inv_freq).rotate(at_old, new - old, reach=int((old - new).max()) + 1)
    assert (table - at_new).abs().max() <= 2e-4 * scale


def test_re_rotation_reads_nothing_back_from_the_device():
    """Eviction's re-rotation (keep, merge, shift) runs on meta tensors, which hold no values: any read of a
    value on the host (`.any()`, `.max()`, `int(...)`), a stall on a GPU, would raise here."""
    from inf_mllm.cache import StreamingCache
    from inf_mllm.policies import build
    from inf_mllm.spec import as_spec

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    cache = StreamingCache(build(as_spec("inf_mllm")), [64], inv_freq, 1)
    layer = cache.layers[0]
    layer.keys = torch.empty(1, 2, 100, 64, device="meta")
    layer.values = torch.empty(1, 2, 100, 64, device="meta")
    layer.is_initialized = True
    idx = torch.empty(1, 60, dtype=torch.long, device="meta")
    layer.keep(idx, start=0)
    layer.shift(4)  # forward (a layer of smaller budget starts later)
    layer.merge(torch.empty(1, 40, dtype=torch.long, device="meta"), start=0)
    assert layer.keys.shape == (1, 2, 40, 64) and layer.start == 0


def test_table_and_computed_rotations_agree_both_ways():
    torch.manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    keys = torch.randn(1, 2, 50, 64)
    back = -torch.randint(0, 3000, (1, 1, 50))
    table = RotationTable(inv_freq)
    assert torch.allclose(table.rotate(keys, back, reach=3000), rerotate(keys, back, inv_freq), atol=2e-4)
    ahead = -back
    assert torch.equal(table.rotate(keys, ahead, reach=3000, forward=True), rerotate(keys, ahead, inv_freq))


def test_rotating_into_a_given_tensor_equals_rotating_into_a_new_one():
    """An eviction rotates the keys it took straight into the layer's buffer (a strided view), fp32 or fp16."""
    torch.manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    table = RotationTable(inv_freq)
    for dtype in (torch.float32, torch.float16):
        keys = torch.randn(1, 3, 40, 64).to(dtype)
        back = -torch.randint(0, 500, (1, 1, 40))
        buf = torch.zeros(1, 3, 256, 64, dtype=dtype)
        got = table.rotate(keys, back, reach=500, out=buf[:, :, :40])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:, :, :40], table.rotate(keys, back, reach=500))
        assert not buf[:, :, 40:].any()
        ahead = torch.randint(0, 5, (1, 1, 40))
        got = table.rotate(keys, ahead, reach=500, forward=True, out=buf[:, :, :40])
        assert torch.equal(got, table.rotate(keys, ahead, reach=500, forward=True))
