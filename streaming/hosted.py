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
from models import load_adapter, runs_here

from .engine import Answer
from .errors import one_line
from .live import LiveSession
from .memory import auto_budget
from .open import StreamConfig, open_stream
from .settings import BadInput, Settings, unknown_model  # noqa: F401  (their one home; products import them here too)
from .watches import session_watches

ANSWER_FIELDS = set(Answer.__dataclass_fields__)


class Host:
    """The models one process serves (the app, the server, a Ray replica): each loaded once on first use, with one
    session pool whose caches fit in the memory free when it opened (the `--budget auto` probe's figure);
    `max_streams`, the most streams a pool admits (the server's --max-sessions, so one number caps its sessions)."""

    def __init__(self, max_streams: int = 64):
        self.models: list[str] = runs_here()  # the models that load with no folder; `add_checkpoint` adds more
        self.checkpoints: dict[str, str] = {}  # model name in the list -> transformers checkpoint folder
        self.max_streams = max_streams
        self._adapters: dict[str, object] = {}
        self._pools: dict[str, SessionPool] = {}
        self._lock = threading.Lock()

    def check(self, name: str) -> None:
        """A model this host offers, or one line (`BadInput`)."""
        if (why := unknown_model(name, self.models)) is not None:
            raise BadInput(why)

    def adapter(self, name: str):
        """The model's adapter, loaded once; each session forks its own stream state from it."""
        self.check(name)
        with self._lock:
            if name not in self._adapters:
                folder = self.checkpoints.get(name)
                self._adapters[name] = load_adapter("hf", folder) if folder else load_adapter(name)
            return self._adapters[name]

    def pool(self, name: str) -> SessionPool:
        """The model's one session pool: every session on it."""
        adapter = self.adapter(name)
        with self._lock:
            if name not in self._pools:
                free = auto_budget(None, str(adapter.device))
                self._pools[name] = SessionPool(adapter.model, adapter.tokenizer, unbounded=True,  # "full": compared
                                                kv_bytes=max(0, free.free_bytes - free.reserve_bytes),
                                                max_streams=self.max_streams)
            return self._pools[name]

    def limit_streams(self, count: int) -> None:
        """The most streams a pool admits, for pools opened from now on and those open."""
        with self._lock:
            self.max_streams = count
            for pool in self._pools.values():
                pool.admission.max_streams = count

    def streams_held(self) -> int:
        """Streams holding room in this host's pools: a session closed is counted out once its model thread ended."""
        with self._lock:
            pools = list(self._pools.values())
        return sum(len(pool.admission.streams) for pool in pools)

    def add_checkpoint(self, folder: str) -> str:
        """Offer a transformers checkpoint folder in the model list as "hf:NAME". Loaded now: a folder that cannot
        work fails at start-up, in one line, not in a user's session."""
        name = f"hf:{Path(folder).expanduser().resolve().name}"
        if name not in self.models:
            with self._lock:
                self._adapters[name] = load_adapter("hf", folder)
            self.checkpoints[name] = folder
            self.models.append(name)
        return name


class HostedSession(LiveSession):
    """A viewer's or client's live session on its model's pool in `host`, opened from its settings. With a session
    `folder` (streaming/session_dir.py) its clips are stored there and every answer is written there before it is
    handed over, and a folder opened to resume continues the session after its last stored clip."""

    def __init__(self, host: Host, settings: Settings, make_source, label: str, answers_after_end: bool = False,
                 folder=None, name: str = "", watches=(), snapshots=None):
        """`name`: the session's id (its alerts' ids are made of it); `watches`: standing conditions in words, judged
        on every clip (more may be added while it runs: `self.watches`); `snapshots`: the folder of its alerts' frames
        without a session folder (the app's)."""
        self.settings, self.folder = settings, folder
        resume_at, before = (0, 0.0), []

        def restore(session):  # a session continued from its folder: its exchanges put back
            nonlocal resume_at, before
            resume_at = folder.resume_point(session.store)
            session.restore(folder.exchanges())
            before = [Answer(**{k: v for k, v in row.items() if k in ANSWER_FIELDS}) for row in folder.answered()]

        try:
            stream = open_stream(StreamConfig(settings), None, host.pool(settings.model), host.adapter(settings.model),
                                 folder,
                                 prepare=restore if folder is not None and folder.resume else None)
        except ValueError as err:  # too small a budget, a bad window, no room in the pool: as stream-qa says it
            if folder is not None:
                folder.close(folder.store)
            raise BadInput(one_line(err).removeprefix("--")) from err
        try:
            self.watches = stream.engine.watches = session_watches(name or label, watches, folder, resume_at[0],
                                                                   snapshots=snapshots)
        except ValueError as err:
            stream.session.close()
            if folder is not None:
                folder.close(folder.store)
            raise BadInput(one_line(err)) from None
        try:
            super().__init__(stream.adapter, stream.session, make_source, label, answers_after_end=answers_after_end,
                             resume_at=resume_at, transcript=before, engine=stream.engine)
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
            self.folder.write_clip(self.engine.seen)  # its words, counts and boxes, in clips.jsonl
        super()._on_clip(clip)

    def _free(self) -> None:
        with self._freeing:
            store = self.session.store if self.session is not None else None
            super()._free()
            if self.folder is not None:
                self.folder.close(store)  # released for the next writer (another process, after a restart)
                self.folder = None
