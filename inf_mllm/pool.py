"""Many streams on one model: each its own bounded session, every model call on one thread, and the decode steps
of all answers in progress batched into one forward (rows.py).

A stream holds a `PooledSession`, which answers to what a `StreamSession` answers to (the adapters and the engine
take either); each call it makes is queued for the pool's thread. That thread, in a loop: prefills every question
waiting, together (rows of different lengths, each on its own cache), then evicts for each (an answer's first
token, from its question's logits, is picked by its reader meanwhile), advances every answer whose reader has
taken its last token by one batched decode step, and runs one other turn (a clip), so answers keep coming while
clips go in. An answer advances only when its reader asks for the next token, as a lone session's generator does:
a reader that stops leaves its last token held back for the next turn, and nothing was decoded past it.

A bounded cache's size is known before its first token, so the pool admits a stream only if its bound (budget
plus headroom, every layer) fits in what is left of `kv_bytes`: a stream that would not fit is refused at the
door (`PoolFull`), never halfway through. A batched forward that fails is retried row by row, so a fault in one
stream's cache reaches that stream only.
"""

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .budget import KVShape
from .decoding import eos_set, pick
from .rows import Row, forward_rows
from .session import StreamSession
from .slots import SlotArena, SlotDecode

_END = object()  # an answer ended by its stream's next turn


class PoolFull(ValueError):
    """A stream the pool cannot take (memory, or its count of streams); the message is one line."""


@dataclass
class _Answer:
    session: StreamSession
    max_new_tokens: int
    eos: torch.Tensor
    filler: int
    sampling: tuple
    logits: torch.Tensor | None  # (1, V) the next token comes from; None: the last token must go through a step
    done: torch.Tensor
    out: "collections.deque" = field(default_factory=collections.deque)
    token: torch.Tensor | None = None  # the last token handed over, not yet in the cache
    steps: int = 0
    wants: bool = False
    plain: bool | None = None  # whether its steps run in the slot arena (None: not asked yet)
    ready: threading.Condition | None = None  # its reader waits here for `out` (on the pool's lock)


@dataclass
class _Question:
    session: StreamSession
    ids: torch.Tensor
    options: dict
    future: Future = field(default_factory=Future)


class SessionPool:
    """`kv_bytes`: memory the streams' caches may take together (None: no limit); `max_streams`: the most streams;
    `unbounded`: whether a stream with an unbounded cache (policy full, the app's comparison) is admitted beside a
    memory limit, counted at nothing, its growth its own risk. `slots`: streams whose decode steps run in one step on
    fixed shapes (slots.py; 0: none, every step an eager batched forward), compiled when `compile_decode` (a GPU;
    `compile_mode` as `torch.compile`'s, default max-autotune there)."""

    def __init__(self, model, tokenizer=None, kv_bytes: int | None = None, max_streams: int = 64,
                 unbounded: bool = False, slots: int = 0, compile_decode: bool = False,
                 compile_mode: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.slot_decode = SlotDecode(model, SlotArena(slots), compile_decode, compile_mode) if slots else None
        self.kv_bytes, self.max_streams, self.unbounded = kv_bytes, max_streams, unbounded
        self.gather_s = 0.005  # how long work that arrives together waits for the rest of it (`_gather`)
        # each admitted session -> its bound in bytes; held until released, so a stream dropped without `close`
        # stays counted (its cache is alive) and no new session can take over its entry by reusing its id()
        self.streams: dict[StreamSession, int] = {}
        self.steps = 0  # batched decode steps run, and the rows they carried
        self.rows = 0
        self._shape = KVShape.from_config(model.config, model.dtype.itemsize)
        # the pool's thread waits on `_cond` for work; each answer's reader on its own condition of the same lock, so
        # a token handed to one stream wakes that stream's reader alone
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._jobs: collections.deque = collections.deque()
        self._questions: list[_Question] = []
        self._answers: list[_Answer] = []
        self._faults: dict[StreamSession, BaseException] = {}  # an eviction that failed after its question returned
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="session-pool", daemon=True)
        self._thread.start()

    # --- streams in and out ----------------------------------------------------------------------------

    def bound(self, session: StreamSession) -> int | None:
        """The most bytes a session's cache holds: its budgets plus the headroom reserved (None: unbounded)."""
        cache = session.cache
        if cache.budgets is None:
            return None
        return sum(b + cache.headroom for b in cache.budgets) * self._shape.bytes_per_token_layer

    def admit(self, session: StreamSession) -> "PooledSession":
        """Take a session (its headroom reserved first) or refuse it with one line, before it holds anything. With a
        slot arena a stream is counted twice: its slot, and its own buffers, which it holds until its first answer
        moves it into the slot."""
        need = self.bound(session)
        if need is not None and self.slot_decode is not None:
            need *= 2
        with self._cond:
            if len(self.streams) >= self.max_streams:
                raise PoolFull(f"stream refused: the pool serves {self.max_streams} streams at most")
            if self.kv_bytes is not None:
                if need is None and not self.unbounded:
                    raise PoolFull("stream refused: an unbounded cache (policy full) cannot be admitted to a pool "
                                   "with a memory limit; give it a budget")
                left = self.kv_bytes - sum(self.streams.values())
                if need is not None and need > left:
                    raise PoolFull(f"stream refused: its cache needs up to {need / 2**20:.0f} MB, {left / 2**20:.0f} "
                                   f"MB of the pool's {self.kv_bytes / 2**20:.0f} MB are left; lower the budget or "
                                   "close a stream")
            self.streams[session] = need or 0
        return PooledSession(self, session)

    def open(self, policy="inf_mllm", budget=None, headroom: int = 0, make=None, prepare=None,
             **options) -> "PooledSession":
        """A new session, admitted: the one way every product opens one. Built on the pool's thread (its system
        prompt's prefill) by `make()` (an adapter's checked session) or from StreamSession's arguments; its cache's
        room for a turn and an answer (`headroom`) reserved; `prepare(session)` (a resumed session's exchanges put
        back) on the pool's thread; then admitted or refused in one line (`PoolFull`)."""
        session = self.call(None, make or (lambda: StreamSession(self.model, self.tokenizer, policy, budget,
                                                                 **options)))
        session.cache.reserve(headroom)
        if prepare is not None:
            self.call(None, prepare, session)
        return self.admit(session)

    def release(self, session: StreamSession) -> None:
        self.call(session, self._unslot, session)  # its answer ends, on the pool's thread
        with self._cond:
            self.streams.pop(session, None)
            self._faults.pop(session, None)

    def _unslot(self, session: StreamSession) -> None:
        if self.slot_decode is not None:
            self.slot_decode.arena.unbind(session.cache)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # --- what streams ask of the model -----------------------------------------------------------------

    def call(self, session: StreamSession | None, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the pool's thread, after `session`'s answer in progress (if any) has ended."""
        if threading.current_thread() is self._thread:
            self._end(session)
            return fn(*args, **kwargs)
        future = Future()
        self._submit(self._jobs, (session, fn, args, kwargs, future))
        return future.result()

    def question(self, session: StreamSession, ids: torch.Tensor, **options) -> torch.Tensor:
        """`session.append_question(ids, **options)`, prefilled together with the other streams' questions waiting."""
        question = _Question(session, ids, options)
        self._submit(self._questions, question)
        return question.future.result()

    def generate(self, session: StreamSession, max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, eos_token_id=None, generator=None):
        """`session.generate`, its steps batched with the other streams' answers."""
        with self._cond:
            if session in self._faults:
                raise self._faults.pop(session)
            if session._logits is None:
                raise ValueError("append a turn before generating")
            eos = eos_set(eos_token_id if eos_token_id is not None else self.model.generation_config.eos_token_id)
            sampling = (do_sample, temperature, top_p, generator)
            answer = _Answer(session, max_new_tokens, torch.tensor(sorted(eos), dtype=torch.long), min(eos, default=0),
                             sampling, session._logits, torch.zeros(1, dtype=torch.bool),
                             ready=threading.Condition(self._lock))
            session._logits = None
            session.last.decode_s, session.last.decoded = 0.0, 0
            self._answers.append(answer)
        return self._tokens(answer)

    def _tokens(self, answer: _Answer):
        try:
            while True:
                with self._cond:
                    if answer not in self._answers:
                        return  # ended by the stream's next turn
                    if answer.steps == 0 and answer.logits is not None and not answer.out:
                        # the first token comes from the turn's logits: picked here, not after the pool's thread
                        # has evicted every stream that asked with this one (the next step waits for that)
                        self._hand_over([answer])
                    else:
                        answer.wants = True
                        self._cond.notify()  # the pool's thread
                    while not answer.out:
                        answer.ready.wait()
                    item = answer.out.popleft()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                token, finished = item
                yield token
                if finished:
                    return
        finally:
            with self._cond:
                self._leave(answer)

    def _submit(self, queue, item) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the session pool is closed")
            queue.append(item)
            self._cond.notify_all()

    # --- the pool's thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        running = True
        while running:
            running = self._serve_next()

    def _serve_next(self) -> bool:
        """One round of the work waiting; False once the pool is closed. A frame of its own: what a round handled
        dies with it, where a finished answer left in `_run`'s locals kept its session and cache alive while the
        thread waited for the next round (after the session's close, until another stream asked)."""
        with self._cond:
            self._gather()
            if self._closed:
                self._fail_all(RuntimeError("the session pool is closed"))
                return False
            questions = list(self._questions)  # emptied in place: a caller may hold the list to append to
            self._questions.clear()
            job = self._jobs.popleft() if self._jobs else None
            wanting = [a for a in self._answers if a.wants]
            for answer in wanting:
                answer.wants = False
        with torch.inference_mode():
            if questions:
                self._prefill(questions)
            if wanting:
                self._step(wanting)
            if job is not None:
                self._job(*job)
        return True

    def _gather(self) -> None:
        """Wait (under the lock) for work. Work that arrives together is batched: once one answer wants its next
        token, the others that are reading theirs get `gather_s` to ask too (else the rows drift apart and each
        step carries one of them); a question waits as long for the other streams' questions asked with it."""
        deadline = None
        while not self._closed and not self._jobs:
            wanting = [a for a in self._answers if a.wants]
            if not wanting and not self._questions:
                self._cond.wait()
                continue
            asked = {id(q.session) for q in self._questions}
            if len(wanting) == len(self._answers) and (not self._questions or len(asked) >= len(self.streams)):
                return
            deadline = deadline or time.monotonic() + self.gather_s
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _job(self, session, fn, args, kwargs, future) -> None:
        try:
            self._end(session)
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            future.set_exception(err)

    def _prefill(self, questions: list[_Question]) -> None:
        """Every waiting question: recall links what each needs (one stream at a time), then one forward for all."""
        ready = []
        for q in questions:
            try:
                self._end(q.session)
                ready.append((q, q.session.begin_question(q.ids, **q.options)))
            except BaseException as err:  # noqa: BLE001
                q.future.set_exception(err)
        alone = [(q, question) for q, question in ready if question.recompute is not None]
        ready = [(q, question) for q, question in ready if question.recompute is None]
        for q, question in alone:  # part of its linked turns recomputed with it: a forward of its own
            try:
                logits = q.session.prefill_recomputing(question, q.ids)
            except BaseException as err:  # noqa: BLE001
                q.future.set_exception(err)
                continue
            q.session.question_done(question)
            q.future.set_result(logits)
        rows = [q.session.turn_row(q.ids, None) for q, _ in ready]
        starts = [q.session.clock() for q, _ in ready]
        evicting = []
        for (q, question), row, t0, logits in zip(ready, rows, starts, self._forward(rows), strict=True):
            if isinstance(logits, BaseException):
                q.future.set_exception(logits)
                continue
            q.session.turn_done(logits, row.length, t0, evict=False, store=False)
            q.session.question_done(question)
            q.future.set_result(logits[:, None])
            if question.evict:
                evicting.append(q.session)
        for session in evicting:  # after every reader has its logits (its first token); before any next step
            t0 = session.clock()
            try:
                session.cache.evict()
            except Exception as err:  # noqa: BLE001 (this stream's fault: its answer, or its next generate, raises it)
                self._fault(session, err)
            session.last.evict_s = session.clock() - t0

    def _fault(self, session: StreamSession, err: BaseException) -> None:
        with self._cond:
            if not self._end(session, err):
                self._faults[session] = err

    def _step(self, wanting: list[_Answer]) -> None:
        """One batched decode step for the answers whose last token is not in their cache yet (those whose caches
        sit in the slot arena in one step on fixed shapes, the others in one eager forward); then every answer that
        asked gets its next token."""
        need = [a for a in wanting if a.logits is None]
        if need:
            self.steps, self.rows = self.steps + 1, self.rows + len(need)
        if need and self.slot_decode is not None:
            for answer in need:
                if answer.plain is None:  # what makes a step plain holds for the whole answer: checked once
                    answer.plain = self.slot_decode.plain(answer.session.cache)
            slotted = [a for a in need if a.plain]
            starts = [a.session.clock() for a in slotted]
            out = self.slot_decode.run([a.session.cache for a in slotted], [a.token for a in slotted]) \
                if slotted else None
            if out is not None:
                for answer, logits, t0 in zip(slotted, out, starts, strict=True):
                    self._advanced(answer, logits, t0)
                need = [a for a in need if not a.plain]
        rows = [Row(a.session.cache, a.token[:, None], {"decoding": True}) for a in need]
        starts = [a.session.clock() for a in need]
        for answer, t0, logits in zip(need, starts, self._forward(rows), strict=True):
            if isinstance(logits, BaseException):
                with self._cond:
                    self._leave(answer)
                    self._give(answer, logits)
                continue
            self._advanced(answer, logits, t0)
        self._hand_over([a for a in wanting if a.logits is not None])

    @staticmethod
    def _advanced(answer: _Answer, logits: torch.Tensor, t0: float) -> None:
        """The answer's last token is in its cache (its step began at `t0`): `logits` give the next."""
        answer.logits = logits
        session = answer.session
        session.seen += 1
        session.cache.step()
        session.last.decode_s += session.clock() - t0

    def _forward(self, rows: list[Row]) -> list:
        """Each row's last logits (1, V), or the error its forward raised: all rows in one forward, and row by row if
        that one fails, so one stream's fault stays its own (a failed forward leaves every cache as it was)."""
        if not rows:
            return []
        try:
            logits = forward_rows(self.model, rows)
            return [logits[r:r + 1] for r in range(len(rows))]
        except Exception as err:  # noqa: BLE001 (handed to the streams)
            if len(rows) == 1:
                return [err]
        results = []
        for row in rows:
            try:
                results.append(forward_rows(self.model, [row]))
            except Exception as err:  # noqa: BLE001 (this row's fault, handed to its stream)
                results.append(err)
        return results

    def _hand_over(self, answers: list[_Answer]) -> None:
        """Each answer's next token from its logits (the greedy ones picked together: one copy to the host), handed
        to its reader."""
        greedy = [a for a in answers if not a.sampling[0] and a.logits.shape[0] == 1]
        picked = torch.cat([a.logits for a in greedy]).argmax(dim=-1).cpu() if greedy else None
        tokens = {id(a): picked[i:i + 1] for i, a in enumerate(greedy)}
        handed = []
        for answer in answers:
            token = tokens.get(id(answer))
            if token is None:
                do_sample, temperature, top_p, generator = answer.sampling
                token = pick(answer.logits, do_sample, temperature, top_p, generator).cpu()
            token = torch.where(answer.done, token.new_full(token.shape, answer.filler), token)
            answer.done |= torch.isin(token, answer.eos)
            answer.steps += 1
            answer.logits, answer.token = None, token
            answer.session.last.decoded = answer.steps
            if answer.session.exchange is not None:
                answer.session.exchange.answer.append(int(token[0]))
            handed.append((answer, token, bool(answer.done.all()) or answer.steps >= answer.max_new_tokens))
        with self._cond:
            for answer, token, finished in handed:
                if finished:
                    self._leave(answer)
                self._give(answer, (token, finished))

    def _give(self, answer: _Answer, item) -> None:
        """`item` (a token, `_END` or an error) for the answer's reader (under the lock), which alone is woken."""
        answer.out.append(item)
        answer.ready.notify()

    def _leave(self, answer: _Answer) -> None:
        """The answer ends (under the lock): its last token is held back for the stream's next turn."""
        if answer in self._answers:
            self._answers.remove(answer)
            answer.session._pending = None if answer.token is None else answer.token[:, None].to(self.model.device)

    def _end(self, session: StreamSession | None, item=_END) -> bool:
        """A new turn of `session` ends its answer in progress, as a lone session's next turn does (its reader gets
        `item`: the end, or an error); whether there was one."""
        with self._cond:
            answers = [a for a in self._answers if a.session is session]
            for answer in answers:
                self._leave(answer)
                self._give(answer, item)
            return bool(answers)

    def _fail_all(self, err: BaseException) -> None:
        for q in self._questions:
            q.future.set_exception(err)
        for *_, future in self._jobs:
            future.set_exception(err)
        for answer in list(self._answers):
            self._leave(answer)
            self._give(answer, err)


class PooledSession:
    """A session as its stream sees it in a pool: `StreamSession`'s calls, run on the pool's thread (questions
    and decode steps batched with the other streams'); everything else read from the session itself."""

    def __init__(self, pool: SessionPool, session: StreamSession):
        self.pool, self.session = pool, session

    def __getattr__(self, name):
        return getattr(self.session, name)

    def append(self, *args, **kwargs) -> torch.Tensor:
        return self.pool.call(self.session, self.session.append, *args, **kwargs)

    def append_text(self, text: str, **kwargs) -> torch.Tensor:
        return self.pool.call(self.session, self.session.append_text, text, **kwargs)

    def restore(self, exchanges=()) -> list[int]:
        return self.pool.call(self.session, self.session.restore, exchanges)

    def run(self, fn, *args, **kwargs):
        """Anything else that touches the session's cache (an out-of-memory shrink), on the pool's thread."""
        return self.pool.call(self.session, fn, *args, **kwargs)

    def append_question(self, input_ids: torch.Tensor, probe_ids=None, named=None, oracle=None, keep: bool = True,
                        all_logits: bool = False) -> torch.Tensor:
        if all_logits or self.session.batch != 1:
            return self.pool.call(self.session, self.session.append_question, input_ids, probe_ids, named, oracle,
                                  keep, all_logits)
        return self.pool.question(self.session, input_ids, probe_ids=probe_ids, named=named, oracle=oracle, keep=keep)

    def generate(self, max_new_tokens: int = 64, **kwargs):
        return self.pool.generate(self.session, max_new_tokens, **kwargs)

    def answer(self, text: str, max_new_tokens: int = 64, **kwargs) -> str:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        self.append_question(ids)
        tokens = [int(t[0]) for t in self.generate(max_new_tokens, **kwargs)]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.pool.release(self.session)
        self.session.cache.release()
