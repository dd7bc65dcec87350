"""Many sessions in one forward: row r of the batch is session r's turn or decode step, on its own cache.

A bounded cache needs no paging to share a model: each session keeps its own `StreamingCache`, with its own
policy, budget, positions and statistics. One batched forward runs the model's weights once for every row (at
a decode step, reading the weights is nearly all the work, so N rows cost little more than one); only attention
is per row, and it is each row's own: the rows' caches are opened as if each ran alone (`cache.forward`), the
per-layer `RowsLayer` appends row r's new keys to session r's layer, and the attention function (attention.py)
runs row r's queries on that layer's keys through the same observing SDPA the session would use alone. The rows
are packed one after another into a single sequence (batch 1), `starts` saying where each row's tokens lie: the
model's linear layers run on the rows' tokens only, where rows left-padded to the longest made them run on padding
too (4 questions of 7 and 11 tokens: 44 tokens for 36).
"""

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import FORWARD_KWARG, use_observing_attention


@dataclass
class Row:
    """One session's part of a batched forward: its new tokens (ids (1, L) or embeddings (1, L, E)) and what its
    cache is told of them (`cache.forward`'s arguments)."""

    cache: object
    tokens: torch.Tensor
    forward: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@dataclass
class RowsForward:
    """What the attention function gets for a batched forward: each row's own open forward and, for the layer
    running now, each row's whole keys and values after its update."""

    rows: list  # the rows' cache.Forward objects
    lengths: list[int]
    starts: list[int] = field(default_factory=list)  # where each row's tokens begin in the packed sequence
    kv: list = field(default_factory=list)
    masks: dict = field(default_factory=dict)  # (queries, keys) -> the causal mask: one object for every layer
    batched = True

    def attention(self, module, query, attend, **kwargs):
        """Row r's queries (its stretch of the packed sequence) on row r's keys, through `attend` (the observing
        SDPA) with row r's own forward; the outputs packed back into one (1, L, Hq, D) tensor."""
        outs = []
        for r, (n, start, own) in enumerate(zip(self.lengths, self.starts, self.rows, strict=True)):
            keys, values = self.kv[r]
            mask = None
            if n > 1:  # causal, aligned to the end: the row's queries are its last n positions
                mask = self.causal(n, keys.shape[2], query.device)
            out, _ = attend(module, query[:, :, start:start + n], keys, values, mask, **{**kwargs, FORWARD_KWARG: own})
            outs.append(out)
        return torch.cat(outs, dim=1), None

    def causal(self, n: int, total: int, device) -> torch.Tensor:
        """The (1, 1, n, total) mask of n queries at the end of `total` keys, built once per forward: the observing
        attention checks a mask once per object (`_beyond_causality`), not at every layer."""
        mask = self.masks.get((n, total))
        if mask is None:
            q_pos = torch.arange(total - n, total, device=device)
            mask = self.masks[(n, total)] = (torch.arange(total, device=device)[None, :] <= q_pos[:, None])[None, None]
        return mask


class RowsLayer(CacheLayerMixin):
    """Layer i of the batch: appends row r's new keys (its stretch of the packed sequence) to row r's layer i."""

    is_compileable = False
    is_sliding = False

    def __init__(self, index: int, caches: list, state: RowsForward):
        super().__init__()
        self.index, self.caches, self.state = index, caches, state
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: each row's own layer holds its keys."""

    def update(self, key_states, value_states, *args, **kwargs):
        state = self.state
        state.kv = [cache.layers[self.index].update(key_states[:, :, start:start + n],
                                                    value_states[:, :, start:start + n], own)
                    for cache, n, start, own in zip(self.caches, state.lengths, state.starts, state.rows, strict=True)]
        return key_states, value_states  # the attention function reads the rows' own keys from `state.kv`

    def get_seq_length(self) -> int:
        return max(cache.get_seq_length(self.index) for cache in self.caches)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0  # the model's mask is not used: each row builds its own

    def get_max_length(self) -> int:
        return -1


class RowsCache(Cache):
    def __init__(self, caches: list, state: RowsForward):
        super().__init__(layers=[RowsLayer(i, caches, state) for i in range(len(caches[0].layers))])


@torch.inference_mode()
def forward_rows(model, rows: list[Row], device=None) -> torch.Tensor:
    """One forward of `model` over every row, each on its own cache; returns each row's last logits (B, V).

    All rows give ids or all give embeddings. A row whose forward fails leaves no cache changed: every cache is
    rolled back if the call raises."""
    device = device or model.device
    use_observing_attention(model)  # the rows' attention is dispatched there (plain SDPA where nothing observes)
    lengths = [row.length for row in rows]
    ends = torch.tensor(lengths).cumsum(0)
    embeds = rows[0].tokens.dim() == 3
    marks = [row.cache.mark() for row in rows]
    with ExitStack() as stack:
        opened = [stack.enter_context(row.cache.forward(row.length, batch=1, device=device, **row.forward))
                  for row in rows]
        state = RowsForward(list(opened), lengths, (ends - torch.tensor(lengths)).tolist())
        positions = torch.cat([_positions(row, fwd, device) for row, fwd in zip(rows, opened, strict=True)], dim=-1)
        inputs = torch.cat([row.tokens.to(device) for row in rows], dim=1)
        kwargs = {"inputs_embeds" if embeds else "input_ids": inputs}
        try:  # the logits of each row's last token only
            out = model(**kwargs, position_ids=positions, past_key_values=RowsCache([r.cache for r in rows], state),
                        use_cache=True, logits_to_keep=(ends - 1).to(device), **{FORWARD_KWARG: state})
        except BaseException:
            for row, mark in zip(rows, marks, strict=True):
                row.cache.rollback(mark)
            raise
    return out.logits[0]


def forward_apart(model, rows: list[Row]) -> list:
    """Each row's last logits (1, V), or the error its forward raised: all rows in one forward, and row by row if
    that one fails, so one session's fault stays its own (a failed forward leaves every cache as it was)."""
    if not rows:
        return []
    try:
        logits = forward_rows(model, rows)
        return [logits[r:r + 1] for r in range(len(rows))]
    except Exception as err:  # noqa: BLE001 (handed to the sessions)
        if len(rows) == 1:
            return [err]
    results = []
    for row in rows:
        try:
            results.append(forward_rows(model, [row]))
        except Exception as err:  # noqa: BLE001 (this row's fault, handed to its session)
            results.append(err)
    return results


def _positions(row: Row, fwd, device) -> torch.Tensor:
    """The row's position ids: (1, n), or (axes, 1, n) under multimodal RoPE."""
    own = fwd.kwargs.get("position_ids")
    if own is None:  # 1-D RoPE: the model's default, the cache's next position onwards
        start = row.cache.get_seq_length()
        own = torch.arange(start, start + row.length, device=device)[None]
    return own.to(device)
