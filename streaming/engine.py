"""The turn engine: clips and questions become turns of one streaming session, in video-time order.

Ingest (decode, sample, encode frames into visual embeddings: `ingest.py`) runs on threads of its own behind a
bounded queue, so the video keeps playing while the model answers; the model thread appends each clip as a turn,
answers questions between clips, and the cache evicts at every turn boundary. A question at video time T is
answered once every frame at or before T is in: ingest closes the open clip at T for it (`cuts`), and the answer
is stamped T. The adapter's pure `encode` runs on the ingest thread and its stateful `append_clip` on the model
thread, in video order. Shutdown is prompt from either side: the model thread leaving (end, error, a closed
consumer) or `close()` from outside.

Faults in one turn do not end a stream. A clip turn whose prefill raises (the session rolls the
cache back) is dropped with one warning line and counted in `telemetry.failed`; the same error
several turns in a row is a bug, not a fault, and ends the run. An out-of-memory error in a
prefill tightens a bounded cache's budget by a quarter, evicts, and retries the turn a few times.
"""

import contextlib
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import torch

from models.base import Reading

from . import budgets
from .answers import Answer  # noqa: F401 (the engine's word: what each question got)
from .clips import Cuts
from .errors import is_user_error, one_line
from .events import Alert, ClipSeen, Done, Dropped, Started, Token, WatchState
from .gate import ChangeGate
from .ingest import END, WAKE, Clip, Ingest, Reached, Telemetry, shown  # noqa: F401 (Clip, shown: the engine's words too)
from .questions import Question, Schedule
from .watches import alert_answer, model_refusal

_POLL_S = 0.25  # how often an idle model thread looks for stop and untimed questions


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's failure (a RuntimeError)."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _names_no_clip(meta: dict) -> bool:
    """What a watch's question names of the stored clips: none (it is about the clip just in)."""
    return False


def _stderr_warning(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


class TurnEngine:
    max_oom_retries = 3  # tighter budgets tried for one turn before it is dropped
    max_failed_in_a_row = 3  # clip turns failing this often in a row is a bug, not a fault: the run ends

    def __init__(self, adapter, session, clip_seconds: float = 4.0, queue_size: int = 4,
                 max_new_tokens: int = 16, drop_when_full: bool = False, gate: bool = False):
        """`drop_when_full`: for live sources (webcam, browser camera, URL, a paced file), drop a clip
        the model has no room for and count it in `telemetry.dropped`; otherwise ingest waits. `gate`: the change
        gate (streaming/gate.py) in ingest; the product's streams take it from their settings (on by default)."""
        self.adapter, self.session = adapter, session
        self.clip_seconds, self.max_new_tokens = clip_seconds, max_new_tokens
        # the longest turn and answer it runs are known here: the cache's buffers grow to them and the budget now
        # and keep that shape (one compile of a compiled decode step); +1: the held-back last answer token goes
        # in front of the next turn
        session.cache.reserve(budgets.headroom(adapter, max_new_tokens))
        self.clips: queue.Queue = queue.Queue(maxsize=queue_size)
        self.drop_when_full, self.gate = drop_when_full, gate
        self.stop = threading.Event()
        self.telemetry = Telemetry()
        self.error: BaseException | None = None
        self.video_t = 0.0  # video time covered by the clips in the cache
        self.resume_at: tuple[int, float] = (0, 0.0)  # (clips already seen, video time): continue a session after them
        self.oracle: Callable[[Question], Callable[[dict], bool]] | None = None  # benchmarks: a recall's right answer
        self.warn: Callable[[str], None] = _stderr_warning  # one line per fault; a caller may route it elsewhere
        self._failed_in_a_row = self._oom_attempts = 0
        self._floor: int | None = None
        self.log: list[dict] = []  # metas of the clips this run appended (`clip_log`)
        self.seen: dict = {}  # the newest clip's record (`ClipSeen`): its log entry, or what a merged clip joined
        self._watches = None
        self.fired: list[dict] = []  # the alerts the newest clip fired
        self.changed: list[dict] = []  # the watches whose condition it changed (`Watches.changed`)
        self.cuts = Cuts()  # the times questions were asked at: the open clip closes there (clips.py)
        self.through = 0.0  # every frame at or before this video time is in the cache
        self.last_frame_t: float | None = None  # the newest frame in the cache
        self.asked_t = 0.0  # the video time of the answer being given (`stamp`)

    @property
    def watches(self):
        """The stream's watches (streaming/watches.py), judged on each clip that goes in (None: none)."""
        return self._watches

    @watches.setter
    def watches(self, watches) -> None:
        """ValueError (one line) for a watch the model must judge on a stream whose policy keeps every question."""
        if watches is not None and (why := model_refusal(self.session.cache.policy)) is not None:
            watches.refuse_model(why)
        self._watches = watches

    def resume(self, at: tuple[int, float]) -> None:
        """Continue a session after what its folder stored: (clips already seen, their video time)."""
        self.resume_at, self.video_t, self.through = at, at[1], at[1]

    def close(self) -> None:
        """Stop from outside (another thread): ingest and the model thread both end promptly."""
        self.stop.set()

    def wake(self) -> None:
        """A question was added to the schedule: answer it at the next turn boundary, not the next clip."""
        # a full queue needs no wake: the model thread looks at the schedule before each waiting clip
        with contextlib.suppress(queue.Full):
            self.clips.put_nowait(WAKE)

    # --- model thread ---------------------------------------------------------------------------

    def run(self, source, schedule: Schedule, on_clip: Callable[[Clip], None] | None = None,
            on_token: Callable[[Question, str], None] | None = None) -> Iterator[Answer]:
        """Yield answers in order; clips go in as they arrive. Ends when the source does."""
        ingest = Ingest(self.adapter, self.clip_seconds, self.clips, self.stop, self.telemetry, self.cuts,
                        self.drop_when_full, self.resume_at, ChangeGate() if self.gate else None)
        self.cuts.add_all(getattr(schedule, "times", list)())  # the questions timed already: their clips close there
        thread = threading.Thread(target=ingest.run, args=(source,), name="ingest", daemon=True)
        thread.start()
        try:
            while not self.stop.is_set():
                try:
                    item = self.clips.get(timeout=_POLL_S)
                except queue.Empty:
                    item = WAKE
                if item is END or self.stop.is_set():  # stopped while waiting: no turn begins after it
                    break
                if isinstance(item, Reached):  # every frame up to its time is in: the questions at it are due
                    self.through, self.video_t = max(self.through, item.t), max(self.video_t, item.t)
                elif item is not WAKE:
                    # a question whose frames all came before this clip goes in before it
                    for q in self._due(schedule, math.nextafter(item.start, -math.inf)):
                        yield self.answer(q, on_token, item.start)
                    if self.feed(item) and on_clip:
                        on_clip(item)
                    if self.stop.is_set():  # stopped by what the clip did (a soak's last round): no turn after it
                        break
                for q in self._due(schedule, self.through):  # untimed questions, and those whose frames are in
                    yield self.answer(q, on_token, self.through)
            self.error = self.error or ingest.error
            if self.error is not None:
                raise self.error
            for q in [] if self.stop.is_set() else schedule.rest():  # asked after the video ended
                yield self.answer(q, on_token)
        finally:
            self.stop.set()
            thread.join(timeout=5)

    def _due(self, schedule, through: float) -> list[Question]:
        """The questions to answer now, when every frame up to `through` is in; nothing is asked of an empty
        cache."""
        return schedule.due(through) if self.has_clips else []

    @property
    def has_clips(self) -> bool:
        """Whether the cache holds a clip to ask about: one of this run's, or a resumed session's stored ones."""
        return self.telemetry.clips > 0 or self.resume_at[0] > 0

    def feed(self, clip: Clip) -> bool:
        """One clip turn, on the model thread; False when a fault dropped it (the session is as it was before
        the turn, and the clip's time has passed all the same). A clip the change gate merged is no turn: the clip
        log's newest entry grows over it."""
        merged = clip.merged > 0 and bool(self.log)
        appended = self._merge(clip) if merged else self._append_clip(clip)
        self.video_t = clip.end
        # a clip cut short for a question holds every frame up to its end; any other, those before its end
        self.through = clip.end if clip.cut else math.nextafter(clip.end, -math.inf)
        if clip.last is not None:
            self.last_frame_t = clip.last
        if appended and not merged:
            self.telemetry.clips += 1
            self.seen = self.log[-1]
        self.fired, self.changed = [], []
        if appended and self.watches is not None:  # a merged clip: the model's watches stand (the cache is the same)
            self.fired = self.watches.judge(self.log[-1], clip, None if merged else self.side_questions)
            self.changed = self.watches.changed
        return appended

    def _merge(self, clip: Clip) -> bool:
        """The newest entry's span grows to the end of a clip whose frames were unchanged; the clip's record says
        which entry it joined."""
        grown = self.log[-1] = {**self.log[-1], "end": clip.end}
        self.seen = {**grown, "clip": clip.index, "start": clip.start, "merged": True, "into": grown["clip"],
                     "since": grown["start"]}
        self.telemetry.merged += 1
        self.telemetry.gated += clip.merged
        return True

    def side_questions(self, texts: list[str]) -> list[str | None]:
        """The watches' yes/no questions about the clip just in (`VideoAdapter.yes_or_no_all`: none stays in the
        cache); all None, with one warning line, when they fail (the watches stay as they were; the stream goes on)."""
        try:
            # about the clip just in: recall links nothing for them (as for any question about the present)
            extra = {"named": _names_no_clip} if self.session.recall is not None else {}
            return self.adapter.yes_or_no_all(self.session, texts, **extra)
        except Exception as err:  # noqa: BLE001 (a fault in the watches' questions must not end the stream)
            self.warn(f"the watch questions ({len(texts)}, the first {texts[0][:60]!r}) failed: {one_line(err)}")
            return [None] * len(texts)

    def clip_log(self) -> list[dict]:
        """Every clip's meta, by clip index: the clips of this run, and a resumed session's stored ones."""
        stored = self.session.store.clips() if self.session.recall is not None else []
        return sorted(({m["clip"]: m for m in stored} | {m["clip"]: m for m in self.log}).values(),
                      key=lambda m: m["clip"])

    def _append_clip(self, clip: Clip) -> bool:
        while True:
            try:
                meta = self.adapter.append_clip(self.session, clip.encoded, clip.index, clip.start, clip.end)
                self.log.append(meta or {"clip": clip.index, "start": clip.start, "end": clip.end})
                self._failed_in_a_row = self._oom_attempts = 0
                return True
            except Exception as err:
                if is_user_error(err):  # the input's fault: the CLI reports it in one line
                    raise
                why = self._retry_after(err, f"clip {clip.index}'s prefill")
                if why is None:
                    continue
                self._failed_in_a_row += 1
                if self._failed_in_a_row >= self.max_failed_in_a_row:
                    raise  # not a passing fault: every turn fails the same way
                self.telemetry.failed += 1
                self.warn(f"clip {clip.index} ({clip.start:.1f}-{clip.end:.1f} s) dropped: {type(err).__name__}: "
                          f"{one_line(err)[:160]}{why}; the stream continues ({self.telemetry.failed} dropped)")
                return False

    def _retry_after(self, err: Exception, where: str) -> str | None:
        """After an out-of-memory error a bounded cache gets a quarter smaller (never below one clip turn and a
        question), evicts, and the turn is tried again, `max_oom_retries` times at most: None. Otherwise why
        not ("" when the error is not out of memory)."""
        if not is_out_of_memory(err):
            return ""
        self._oom_attempts += 1
        cache = self.session.cache
        old = list(cache.budgets) if cache.budgets else None
        new = None if old is None else [max(b * 3 // 4, min(b, self.min_budget())) for b in old]  # never larger
        if new is None or new == old or self._oom_attempts > self.max_oom_retries:
            tried, self._oom_attempts = self._oom_attempts - 1, 0
            return "; out of memory: " + ("a full cache cannot shrink" if old is None else
                                          f"{tried} tighter budgets did not help" if tried else
                                          "the budget is at its floor")
        on_model_thread = getattr(self.session, "run", None)  # a pooled session's cache is its pool thread's to touch
        with torch.inference_mode():
            on_model_thread(cache.shrink, new) if on_model_thread else cache.shrink(new)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.telemetry.oom_retries += 1
        self.warn(f"out of memory in {where} ({one_line(err)[:120]}); budget {min(old)} -> {min(new)} tokens "
                  f"per layer, retry {self._oom_attempts} of {self.max_oom_retries}")
        return None

    def min_budget(self) -> int:
        """The smallest budget that still holds one clip turn and a question, and that the policy accepts."""
        if self._floor is None:
            self._floor = budgets.floor(self.adapter, self.session.cache.policy)
        return self._floor

    def _ask(self, question: Question, extra: dict):
        """The question's prefill, retried with a tighter budget after an out-of-memory error."""
        while True:
            try:
                iterator = self.adapter.ask(self.session, question.text, self.max_new_tokens, **extra)
                self._oom_attempts = 0
                return iterator
            except Exception as err:
                where = f"the prefill of question {question.text[:40]!r}"
                if is_user_error(err) or self._retry_after(err, where) is not None:
                    raise  # an answer that cannot be given ends the run: it is not dropped silently

    def read(self, question: Question) -> Reading:
        """How the question is asked (`VideoAdapter.read_question`, against the clip log at the video's time); in
        the oracle mode of the benchmarks, about the clips the oracle names."""
        recall = self.session.recall
        oracle = self.oracle(question) if self.oracle is not None and recall is not None and recall.mode == "oracle" \
            else None
        return self.adapter.read_question(question.text, self.clip_log(), self.video_t, oracle)

    def relay(self, handler) -> tuple:
        """What `run` says, handed to `handler` as events (events.py): the run's callbacks (on_clip, on_token) and
        what to call with each answer it yields. Each clip is `ClipSeen` (its clip-log entry), with `Dropped` when
        ingest dropped clips since the last, an `Alert` for each watch it fired and a `WatchState` for each it changed;
        each question `Started`, `Token`s, then `Done`."""
        said = {"dropped": self.telemetry.dropped}

        def on_clip(clip: Clip) -> None:
            for event in self.clip_events():
                event.to(handler)
            if self.telemetry.dropped > said["dropped"]:
                said["dropped"] = self.telemetry.dropped
                Dropped(self.telemetry.dropped).to(handler)

        def on_token(question: Question, piece: str | None) -> None:
            (Started(self.asked_t, question.text) if piece is None else Token(piece)).to(handler)

        return on_clip, on_token, lambda answer: Done(answer, self.finish_reason(answer)).to(handler)

    def clip_events(self) -> list:
        """What the newest clip says, once it went in: `ClipSeen` (its entry), an `Alert` for each watch it fired and a
        `WatchState` for each watch whose condition it changed."""
        return [ClipSeen(self.seen), *map(Alert, self.fired), *map(WatchState, self.changed)]

    def play(self, source, schedule: Schedule, handler) -> None:
        """`run`, with what it says handed to `handler` as events (`relay`)."""
        on_clip, on_token, on_answer = self.relay(handler)
        for answer in self.run(source, schedule, on_clip, on_token):
            on_answer(answer)

    def finish_reason(self, answer: Answer) -> str:
        """OpenAI's word for how the answer ended: "length" when the model used every token it was allowed."""
        used = len((answer.exchange or {}).get("answer", ()))
        return "length" if answer.source == "model" and used >= self.max_new_tokens else "stop"

    def stamp(self, question: Question, known_to: float | None = None) -> float:
        """The video time an answer is about: the time it was asked, when the cache holds every frame up to it
        (the video is known `known_to` that time: every frame before it is in; by default, to the cache's end) and
        none after it; else the cache's end (a question that came late, after later frames went in, is about
        them too)."""
        at, known_to = question.at, self.video_t if known_to is None else known_to
        if at is None or at > known_to or (self.last_frame_t is not None and self.last_frame_t > at):
            return self.video_t
        return at

    def answer(self, question: Question, on_token=None, known_to: float | None = None) -> Answer:
        self.asked_t = self.stamp(question, known_to)  # what the announcement (`on_token(question, None)`) says
        if on_token:
            on_token(question, None)  # announces the question before its first token
        t0 = time.perf_counter()
        reading = self.read(question)
        told = alert_answer(question.text, self.watches.alerts) if self.watches is not None else None
        direct, why = (told, "the alert log") if told is not None else (reading.direct, reading.resolution.why)
        pieces, first, recalled = [], None, []
        if direct is not None:
            pieces, first = [direct], time.perf_counter()
            if on_token:
                on_token(question, direct)
        else:
            # a question about a past clip may leave with its answer: its "yes" would sway the next question
            extra = {"keep": reading.keep}
            if self.session.recall is not None:
                extra["named"] = reading.named
                if self.oracle:
                    extra["oracle"] = self.oracle(question)
            text = reading.text
            for piece in self._ask(Question(text, question.at), extra):
                if first is None:
                    first = time.perf_counter()
                pieces.append(piece)
                if on_token:
                    on_token(question, piece)
            recalled = [{k: meta[k] for k in ("clip", "start", "end") if k in meta}
                        for _, meta in self.session.last_recalled]
        end = time.perf_counter()
        first = first or end
        return Answer(
            video_t=self.asked_t, question=question.text, answer="".join(pieces).strip(), ttft_s=first - t0,
            tokens_per_s=self.session.last.tokens_per_s if direct is None else 0.0, kv_tokens=self.session.kv_tokens,
            kv_mb=self.session.kv_bytes / 2**20, rss_mb=psutil.Process().memory_info().rss / 2**20,
            recalled=recalled, looked_up=why, source="model" if direct is None else "clip log",
            exchange=self.session.exchange.as_dict() if direct is None and self.session.exchange else None)

