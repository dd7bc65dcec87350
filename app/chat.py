"""One browser session: its own engine (cache, clips, transcript) running on a background thread.

The engine's model thread answers questions at turn boundaries; this object hands each question's
tokens to the event that asked it, keeps the memory series for the graph (sampled after every turn)
and ends everything on `close()` — called when the page leaves or the session idles out.

Every tab's session is a stream of one session pool per model (inf_mllm/pool.py): its clip turns and questions run
on the pool's thread, and the answers of all tabs decoding at once go through the model together, so a tab's
answer keeps streaming while another tab's clip goes in. A tab the pool's memory cannot hold is refused when it
opens, in one line.
"""

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from inf_mllm.policies import policy_options
from inf_mllm.pool import SessionPool
from inf_mllm.spec import PolicySpec, parse_budget
from models import load_adapter, runs_here
from streaming.budgets import headroom, open_session
from streaming.checks import one_line
from streaming.engine import Answer, TurnEngine
from streaming.memory import auto_budget
from streaming.questions import Question, Schedule

MODELS = runs_here()  # the models that load with no folder (models.ADAPTERS); `python -m app --hf DIR` adds checkpoints
CHECKPOINTS: dict[str, str] = {}  # model name in the list → transformers checkpoint folder (`--model hf`)
_adapters: dict[str, object] = {}
_pools: dict[str, SessionPool] = {}
_adapters_lock = threading.Lock()


class BadInput(ValueError):
    """Something the user chose or typed cannot work; the message is one line for the chat."""


@dataclass(frozen=True)
class Settings:
    model: str = "tiny-vlm"
    policy: str = "inf_mllm+recall"
    budget: str = "256"
    bias: float | None = None
    window: int | None = None
    fps: float = 1.0
    clip_seconds: float = 2.0
    max_new_tokens: int = 16

    def spec(self) -> PolicySpec:
        """The policy with the bias and window it takes (the page shows both fields for every policy)."""
        try:
            spec = PolicySpec.parse(self.policy)
        except ValueError as err:
            raise BadInput(one_line(err)) from None
        names = policy_options(spec)
        return spec.with_options(**{k: v for k, v in (("bias", self.bias), ("window", self.window))
                                    if v is not None and k in names})

    def budget_value(self):
        """Tokens (int), a memory size ("64MB") or "auto"; None for the full cache."""
        if not self.spec().bounded:
            return None
        try:
            return parse_budget(self.budget)
        except ValueError as err:
            raise BadInput(one_line(err)) from None

    def describe(self) -> str:
        spec = self.spec()
        budget = f"budget {self.budget}" if spec.bounded else "unbounded"
        extra = "".join(f", {k} {v}" for k, v in spec.options.items())
        return f"{self.model}, {self.policy}, {budget}{extra}"


def shared_adapter(name: str):
    """Weights are loaded once per process; each session forks its own stream state."""
    if name not in MODELS:
        raise BadInput(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    with _adapters_lock:
        if name not in _adapters:
            _adapters[name] = load_adapter("hf", CHECKPOINTS[name]) if name in CHECKPOINTS else load_adapter(name)
        return _adapters[name]


def shared_pool(name: str) -> SessionPool:
    """The one session pool of a model: every tab's stream on it, its caches within the memory free when it opened
    (the `--budget auto` probe's figure)."""
    adapter = shared_adapter(name)
    with _adapters_lock:
        if name not in _pools:
            free = auto_budget(None, str(adapter.device))
            _pools[name] = SessionPool(adapter.model, adapter.tokenizer, unbounded=True,  # "full": the comparison
                                       kv_bytes=max(0, free.free_bytes - free.reserve_bytes))
        return _pools[name]


def add_checkpoint(folder: str) -> str:
    """Offer a transformers checkpoint folder in the model list as "hf:NAME". Loaded now: a folder that cannot
    work fails at start-up, in one line, not in a user's session."""
    name = f"hf:{Path(folder).expanduser().resolve().name}"
    if name not in MODELS:
        with _adapters_lock:
            _adapters[name] = load_adapter("hf", folder)
        CHECKPOINTS[name] = folder
        MODELS.append(name)
    return name


class _LockedSchedule(Schedule):
    """Questions added by page events while the model thread pops them."""

    def __init__(self):
        super().__init__([])
        self.lock = threading.Lock()

    def due(self, video_t):
        with self.lock:
            return super().due(video_t)

    def add(self, question):
        with self.lock:
            super().add(question)

    def rest(self):
        with self.lock:
            return super().rest()


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def torch_mb() -> float | None:
    """Memory the torch allocator holds on the GPU; None on a CPU (no allocator statistics there)."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


class Chat:
    """A session's engine over `source` (anything `TurnEngine.run` takes, with `live` and a `stop` event)."""

    def __init__(self, settings: Settings, make_source, label: str):
        self.settings, self.label = settings, label
        spec, budget = settings.spec(), settings.budget_value()
        self.adapter = shared_adapter(settings.model).fork()
        pool = shared_pool(settings.model)
        try:  # the system prompt's prefill, on the pool's thread
            session, _ = pool.call(None, open_session, self.adapter, spec, budget, settings.max_new_tokens)
            session.cache.reserve(headroom(self.adapter, settings.max_new_tokens))
            session = pool.admit(session)
        except ValueError as err:  # too small a budget, a bad window, no room in the pool: as stream-qa says it
            raise BadInput(one_line(err).removeprefix("--")) from err
        self.session = session
        self.engine = TurnEngine(self.adapter, session, clip_seconds=settings.clip_seconds,
                                 max_new_tokens=settings.max_new_tokens)
        self.source = make_source(self.engine.stop)
        self.engine.drop_when_full = self.source.live
        budgets = session.cache.budgets
        self.budget_tokens = max(budgets) if budgets else None
        self.schedule = _LockedSchedule()
        self.waiting: deque[queue.Queue] = deque()  # one per question, in the order asked
        self.current: queue.Queue | None = None
        self.transcript: list[Answer] = []
        self.samples: list[dict] = []
        self.notices: list[str] = []  # things the page should say in the chat (a source that failed)
        self.notice_log: list[str] = []  # all of them, for API clients
        self.finished = threading.Event()
        self.closing = False
        self.last_active = time.monotonic()
        self._sample(0.0, "start")
        self.thread = threading.Thread(target=self._run, name="app-session", daemon=True)
        self.thread.start()

    # --- the engine's thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for answer in self.engine.run(self.source, self.schedule, on_clip=self._on_clip, on_token=self._on_token):
                self.transcript.append(answer)
                self._sample(self.engine.video_t, "answer")
                self.current.put(answer)
                self.current = None
        except Exception as err:  # a truncated file, a camera lost: said in the chat, the page keeps working
            self._notice(f"⚠ {self.label}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        finally:
            if self.source.ended:
                self._notice(f"⚠ {self.source.ended}")
            elif self.source.live and not self.closing:
                self._notice(f"⚠ {self.label} stopped delivering frames at {self.engine.video_t:.1f} s")
            for q in [self.current, *self.waiting]:
                if q is not None:
                    q.put(None)  # unanswered: the stream ended first
            self.finished.set()

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        self.notice_log.append(text)

    def _on_clip(self, clip) -> None:
        self._sample(clip.end, "clip")

    def _on_token(self, question: Question, piece: str | None) -> None:
        if piece is None:
            self.current = self.waiting.popleft()
            self.current.put(("start", self.engine.video_t))
        else:
            self.current.put(piece)

    def _sample(self, video_t: float, after: str) -> None:
        s = self.session
        per_token = s.kv_bytes / s.kv_tokens if s.kv_tokens else 0.0
        self.samples.append({
            "video_s": round(video_t, 2), "kv_tokens": s.kv_tokens, "kv_mb": s.kv_bytes / 2**20,
            "full_tokens": s.seen, "full_mb": s.seen * per_token / 2**20, "rss_mb": rss_mb(),
            "torch_mb": torch_mb(), "budget_tokens": self.budget_tokens, "after": after})

    # --- page events ---------------------------------------------------------------------------

    def ask(self, text: str) -> queue.Queue:
        """Queue a question for the next turn boundary; its queue gets ("start", video_t), text
        pieces, then the `Answer` (or None if the stream ended first)."""
        self.last_active = time.monotonic()
        out: queue.Queue = queue.Queue()
        if self.finished.is_set():
            out.put(None)
            return out
        with self.schedule.lock:  # the order asked is the order answered
            self.waiting.append(out)
            Schedule.add(self.schedule, Question(text))
        self.engine.wake()
        return out

    def telemetry(self) -> dict:
        t, last = self.engine.telemetry, self.transcript[-1] if self.transcript else None
        return {"video_s": round(self.engine.video_t, 2), "clips": t.clips, "dropped": t.dropped,
                "ingest_speed": round(t.ingest_speed, 2) if t.ingest_s else None,
                "ttft_s": last.ttft_s if last else None, "tokens_per_s": last.tokens_per_s if last else None,
                "answers": len(self.transcript), "finished": self.finished.is_set(), "notices": list(self.notice_log)}

    def close(self) -> None:
        """Stop ingest and the model thread; the cache goes with this object."""
        self.closing = True
        self.engine.close()
        self.thread.join(timeout=10)
        if not self.thread.is_alive():  # Gradio may hold a closed tab's state for an hour: let the cache go now
            if self.session is not None:
                self.session.close()  # its room in the pool is free for the next tab
            self.session = self.engine.session = None
