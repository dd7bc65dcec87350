"""Triton kernel for window attention scores (CUDA; runs on CPU under TRITON_INTERPRET=1).

Pass 1 computes each window query's log-sum-exp over all keys with an online max; pass 2 gives
each key block the sum over queries of exp(q.k * scale - lse). Neither pass holds more than one
(BLOCK_M x BLOCK_N) tile of the attention matrix.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _row_lse_kernel(
    q_ptr, k_ptr, lse_ptr, n, l, hq, groups, scaling,
    sqb, sqh, sqm, skb, skh, skn,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // hq
    h = bh % hq
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :],
        mask=(rows[:, None] < l) & (dims[None, :] < D), other=0.0,
    ).to(tl.float32)
    q_pos = rows + n - l
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    k_base = k_ptr + b * skb + (h // groups) * skh
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_base + cols[:, None] * skn + dims[None, :],
            mask=(cols[:, None] < n) & (dims[None, :] < D), other=0.0,
        ).to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling  # fp32 (TF32: ~1e-4 off)
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < n)
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(lse_ptr + bh * l + rows, m_i + tl.log(s_i), mask=rows < l)


@triton.jit
def _col_sum_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr, n, l, hq, groups, scaling,
    sqb, sqh, sqm, skb, skh, skn,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // hq
    h = bh % hq
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = tl.load(
        k_ptr + b * skb + (h // groups) * skh + cols[:, None] * skn + dims[None, :],
        mask=(cols[:, None] < n) & (dims[None, :] < D), other=0.0,
    ).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, l, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = tl.load(
            q_ptr + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :],
            mask=(rows[:, None] < l) & (dims[None, :] < D), other=0.0,
        ).to(tl.float32)
        lse = tl.load(lse_ptr + bh * l + rows, mask=rows < l, other=float("inf"))
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling  # fp32 (TF32: ~1e-4 off)
        visible = (cols[None, :] <= (rows + n - l)[:, None]) & (rows[:, None] < l)
        probs = tl.where(visible, tl.exp(logits - lse[:, None]), 0.0)
        acc += tl.sum(probs, axis=0)
    tl.store(out_ptr + bh * n + cols, acc / l, mask=cols < n)


def window_scores_triton(query, keys, scaling: float, block_m: int = 16, block_n: int = 64) -> torch.Tensor:
    """Same contract as `scoring.window_scores_torch`: (B, Hq, l, D), (B, Hkv, n, D) -> (B, Hq, n) fp32."""
    b, hq, l, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    query, keys = query.contiguous(), keys.contiguous()
    lse = torch.empty((b * hq, l), device=query.device, dtype=torch.float32)
    out = torch.empty((b * hq, n), device=query.device, dtype=torch.float32)
    args = (n, l, hq, hq // hkv, float(scaling), *query.stride()[:3], *keys.stride()[:3])
    meta = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d))
    _row_lse_kernel[(b * hq, triton.cdiv(l, block_m))](query, keys, lse, *args, **meta)
    _col_sum_kernel[(b * hq, triton.cdiv(n, block_n))](query, keys, lse, out, *args, **meta)
    return out.reshape(b, hq, n)
