"""Elastic Cache's merge (seed 000, its Eq. 2-3), the reducer beside plain eviction (`StreamingLayer.keep`).

The kept indices are anchors; every token joins the bucket of its nearest anchor (boundaries at the floor of
the midpoints between neighbouring anchors) and each bucket's K and V become the means of its members. Keys
are cached after RoPE, so each member key is first rotated to the position its bucket will occupy (the
anchor's, after re-assignment; the layer's position strategy says where): the mean is taken among keys at one
position, as if every member sat where its anchor sits. Lasting per-token statistics are combined per bucket
as they declare (accumulated attention: summed); a bucket keeps its anchor's turn id. A policy that protects the
ends (Elastic Cache's first and most recent token) keeps its first and last anchors as buckets of their own.
"""

import torch


def merge(layer, idx: torch.Tensor, start: int, end: int | None = None) -> None:
    """Merge `layer` down to the anchors at sorted indices idx, (B, K) or (B, H, K), sitting from `start`."""
    b, h, n, d = layer.keys.shape
    idx = idx.to(layer.keys.device)
    idx = idx[:, None, :] if idx.dim() == 2 else idx  # (B, 1 or H, K)
    k, g = idx.shape[-1], idx.shape[1]
    mids = torch.div(idx[..., :-1] + idx[..., 1:], 2, rounding_mode="floor")
    if getattr(layer.setup.policy, "merge_protects_ends", False) and k >= 3:  # Elastic Cache's Sec. 4
        mids[..., 0], mids[..., -1] = idx[..., 0], idx[..., -1] - 1  # the first and last anchors alone
    mids = mids.contiguous()
    pos = torch.arange(n, device=idx.device).expand(b, g, n).contiguous()
    bucket = torch.searchsorted(mids, pos)  # how many boundaries lie before each token: (B, g, n)
    keys = layer.pos.merged(layer.keys, idx, bucket, pos, start, end).float()
    ones = torch.ones_like(bucket, dtype=torch.float32)
    count = torch.zeros(b, g, k, device=idx.device).scatter_add_(-1, bucket, ones)
    spread = bucket.expand(b, h, n)
    where = spread.unsqueeze(-1).expand(b, h, n, d)
    mean = count.expand(b, h, k).unsqueeze(-1)
    zeros = torch.zeros(b, h, k, d, device=idx.device)
    layer.keys = (zeros.scatter_add(2, where, keys) / mean).to(layer.keys.dtype)
    layer.values = (zeros.scatter_add(2, where, layer.values.float()) / mean).to(layer.values.dtype)
    for key, value in layer.stats.lasting():  # combined as each statistic declares (observers.MERGES)
        into = torch.zeros(b, h, k, dtype=value.dtype, device=idx.device)
        if layer.setup.statistics[key].merge == "max":
            merged = into.scatter_reduce(-1, spread, value, "amax", include_self=False)
        else:
            merged = into.scatter_add_(-1, spread, value)
        layer.stats.put(key, merged)
    if layer.turn_ids is not None:
        layer.turn_ids = layer._ids.take(idx)
    layer.start = start
    if layer.linked is not None:
        from .layer import SCATTERED  # here: layer.py imports this module

        layer.linked = SCATTERED
