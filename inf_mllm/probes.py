"""Forwards over a session's cache for recall that leave the cache as it was (a question's keys, to rank stored turns;
CacheBlend's deviation, to pick the linked rows worth recomputing), and the position ids and mask under which a
question's forward recomputes linked rows in front of itself (MPIC's selective attention: its one step)."""

import contextlib

import torch

from .cache import ProbeDone
from .recall import most_deviating, recompute_rows, scoring_layers
from .rope import rerotate


def to_recompute(session, linked: list[int]) -> tuple | None:
    """The rows of the just linked block the question's forward recomputes, and their inputs (None: none)."""
    rows, inputs = recompute_rows(session.store, linked, session.recall)
    if rows.numel() and session.recall.reuse == "blend":
        rows, inputs = most_deviating(rows, inputs, deviation(session, rows, inputs), session.recall.blend_r)
    return (rows, inputs) if rows.numel() else None


def selective(session, rows: torch.Tensor, new: int) -> dict:
    """Position ids and mask of a forward whose first tokens are the linked block's `rows` (at the end of the
    cache) and then `new` tokens after the cache: each token sees every position up to its own, so a
    recomputed token sees the cache before the block and the block up to itself (stored or recomputed)."""
    end, linked = session.cache.get_seq_length(), session.cache.layers[0].linked[1]
    at = torch.cat([end - linked + rows, torch.arange(end, end + new)]).to(session.device)
    mask = torch.arange(end + new, device=session.device)[None, :] <= at[:, None]
    return {"position_ids": at[None], "attention_mask": mask[None, None]}


def deviation(session, rows: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """CacheBlend's measure: how far each row's K/V moves when recomputed in its new context, at the second
    layer (CacheBlend picks its tokens there, its first layer recomputed for every token). A probe: the
    cache is left as it was."""
    until = min(2, len(session.cache.layers))
    x = inputs.to(session.device, session.model.dtype)[None]
    with session.cache.forward(len(rows), probe_until=until, device=session.device) as fwd:
        fwd.rewrite, fwd.observers = rows.to(session.device), []
        with contextlib.suppress(ProbeDone):
            session.model(inputs_embeds=x, **selective(session, rows, 0), **fwd.kwargs,
                          past_key_values=session.cache, use_cache=True)
        layer = session.cache.layers[until - 1]
        k, v = fwd.fresh[until - 1]
    at = layer.linked[0] + rows.to(session.device)
    moved = (k - layer.keys[:, :, at]).float().square().sum(dim=(1, 3)) \
        + (v - layer.values[:, :, at]).float().square().sum(dim=(1, 3))
    return moved[0]


def question_keys(session, probe_ids: torch.Tensor) -> list[torch.Tensor]:
    """The question's keys in the scoring layers, RoPE removed: a probe forward that runs only up to
    the last of them and leaves the cache as it was."""
    layers = scoring_layers(session.recall, len(session.cache.layers))
    marks = session.cache.mark()
    before = [layer.get_seq_length() for layer in session.cache.layers]  # where the probe's keys begin
    ids, _ = session.with_pending(probe_ids.to(session.device), None)
    with session.cache.forward(ids.shape[1], probe_until=layers[-1] + 1, batch=session.batch,
                               device=session.device) as fwd:
        try:
            with contextlib.suppress(ProbeDone):  # raised once the last scoring layer has run
                session.model(input_ids=ids, past_key_values=session.cache, use_cache=True, **fwd.kwargs)
            keys = []
            for i in layers:
                layer = session.cache.layers[i]
                k = layer.keys[0, :, before[i]:]
                keys.append(rerotate(k, -layer.positions(before[i]), session.cache.inv_freq))
            return keys
        finally:
            session.cache.rollback(marks)
