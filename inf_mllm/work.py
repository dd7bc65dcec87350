"""The pool's work, typed: what a stream asks of the model, each item with its status (vLLM's `Request` and
`RequestStatus`, for turns of a bounded stream).

A `ClipTurn` (a clip's embeddings) and a `QuestionTurn` are prefills; a `DecodeRow` is an answer in progress, one row
of each batched decode step; a `Call` is anything else that must run on the pool's thread (a system prompt, a
restore, an out-of-memory shrink). The pool's round (pool.py) schedules items by kind: every question waiting, the
clip turns that fit in `max_batched_tokens` (packed into one forward), the answers whose readers want a token, one
call.
"""

import collections
import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .answer import Answer


class Status(enum.Enum):
    WAITING = "waiting"  # queued for the pool's thread
    RUNNING = "running"  # taken by a round (a decode row: between its first token and its last)
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class Work:
    """One item for the pool's thread, for `session` (None: no stream's, e.g. a session being built); its caller
    waits on `future`."""

    session: object
    future: Future = field(default_factory=Future, kw_only=True)
    status: Status = field(default=Status.WAITING, kw_only=True)

    def finish(self, result) -> None:
        self.status = Status.DONE
        self.future.set_result(result)

    def fail(self, err: BaseException) -> None:
        self.status = Status.FAILED
        self.future.set_exception(err)


@dataclass(eq=False)
class Call(Work):
    """`fn(*args, **kwargs)` on the pool's thread, after the stream's answer in progress has ended."""

    fn: object
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(eq=False)
class ClipTurn(Work):
    """A clip turn's prefill (`StreamSession.append(inputs_embeds=...)` with the turn's meta, visual span and
    positions), which may share a forward with other streams' clip turns."""

    embeds: torch.Tensor
    store: bool = True
    meta: dict | None = None
    vision: tuple[int, int] | None = None
    positions: object = None

    @property
    def tokens(self) -> int:
        """What it costs of a round's token budget (the held-back answer token aside)."""
        return self.embeds.shape[1]


@dataclass(eq=False)
class QuestionTurn(Work):
    """A question's prefill (`StreamSession.append_question(ids, **options)`), batched with the other streams'."""

    ids: torch.Tensor
    options: dict = field(default_factory=dict)


@dataclass
class BegunQuestion:
    """A question between `begin_question` and `question_done`: what recall linked and spent, the cache marks it
    leaves by (keep=False), whether its prefill evicts."""

    linked: list
    recall_s: float
    forget_at: list | None
    evict: bool
    recompute: tuple | None = None  # (rows of the linked block, their input embeddings) its forward recomputes


@dataclass(eq=False)
class DecodeRow(Answer):
    """An answer as the pool runs it: a row of the batched decode steps, its tokens queued for its reader."""

    out: collections.deque = field(default_factory=collections.deque)
    wants: bool = False  # its reader waits for the next token
    plain: bool | None = None  # whether its steps run in the slot arena (None: not asked yet)
    ready: threading.Condition | None = None  # its reader waits here for `out` (on the pool's lock)
    status: Status = Status.RUNNING
