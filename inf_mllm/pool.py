"""Many streams on one model: each its own bounded session, every model call on one thread, the prefills of
several streams and the decode steps of all answers in progress each batched into one forward (rows.py).

A stream holds a `PooledSession` (pooled.py); each call it makes is a typed work item (work.py) queued for the pool's
thread. Each round of that thread reads schedule (`_schedule`: every question waiting, the answers whose readers
have taken their last token, the clip turns that fit in `max_batched_tokens`, one other call) -> execute
(prefills.py: one forward for the questions, one for the clip turns, rows of different lengths each on its own
cache; one batched decode step) -> update (each reader's first token, then evictions; next tokens handed over;
futures). An answer advances only when its reader asks for the next token, as a lone session's generator does: a
reader that stops leaves its last token held back for the next turn, and nothing was decoded past it. A stream is
admitted only if its cache's bound fits in what is left of the pool's memory (admission.py). A batched forward that
fails is retried row by row, so a fault in one stream's cache reaches that stream only.
"""

import threading
import time

import torch

from . import prefills
from .admission import Admission
from .answer import Sampling
from .pooled import PooledSession
from .rows import Row, forward_apart
from .session import StreamSession
from .slots import SlotArena, SlotDecode
from .work import Call, ClipTurn, DecodeRow, QuestionTurn, Status

_END = object()  # an answer ended by its stream's next turn


class SessionPool:
    """`kv_bytes`, `max_streams`, `unbounded`: what it admits (admission.py). `slots`: streams whose decode steps
    run in one step on fixed shapes (slots.py; 0: none, every step an eager batched forward), compiled when
    `compile_decode` (a GPU; `compile_mode` as `torch.compile`'s, default max-autotune there)."""

    def __init__(self, model, tokenizer=None, kv_bytes: int | None = None, max_streams: int = 64,
                 unbounded: bool = False, slots: int = 0, compile_decode: bool = False,
                 compile_mode: str | None = None, max_batched_tokens: int = 2048):
        self.model, self.tokenizer = model, tokenizer
        self.slot_decode = SlotDecode(model, SlotArena(slots), compile_decode, compile_mode) if slots else None
        self.admission = Admission(model, kv_bytes, max_streams, unbounded, counted=2 if slots else 1)
        self.gather_s = 0.005  # how long work that arrives together waits for the rest of it (`_gather`)
        self.max_batched_tokens = max_batched_tokens  # clip turns packed into one forward, in tokens (at least one)
        self.steps = 0  # batched decode steps run, and the rows they carried
        self.rows = 0
        self.turn_forwards = 0  # forwards that ran clip turns, and the clip turns they carried
        self.turns = 0
        # the pool's thread waits on `_cond` for work; each answer's reader on its own condition of the same lock, so
        # a token handed to one stream wakes that stream's reader alone
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._jobs: list[Call] = []
        self._turns: list[ClipTurn] = []
        self._questions: list[QuestionTurn] = []
        self._answers: list[DecodeRow] = []
        self._faults: dict[StreamSession, BaseException] = {}  # an eviction that failed after its question returned
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="session-pool", daemon=True)
        self._thread.start()

    # --- streams in and out ----------------------------------------------------------------------------

    def admit(self, session: StreamSession) -> PooledSession:
        """Take a session or refuse it with one line (`PoolFull`), before it holds anything (admission.py)."""
        with self._cond:
            self.admission.take(session)
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
        unslot = self.slot_decode.arena.unbind if self.slot_decode is not None else lambda cache: None
        self.call(session, unslot, session.cache)  # its answer ends, on the pool's thread
        with self._cond:
            self.admission.release(session)
            self._faults.pop(session, None)

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
        return self._submit(self._jobs, Call(session, fn, args, kwargs))

    def turn(self, session: StreamSession, embeds: torch.Tensor, **options) -> torch.Tensor:
        """`session.append(inputs_embeds=embeds, **options)` (a clip turn: store, meta, vision, positions), packed into
        one forward with the other streams' clip turns waiting, up to `max_batched_tokens`."""
        return self._submit(self._turns, ClipTurn(session, embeds, **options))

    def question(self, session: StreamSession, ids: torch.Tensor, **options) -> torch.Tensor:
        """`session.append_question(ids, **options)`, prefilled together with the other streams' questions waiting."""
        return self._submit(self._questions, QuestionTurn(session, ids, options))

    def generate(self, session: StreamSession, max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, eos_token_id=None, generator=None, constraint=None):
        """`session.generate`, its steps batched with the other streams' answers."""
        with self._cond:
            if session in self._faults:
                raise self._faults.pop(session)
            answer = DecodeRow.begin(session, max_new_tokens, Sampling(do_sample, temperature, top_p, generator,
                                   constraint), eos_token_id, device="cpu", ready=threading.Condition(self._lock))
            self._answers.append(answer)
        return self._tokens(answer)

    def _tokens(self, answer: DecodeRow):
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

    def _submit(self, queue: list, item):
        """Queue `item` for the pool's thread and wait for what it gives back."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the session pool is closed")
            queue.append(item)
            self._cond.notify_all()
        return item.future.result()

    # --- the pool's thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while self._serve_next():
            continue

    def _serve_next(self) -> bool:
        """One round: schedule (under the lock) -> execute -> update; False once the pool is closed. A frame of its
        own: what a round handled dies with it, where a finished answer left in `_run`'s locals kept its session and
        cache alive while the thread waited for the next round (after the session's close, until another stream
        asked)."""
        with self._cond:
            work = self._schedule()
        if work is None:
            return False
        questions, wanting, turns, job = work
        try:
            with torch.inference_mode():
                if questions:
                    self._prefill(questions)
                if wanting:
                    self._step(wanting)
                if turns:
                    self._clip_turns(turns)
                if job is not None:
                    self._job(job)
        except BaseException as err:  # noqa: BLE001 (not one stream's fault: every caller waiting gets it)
            self._broken(err, (*questions, *turns, *([job] if job else [])))
            return False
        return True

    def _broken(self, err: BaseException, running) -> None:
        """A round ended by what no stream's own handling takes (KeyboardInterrupt, SystemExit, a process dying):
        the pool closes, and the items of the round and every caller waiting get the error instead of waiting for
        a thread that is gone."""
        with self._cond:
            self._closed = True
            for item in running:
                if not item.future.done():
                    item.fail(err)
            self._fail_all(err)
            self._cond.notify_all()

    def _schedule(self) -> tuple | None:
        """What this round runs (under the lock): every question waiting, the answers whose readers want their next
        token, the clip turns waiting that fit in `max_batched_tokens` (the first at any length), and one other
        call; None once the pool is closed."""
        self._gather()
        if self._closed:
            self._fail_all(RuntimeError("the session pool is closed"))
            return None
        questions = list(self._questions)  # emptied in place: a caller may hold the list to append to
        self._questions.clear()
        turns, tokens = [], 0
        while self._turns and (not turns or tokens + self._turns[0].tokens <= self.max_batched_tokens):
            turns.append(self._turns.pop(0))
            tokens += turns[-1].tokens
        job = self._jobs.pop(0) if self._jobs else None
        wanting = [a for a in self._answers if a.wants]
        for answer in wanting:
            answer.wants = False
        for item in (*questions, *turns, *([job] if job else [])):
            item.status = Status.RUNNING
        return questions, wanting, turns, job

    def _gather(self) -> None:
        """Wait (under the lock) for work. Work that arrives together is batched: once one answer wants its next
        token, the others that are reading theirs get `gather_s` to ask too (else the rows drift apart and each
        step carries one of them); a question or a clip turn waits as long for the other streams' (streams that
        take turns one after another would else alternate, each turn alone, and never share a forward)."""
        deadline = None
        while not self._closed and not self._jobs:
            wanting = [a for a in self._answers if a.wants]
            if not wanting and not self._questions and not self._turns:
                self._cond.wait()
                continue
            streams = len(self.admission.streams)
            asked = len({id(q.session) for q in self._questions})
            turned = len({id(t.session) for t in self._turns})
            if len(wanting) == len(self._answers) and (not self._questions or asked >= streams) \
                    and (not self._turns or turned >= streams):
                return
            deadline = deadline or time.monotonic() + self.gather_s
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _job(self, job: Call) -> None:
        try:
            self._end(job.session)
            job.finish(job.fn(*job.args, **job.kwargs))
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            job.fail(err)

    def _clip_turns(self, turns: list[ClipTurn]) -> None:
        if len(turns) > 1:
            self.turn_forwards, self.turns = self.turn_forwards + 1, self.turns + len(turns)
        prefills.clip_turns(self.model, turns, self._end)

    def _prefill(self, questions: list[QuestionTurn]) -> None:
        self._evict(prefills.questions(self.model, questions, self._end))

    def _evict(self, sessions: list[StreamSession]) -> None:
        """After every reader has its logits (its first token); before any next step."""
        for session in sessions:
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

    def _step(self, wanting: list[DecodeRow]) -> None:
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
        starts = [a.session.clock() for a in need]
        for answer, t0, logits in zip(need, starts, self._decode_forward(need), strict=True):
            if isinstance(logits, BaseException):
                with self._cond:
                    self._leave(answer)
                    self._give(answer, logits)
                continue
            self._advanced(answer, logits, t0)
        self._hand_over([a for a in wanting if a.logits is not None])

    def _decode_forward(self, need: list[DecodeRow]) -> list:
        """Each row's next logits, or its error: one batched forward (rows.py); a lone row takes a lone session's own
        step, so a pool of one decodes as a session alone does, token for token and bit for bit."""
        if len(need) != 1:
            return forward_apart(self.model, [Row(a.session.cache, a.token[:, None], {"decoding": True}) for a in need])
        session = need[0].session
        marks = session.cache.mark()
        try:
            return [session.step(need[0].token)]
        except Exception as err:  # noqa: BLE001 (this stream's fault: the cache as it was, the error to its reader)
            session.cache.rollback(marks)
            return [err]

    @staticmethod
    def _advanced(answer: DecodeRow, logits: torch.Tensor, t0: float) -> None:
        """The answer's last token is in its cache (its step began at `t0`): `logits` give the next."""
        answer.advanced(logits)
        answer.session.last.decode_s += answer.session.clock() - t0

    def _hand_over(self, answers: list[DecodeRow]) -> None:
        """Each answer's next token from its logits (the greedy ones picked together: one copy to the host), handed
        to its reader."""
        greedy = [a for a in answers if a.sampling.plain and a.logits.shape[0] == 1]
        picked = torch.cat([a.logits for a in greedy]).argmax(dim=-1).cpu() if greedy else None
        tokens = {id(a): picked[i:i + 1] for i, a in enumerate(greedy)}
        handed = []
        for answer in answers:
            token = tokens.get(id(answer))
            token = answer.apply(answer.sampling.pick(answer.logits).cpu() if token is None else token)
            handed.append((answer, token, answer.handed(token, bool(answer.done.all()))))
        with self._cond:
            for answer, token, finished in handed:
                if finished:
                    self._leave(answer)
                self._give(answer, (token, finished))

    def _give(self, answer: DecodeRow, item) -> None:
        """`item` (a token, `_END` or an error) for the answer's reader (under the lock), which alone is woken."""
        answer.out.append(item)
        answer.ready.notify()

    def _leave(self, answer: DecodeRow) -> None:
        """The answer ends (under the lock): its last token is held back for the stream's next turn."""
        if answer in self._answers:
            self._answers.remove(answer)
            answer.status = Status.DONE
            answer.hold_back()

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
        for item in (*self._questions, *self._turns, *self._jobs):
            item.fail(err)
        for answer in list(self._answers):
            self._leave(answer)
            self._give(answer, err)
