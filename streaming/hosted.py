"""The models a long-running process serves (the app, the HTTP server): each loaded once, with one session pool,
and the live sessions its viewers or clients open on it.

Every session is a stream of its model's pool (inf_mllm/pool.py): its clip turns and questions run on the pool's
thread, and the answers of all sessions decoding at once go through the model together, so one viewer's answer
keeps streaming while another's clip goes in. A session the pool's memory cannot hold is refused when it opens,
in one line (`BadInput`).
"""

import threading
from pathlib import Path

from inf_mllm.pool import SessionPool
from inf_mllm.spec import Recall
from models import load_adapter, runs_here

from .budgets import headroom, open_session
from .checks import one_line
from .engine import Answer
from .live import LiveSession
from .memory import auto_budget
from .settings import BadInput, Settings  # noqa: F401  (their one home; the products import them from here too)

ANSWER_FIELDS = set(Answer.__dataclass_fields__)
MODELS = runs_here()  # the models that load with no folder (models.ADAPTERS); `python -m app --hf DIR` adds checkpoints
CHECKPOINTS: dict[str, str] = {}  # model name in the list → transformers checkpoint folder (`--model hf`)
_adapters: dict[str, object] = {}
_pools: dict[str, SessionPool] = {}
_adapters_lock = threading.Lock()
_max_streams = 64  # streams a model's pool admits: the server sets its --max-sessions here (`limit_streams`)


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
                                       kv_bytes=max(0, free.free_bytes - free.reserve_bytes),
                                       max_streams=_max_streams)
        return _pools[name]


def limit_streams(count: int) -> None:
    """The most streams a model's pool admits, for pools opened from now on and those open: the server's
    `max_sessions`, so one number caps a server's sessions (the pool refuses past it what the server's count does)."""
    global _max_streams
    with _adapters_lock:
        _max_streams = count
        for pool in _pools.values():
            pool.admission.max_streams = count


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


class HostedSession(LiveSession):
    """A viewer's or client's live session on its model's shared pool, opened from its settings. With a session
    `folder` (streaming/session_dir.py) its clips are stored there and every answer is written there before it is
    handed over, and a folder opened to resume continues the session after its last stored clip."""

    def __init__(self, settings: Settings, make_source, label: str, answers_after_end: bool = False, folder=None):
        self.settings, self.folder = settings, folder
        spec, budget = settings.spec(), settings.budget_value()
        if folder is not None and spec.recall is None:
            spec = spec.with_recall(Recall())  # a folder's session is its store
        adapter = shared_adapter(settings.model).fork()
        pool = shared_pool(settings.model)
        extra = {"store": folder.open_store()} if folder is not None else {}
        resume_at, before = (0, 0.0), []
        def restore(session):  # a session continued from its folder: its exchanges put back
            nonlocal resume_at, before
            resume_at = folder.resume_point(session.store)
            session.restore(folder.exchanges())
            before = [Answer(**{k: v for k, v in row.items() if k in ANSWER_FIELDS}) for row in folder.answered()]

        try:
            session = pool.open(make=lambda: open_session(adapter, spec, budget, settings.max_new_tokens, **extra)[0],
                                headroom=headroom(adapter, settings.max_new_tokens),
                                prepare=restore if folder is not None and folder.resume else None)
        except ValueError as err:  # too small a budget, a bad window, no room in the pool: as stream-qa says it
            if folder is not None:
                folder.close(folder.store)
            raise BadInput(one_line(err).removeprefix("--")) from err
        try:
            super().__init__(adapter, session, make_source, label, clip_seconds=settings.clip_seconds,
                             max_new_tokens=settings.max_new_tokens, answers_after_end=answers_after_end,
                             resume_at=resume_at, transcript=before)
        except BaseException:
            if folder is not None:
                folder.close(folder.store)
            raise

    def _answered(self, answer) -> None:
        if self.folder is not None:
            self.folder.write_answer(answer)  # on disk before the client has it
        super()._answered(answer)

    def _on_clip(self, clip) -> None:
        if self.folder is not None and self.engine.log:
            self.folder.write_clip(self.engine.log[-1])  # its words, counts and boxes, in clips.jsonl
        super()._on_clip(clip)

    def close(self) -> None:
        store = self.session.store if self.session is not None else None
        super().close()
        if self.folder is not None:
            self.folder.close(store)  # released for the next writer (another process, after a restart)
            self.folder = None
