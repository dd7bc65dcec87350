"""Window attention scores: the mean softmax attention that the last l queries pay to every key.

`window_attention` works flash-style over key blocks (row log-sum-exp, then column sums), so the
(heads x l x n) attention matrix is never held whole once n exceeds one block; it also returns the
window queries' attention output, so on CPU the scores come out of the attention the prompt needs
anyway instead of a second pass over the keys. `window_scores` dispatches to the Triton kernel for
CUDA tensors and to this torch reference otherwise.
"""

import torch

KEY_BLOCK = 4096


def _grouped(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, l, D) -> (B, Hkv, g*l, D): query head h belongs to KV head h // g."""
    b, hq, l, d = x.shape
    return x.reshape(b, num_kv_heads, (hq // num_kv_heads) * l, d)


def _block_logits(qg, keys, start, stop, scaling, l, mask):
    """Logits of the grouped window queries on keys [start, stop), causal inside the window."""
    n = keys.shape[2]
    logits = torch.matmul(qg, keys[:, :, start:stop].transpose(-1, -2)).float().mul_(scaling)
    if stop > n - l:  # the block reaches the window itself: hide keys after each query
        lo = max(start, n - l)
        q_pos = torch.arange(l, device=keys.device) + n - l
        hidden = torch.arange(lo, stop, device=keys.device)[None, :] > q_pos[:, None]  # (l, stop - lo)
        g = qg.shape[2] // l
        view = logits.view(*logits.shape[:2], g, l, stop - start)
        view[..., lo - start:].masked_fill_(hidden, float("-inf"))
    if mask is not None:  # (B, 1, l, n) bool, True = may attend
        g = qg.shape[2] // l
        view = logits.view(*logits.shape[:2], g, l, stop - start)
        view.masked_fill_(~mask[:, :, None, :, start:stop], float("-inf"))
    return logits


def window_attention(query, keys, values=None, scaling: float = 1.0, mask=None, block: int = KEY_BLOCK):
    """Attention of the window queries and their scores.

    query (B, Hq, l, D) are the last l positions of the sequence; keys/values (B, Hkv, n, D).
    Returns (output (B, Hq, l, D) or None without values, scores (B, Hq, n) = mean over queries).
    Up to `block` keys this is one softmax; beyond, two sweeps over key blocks.
    """
    b, hq, l, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    qg = _grouped(query, hkv)
    blocks = [(s, min(n, s + block)) for s in range(0, n, block)]
    if len(blocks) == 1:
        probs = torch.softmax(_block_logits(qg, keys, 0, n, scaling, l, mask), dim=-1)
        scores = probs.view(b, hkv, hq // hkv, l, n).mean(dim=3).reshape(b, hq, n)
        out = None if values is None else torch.matmul(probs.to(values.dtype), values).reshape(b, hq, l, d)
        return out, scores
    lse = torch.full(qg.shape[:3], float("-inf"), device=keys.device)
    for start, stop in blocks:
        lse = torch.logaddexp(lse, torch.logsumexp(_block_logits(qg, keys, start, stop, scaling, l, mask), dim=-1))
    cols, out = [], None
    for start, stop in blocks:
        logits = _block_logits(qg, keys, start, stop, scaling, l, mask)
        probs = torch.exp(logits.sub_(lse.unsqueeze(-1)))  # (B, Hkv, g*l, blk)
        cols.append(probs.view(b, hkv, hq // hkv, l, -1).mean(dim=3))
        if values is not None:
            part = torch.matmul(probs.to(values.dtype), values[:, :, start:stop])
            out = part if out is None else out + part
    scores = torch.cat(cols, dim=-1).reshape(b, hq, n)
    return (None if out is None else out.reshape(b, hq, l, d)), scores


def window_scores_torch(query, keys, scaling: float, block: int = KEY_BLOCK) -> torch.Tensor:
    """Reference scores only: (B, Hq, l, D), (B, Hkv, n, D) -> (B, Hq, n), mean over the l queries."""
    return window_attention(query, keys, None, scaling, block=block)[1]


def window_scores(query, keys, scaling: float) -> torch.Tensor:
    if query.is_cuda:
        from .triton_scores import window_scores_triton  # lazy: Triton is there (and used) only on CUDA

        return window_scores_triton(query, keys, scaling)
    return window_scores_torch(query, keys, scaling)
