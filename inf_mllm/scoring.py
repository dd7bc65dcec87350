"""Window attention scores: mean softmax attention that the last l queries pay to every key.

Computed flash-style in two passes over key blocks (row log-sum-exp, then column sums), so the
(heads x l x n) attention matrix is never held whole. `window_scores` dispatches to the Triton
kernel for CUDA tensors and to the torch reference otherwise.
"""

import torch

KEY_BLOCK = 2048


def _grouped(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, l, D) -> (B, Hkv, g*l, D): query head h belongs to KV head h // g."""
    b, hq, l, d = query.shape
    return query.reshape(b, num_kv_heads, (hq // num_kv_heads) * l, d)


def _block_logits(qg, keys, start, stop, scaling, q_pos):
    logits = torch.matmul(qg, keys[:, :, start:stop].transpose(-1, -2)).float() * scaling
    k_pos = torch.arange(start, stop, device=keys.device)
    return logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def window_scores_torch(query, keys, scaling: float, block: int = KEY_BLOCK) -> torch.Tensor:
    """Mean attention per query head over the l queries: (B, Hq, l, D), (B, Hkv, n, D) -> (B, Hq, n).

    The queries are the last l positions of the sequence (query i sits at n - l + i) and attend
    causally.
    """
    b, hq, l, _ = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    qg = _grouped(query, hkv)
    q_pos = (torch.arange(l, device=keys.device) + n - l).repeat(hq // hkv)
    lse = torch.full(qg.shape[:3], float("-inf"), device=keys.device)
    for start in range(0, n, block):
        logits = _block_logits(qg, keys, start, min(n, start + block), scaling, q_pos)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    cols = []
    for start in range(0, n, block):
        logits = _block_logits(qg, keys, start, min(n, start + block), scaling, q_pos)
        probs = torch.exp(logits - lse.unsqueeze(-1))  # (B, Hkv, g*l, blk)
        cols.append(probs.reshape(b, hkv, hq // hkv, l, -1).mean(dim=3))
    return torch.cat(cols, dim=-1).reshape(b, hq, n)


def window_scores(query, keys, scaling: float) -> torch.Tensor:
    if query.is_cuda:
        from .triton_scores import window_scores_triton

        return window_scores_triton(query, keys, scaling)
    return window_scores_torch(query, keys, scaling)


def step_scores(query, keys, scaling: float) -> torch.Tensor:
    """Attention of decode queries (B, Hq, q, D) on all keys, summed over the q queries: (B, Hq, n).

    Used by H2O's accumulation; the queries are the last q positions and attend causally.
    """
    return window_scores_torch(query, keys, scaling) * query.shape[2]
