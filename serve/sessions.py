"""The sessions one server process holds: opened from a request's settings and source, found by an unguessable id,
closed on request or when idle. Errors are `Refused` with the HTTP status they answer with."""

import json
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inf_mllm.admission import PoolFull
from streaming.errors import ConfigError
from streaming.hosted import BadInput, HostedSession, Settings
from streaming.memory import trim_heap
from streaming.pushed import PushedFrames
from streaming.session_dir import SETTINGS, SessionDir
from streaming.source_spec import SourceSpec
from streaming.sources import SourceError
from streaming.urls import UrlRefused

from .events import Broadcast
from .limits import ServerConfig

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")  # what `secrets.token_urlsafe` gives: nothing a path could use
CLOSED = "closed"  # in a session's folder: closed by its client, never resumed


class Refused(Exception):
    """A request the server answers with `status` and one line; `retry_after` seconds for 429 and 503."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def media_file(root: Path | None, name: str) -> Path:
    """`name` inside the media folder, or why not: nothing outside it is ever opened, links included."""
    if root is None:
        raise Refused(403, "this server pulls no files: it was started without --media DIR")
    path = Path(name)
    if any(len(part.encode()) > 255 for part in path.parts):
        raise Refused(422, "a file name of more than 255 bytes in one part of its path")
    if not name or path.is_absolute() or ".." in path.parts or "\x00" in name:
        raise Refused(403, f"{name!r}: a file must be named by its path inside the media folder, without '..'")
    root = root.resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise Refused(403, f"{name!r} leads outside the media folder")
    if not full.is_file():
        raise Refused(404, f"{name!r}: no such file in the media folder")
    return full




@dataclass
class Hosted:
    """One session as the server knows it."""

    id: str
    live: HostedSession
    pushed: PushedFrames | None  # None: the server pulls its frames (a file, a URL)
    source: dict
    opened: float

    def touch(self) -> None:
        self.live.last_active = time.monotonic()


class Sessions:
    def __init__(self, config: ServerConfig, host, metrics=None):
        self.config, self.host = config, host  # host: the models served (streaming.hosted.Host)
        self.events = Broadcast(metrics)  # every session's clips and alerts, for the whole-server event feeds
        self._open: dict[str, Hosted] = {}
        self._lock = threading.Lock()
        self._opening = 0
        self._resuming = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def count(self) -> int:
        """Sessions held and being opened."""
        with self._lock:
            return len(self._open) + self._opening

    def all(self) -> list[Hosted]:
        with self._lock:
            return list(self._open.values())

    def open(self, settings: Settings, source: dict | None, watches=()) -> Hosted:
        """A new session (blocking: the system prompt's prefill) with its `watches` (words); 429 past
        `max_sessions` or the pool's memory."""
        return self._start(secrets.token_urlsafe(18), settings, source or {}, resume=False, watches=watches)

    def _start(self, session_id: str, settings: Settings, source: dict, resume: bool, watches=()) -> Hosted:
        with self._lock:
            if len(self._open) + self._opening >= self.config.max_sessions:
                raise Refused(429, f"this server holds {self.config.max_sessions} sessions at most; close one or "
                                   "retry later", retry_after=5)
            self._opening += 1
        folder = None
        try:
            try:
                make, label, described = self._source(settings, source)
                if self.config.sessions is not None:
                    folder = SessionDir(self.config.sessions / session_id, resume=resume)
                    if not resume:  # the source as described: a URL's credentials are never written
                        folder.save_settings({"server": settings.as_dict(), "source": source | described})
                try:
                    live = HostedSession(self.host, settings, make, label, answers_after_end=True, folder=folder,
                                         name=session_id, watches=watches)
                except BaseException:
                    if folder is not None and not resume:  # a refused open leaves no folder behind
                        shutil.rmtree(folder.path, ignore_errors=True)
                    raise
            except BadInput as err:
                if isinstance(err.__cause__, PoolFull):
                    raise Refused(429, str(err), retry_after=5) from None
                raise Refused(400, str(err)) from None
            except ConfigError as err:  # the folder is held: another process still has this session
                if folder is None and "one writer at a time" in str(err):
                    raise Refused(503, "this session is held by another server process; retry shortly",
                                  retry_after=1) from None
                raise Refused(400, str(err).strip().splitlines()[0]) from None
            except SourceError as err:  # the media folder's own path is the server's business
                why = str(err).strip().splitlines()[0]
                if self.config.media is not None:
                    why = why.replace(f"{self.config.media.resolve()}/", "")
                raise Refused(400, why) from None
            hosted = Hosted(session_id, live, live.source if described["kind"] == "push" else None,
                            described, time.time())
            live.subscribe(self.events.of(session_id))
            with self._lock:
                self._open[hosted.id] = hosted
            return hosted
        finally:
            with self._lock:
                self._opening -= 1

    def _resume(self, session_id: str) -> Hosted | None:
        """A session this process does not hold, continued from its folder (after a crash, a restart, or on
        another replica); None when there is no such folder, or its client closed it."""
        root = self.config.sessions
        if root is None or not SESSION_ID.fullmatch(session_id):
            return None
        folder = root / session_id
        if not (folder / SETTINGS).is_file() or (folder / CLOSED).exists():
            return None
        with self._resuming:  # one resume at a time: two requests for it must not both take the folder
            with self._lock:
                if session_id in self._open:
                    return self._open[session_id]
            try:
                saved = json.loads((folder / SETTINGS).read_text())
                settings = Settings(**saved["server"])
            except (OSError, ValueError, KeyError, TypeError):
                return None
            return self._start(session_id, settings, saved.get("source") or {}, resume=True)

    def _source(self, settings: Settings, source: dict):
        """(make_source(stop), label, what it is) for the request's source: pushed frames by default."""
        kinds = [k for k in ("file", "url") if source.get(k)]
        if len(kinds) > 1:
            raise Refused(400, "a source is a file or a URL, not both")
        realtime, loops = bool(source.get("realtime", True)), int(source.get("loops", 1))
        policy = self.config.url_policy
        if kinds == ["file"]:
            path = media_file(self.config.media, str(source["file"]))
            spec = SourceSpec("file", str(path), fps=settings.fps, realtime=realtime, loops=loops)
            opened = spec.open(policy=policy)  # checked now
            return (lambda stop: opened), spec.label, {"kind": "file", "file": str(source["file"])}
        if kinds == ["url"]:  # checked here, and again (with the redirect and playlist checks) as it opens
            spec = SourceSpec("url", str(source["url"]), fps=settings.fps, realtime=realtime)
            try:
                policy.check(spec.target)
            except UrlRefused as err:
                raise Refused(400, str(err)) from None
            return ((lambda stop: spec.open(stop, policy)), spec.label,
                    {"kind": "url", "url": spec.label})  # credentials stay in memory
        spec = SourceSpec("push", fps=settings.fps)
        return (lambda stop: spec.open(stop, policy)), spec.label, {"kind": "push"}

    def held(self, session_id: str) -> Hosted | None:
        """The session if this process holds it (never blocks)."""
        with self._lock:
            hosted = self._open.get(session_id)
        if hosted is not None:
            hosted.touch()
        return hosted

    def get(self, session_id: str) -> Hosted:
        """The session, continued from its folder if this process does not hold it (blocking then)."""
        with self._lock:
            hosted = self._open.get(session_id)
        if hosted is None:
            hosted = self._resume(session_id)
        if hosted is None:
            raise Refused(404, "no such session: unknown, or closed")
        hosted.touch()
        return hosted

    def close(self, session_id: str, final: bool = True) -> Hosted:
        """Close a session; `final` (its client's DELETE) marks its folder closed, else (idle, shutdown) it can be
        continued by its next request."""
        with self._lock:
            hosted = self._open.pop(session_id, None)
        if hosted is None and final and self._resume(session_id) is not None:  # closed where another process held it
            with self._lock:
                hosted = self._open.pop(session_id, None)
        if hosted is None:
            raise Refused(404, "no such session: unknown, or closed")
        if final and self.config.sessions is not None:
            (self.config.sessions / session_id / CLOSED).touch()
        hosted.live.close()
        trim_heap()  # the session's cache is freed: give its pages back, or each session closed leaves RSS behind
        return hosted

    def idle(self) -> list[str]:
        """Ids of sessions no request has touched for `idle_s`."""
        now = time.monotonic()
        return [h.id for h in self.all() if now - h.live.last_active > self.config.idle_s]

    def questions_in_flight(self) -> int:
        """Questions due and not yet answered, all sessions together; one waiting for video it has not been sent
        counts against its own session only (`max_session_questions`), so one client cannot take the server's."""
        return sum(h.live.in_flight - h.live.waiting_for_video for h in self.all())

    def close_all(self) -> None:
        """At shutdown: every session closed, its folder left to be continued."""
        for hosted in self.all():
            self.close(hosted.id, final=False)
