"""A live session: one stream's turn engine on a thread of its own, asked questions at any time.

The interactive front ends (the app's tabs, the HTTP server) each hold one per viewer or client: frames arrive
from a source while the engine's model thread answers questions at turn boundaries; each question gets a queue
that receives its events (`events.py`: `Started`, `Token`s, then `Done` or `Unanswered`), and a subscriber the
stream's own (`ClipSeen`, `Dropped`).
Memory is sampled after every turn for the graphs and telemetry; `close()` ends ingest and the engine and frees
the cache's room in its pool.
"""

import contextlib
import queue
import threading
import time

import psutil
import torch

from .engine import Answer, TurnEngine
from .events import Done, Dropped, Started, Token, Unanswered
from .questions import Question, Schedule


class LockedSchedule(Schedule):
    """Questions added by other threads while the model thread pops them."""

    def __init__(self, unreached=None, video_t=None):
        """`unreached(questions)`: once the stream has ended (at `video_t()`), what to do with questions timed past
        its end (they are then not answered); None: answered at the end, as `stream-qa` does."""
        super().__init__([])
        self.lock = threading.Lock()
        self.unreached, self.video_t = unreached, video_t

    def due(self, video_t):
        with self.lock:
            return super().due(video_t)

    def add(self, question):
        with self.lock:
            super().add(question)

    def times(self):
        with self.lock:
            return super().times()

    def rest(self):
        with self.lock:
            out = super().rest()
        if self.unreached is None:
            return out
        end = self.video_t()
        past = [q for q in out if q.at is not None and q.at > end + 1e-6]
        if past:
            self.unreached(past)
        return [q for q in out if q not in past]


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def torch_mb() -> float | None:
    """Memory the torch allocator holds on the GPU; None on a CPU (no allocator statistics there)."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


class LiveSession:
    """`session` (a StreamSession or a pool's PooledSession) fed from `make_source(stop)` (anything `TurnEngine.run`
    takes, with `live`, `ended` and a `stop` event it honours)."""

    def __init__(self, adapter, session, make_source, label: str, clip_seconds: float = 2.0,
                 max_new_tokens: int = 16, answers_after_end: bool = False, resume_at: tuple[int, float] = (0, 0.0),
                 transcript: list | None = None, engine: TurnEngine | None = None):
        """`answers_after_end`: once the source has ended, questions about what was seen are still answered
        (until `close`); otherwise the session is finished when its video is. `resume_at` (clips already stored,
        their video time) and `transcript` (the answers given before): a session continued from its folder. `engine`:
        the stream's engine as `open.open_stream` made it (its clip length and answer length its own)."""
        self.adapter, self.session, self.label = adapter, session, label
        self.answers_after_end = answers_after_end
        self.source_ended = threading.Event()
        self._asked = threading.Event()
        self.engine = engine or TurnEngine(adapter, session, clip_seconds=clip_seconds, max_new_tokens=max_new_tokens)
        self.engine.resume(resume_at)
        try:
            self.source = make_source(self.engine.stop)
        except BaseException:  # a source that cannot open: the session's room in its pool is given back
            if getattr(session, "close", None) is not None:
                session.close()
            raise
        self.engine.drop_when_full = self.source.live
        budgets = session.cache.budgets
        self.budget_tokens = max(budgets) if budgets else None
        self.schedule = LockedSchedule(self._unreached if answers_after_end else None, lambda: self.engine.video_t)
        self.waiting: dict[int, tuple] = {}  # id(question) -> (the question, its queue), until it is answered
        self.current = None
        self.shown = None  # the newest clip appended (`_on_clip`)
        self.transcript: list[Answer] = list(transcript or [])
        self.samples: list[dict] = []
        self.notices: list[str] = []  # things a page should say in its chat (a source that failed)
        self.notice_log: list[str] = []  # all of them, for API clients
        self.subscribers: list = []  # what receives the stream's own events (anything with `put`)
        self._dropped = 0  # frames dropped, as last said to the subscribers
        self.finished = threading.Event()
        self.closing = False
        self._freeing = threading.RLock()  # HostedSession._free holds it around this class's
        self.last_active = time.monotonic()
        self._sample(resume_at[1], "start")
        self.thread = threading.Thread(target=self._run, name="live-session", daemon=True)
        self.thread.start()

    # --- the engine's thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for answer in self.engine.run(self.source, self.schedule, on_clip=self._on_clip, on_token=self._on_token):
                self._answered(answer)
            self.source_ended.set()
            while self.answers_after_end and not self.closing:  # the video is over; what it showed is not
                self._asked.wait(0.25)
                self._asked.clear()
                for question in self.schedule.rest():
                    self._answered(self.engine.answer(question, self._on_token))
        except Exception as err:  # a truncated file, a camera lost: said to the viewer, the front end keeps working
            self._notice(f"⚠ {self.label}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        finally:
            if self.source.ended:
                self._notice(f"⚠ {self.source.ended}")
            elif self.source.live and not self.closing:
                self._notice(f"⚠ {self.label} stopped delivering frames at {self.engine.video_t:.1f} s")
            with self.schedule.lock:
                self.finished.set()
                unanswered = [self.current, *(out for _, out in self.waiting.values())]
            for q in unanswered:
                if q is not None:
                    q.put(Unanswered("the stream ended before this question's turn"))
            if self.closing:  # closed while this thread was still busy: `close` left the freeing to it
                self._free()

    def _unreached(self, questions) -> None:
        """Questions timed past where the stream ended: the video never reached them; they end unanswered."""
        with self.schedule.lock:
            outs = [self.waiting.pop(id(q))[1] for q in questions if id(q) in self.waiting]
        for out in outs:
            out.put(Unanswered("the stream ended before this question's time"))

    def _answered(self, answer) -> None:
        self.transcript.append(answer)
        self._sample(self.engine.video_t, "answer")
        self.current.put(Done(answer, self.engine.finish_reason(answer)))
        self.current = None

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        self.notice_log.append(text)

    def _on_clip(self, clip) -> None:
        self.shown = clip  # the newest clip in the cache: the app draws its last frame with the detector's boxes
        self._sample(clip.end, "clip")
        if self.subscribers:
            for event in self.engine.clip_events():  # called once the clip went in
                self._tell(event)
            dropped = self.engine.telemetry.dropped
            if dropped > self._dropped:
                self._dropped = dropped
                self._tell(Dropped(dropped))

    def _tell(self, event) -> None:
        for out in list(self.subscribers):
            out.put(event)

    def _on_token(self, question: Question, piece: str | None) -> None:
        if piece is None:
            self.current = self.waiting.pop(id(question))[1]
            self.current.put(Started(self.engine.asked_t, question.text))
        else:
            self.current.put(Token(piece))

    def _sample(self, video_t: float, after: str) -> None:
        s = self.session
        per_token = s.kv_bytes / s.kv_tokens if s.kv_tokens else 0.0
        self.samples.append({
            "video_s": round(video_t, 2), "kv_tokens": s.kv_tokens, "kv_mb": s.kv_bytes / 2**20,
            "full_tokens": s.seen, "full_mb": s.seen * per_token / 2**20, "rss_mb": rss_mb(),
            "torch_mb": torch_mb(), "budget_tokens": self.budget_tokens, "after": after,
            "store_mb": s.store.ram_bytes / 2**20 if s.store is not None else None})  # recall's RAM cache

    # --- from other threads ---------------------------------------------------------------------

    def ask(self, text: str, at: float | None = None, out=None):
        """Queue a question about every frame up to video time `at` (as `stream-qa --ask "… @T"` does); without
        `at`, about every frame up to now (`FrameSource.asked_at`: a player's position, a camera's clock, the last
        frame a client sent), else the next turn boundary. Returns `out` (anything with `put`, a new queue.Queue by
        default), which gets what the module's docstring says."""
        self.last_active = time.monotonic()
        out = queue.Queue() if out is None else out
        at = self.source.asked_at() if at is None else at
        with self.schedule.lock:
            if self.finished.is_set():
                out.put(Unanswered("the stream has ended"))
                return out
            question = Question(text, at)
            self.waiting[id(question)] = (question, out)
            Schedule.add(self.schedule, question)
        self.engine.cuts.add(at)  # the clip open at `at` closes there
        self.engine.wake()
        self._asked.set()
        return out

    def subscribe(self, out=None):
        """`out` (anything with `put`; a new queue.Queue by default) receives the stream's own events from now on:
        each clip seen, the alerts its watches fired, frames dropped."""
        out = queue.Queue() if out is None else out
        self.subscribers.append(out)
        return out

    def unsubscribe(self, out) -> None:
        """`out` receives nothing more."""
        with contextlib.suppress(ValueError):
            self.subscribers.remove(out)

    @property
    def in_flight(self) -> int:
        """Questions asked and not yet answered."""
        return len(self.waiting) + (self.current is not None)

    @property
    def waiting_for_video(self) -> int:
        """Questions asked at a video time the stream has not reached: they hold no model time yet."""
        now = self.engine.video_t
        return sum(1 for question, _ in list(self.waiting.values()) if question.at is not None and question.at > now)

    def telemetry(self) -> dict:
        t, last = self.engine.telemetry, self.transcript[-1] if self.transcript else None
        return {"video_s": round(self.engine.video_t, 2), "clips": t.clips + self.engine.resume_at[0],  # stored too
                "dropped": t.dropped,
                "ingest_speed": round(t.ingest_speed, 2) if t.ingest_s else None,
                "ttft_s": last.ttft_s if last else None, "tokens_per_s": last.tokens_per_s if last else None,
                "answers": len(self.transcript), "finished": self.finished.is_set(), "notices": list(self.notice_log)}

    def close(self) -> None:
        """Stop ingest and the model thread; the cache goes with this object. A model thread still busy after the
        wait frees the session itself when it ends (`_run`), so its room in the pool is never kept by a slow stop."""
        self.closing = True
        self.engine.close()
        self._asked.set()
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self._free()

    def _free(self) -> None:
        """Once, after the model thread ended: the pool's room given back and the cache let go (a front end may hold
        a closed session's object a long time)."""
        with self._freeing:
            if self.session is None:
                return
            if getattr(self.session, "close", None) is not None:  # a pool's stream (a lone session holds no room)
                self.session.close()  # its room in the pool is free for the next stream
            self.session = self.engine.session = None
