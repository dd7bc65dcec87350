"""A session rebuilt after a restart from its reopened span store: what `StreamSession.restore` does."""

from collections.abc import Iterable

import torch

from . import recall as recall_
from .answer import Exchange


def restore(session, exchanges: Iterable[Exchange | dict] = ()) -> list[int]:
    """Rebuild the cache after a restart from a reopened store: the newest stored turns that fit in the budget
    go back in as ordinary turns (linked, not re-encoded); older ones stay recallable. `exchanges` (the kept
    questions and answers of a transcript, as `exchange` recorded them) go back between the clips where they
    were asked, prefilled, so under a policy that evicts nothing the rebuilt cache is the one before the
    restart. Which tokens each head had kept is not saved, so under a bounded one it is the recent window.
    Returns the span ids linked back; the session's caller spends the logits of what went back in."""
    if session.store is None:
        raise ValueError("restore needs a session with recall (a store)")
    spans = {i: span.length for i, span in session.store.spans.items()}
    said = {e.turn: e for e in (x if isinstance(x, Exchange) else Exchange(**x) for x in exchanges)
            if e.kept and e.turn not in spans}
    lengths = spans | {t: len(e.question) + len(e.answer) for t, e in said.items()}
    room = min(session.cache.budgets) - session.kv_tokens if session.cache.budgets else float("inf")
    newest = []
    for turn in sorted(lengths, reverse=True):
        if lengths[turn] > room:
            break
        newest.insert(0, turn)
        room -= lengths[turn]
    restored, run = [], []
    for turn in [*newest, None]:  # consecutive clips are linked together
        if turn in spans:
            run.append(turn)
            continue
        if run:
            session.discard_pending()  # an answer's held-back token opens the span stored after it
            restored += recall_.link(session.cache, session.store, run, "end", recalled=False, device=session.device)
            session.seen += sum(spans[i] for i in run)
            run = []
        if turn is not None:
            e = said[turn]
            text = e.question + e.answer[:-1]  # the answer's last token is held back, as it was
            if text:
                session.append(torch.tensor([text], device=session.device), evict=False, store=False)
            session.hold(torch.tensor([e.answer[-1:]], device=session.device) if e.answer else None)
            session.turns = max(session.turns, turn + 1)
    return restored
