"""The sessions one server process holds: opened from a request's settings and source, found by an unguessable id,
closed on request or when idle. Errors are `Refused` with the HTTP status they answer with."""

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from inf_mllm.pool import PoolFull
from streaming.hosted import BadInput, HostedSession, Settings
from streaming.pushed import PushedFrames
from streaming.sources import SourceError, open_source

from .limits import ServerConfig

URL_SCHEMES = ("rtsp", "rtsps", "http", "https")


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
    if not name or path.is_absolute() or ".." in path.parts or "\x00" in name:
        raise Refused(403, f"{name!r}: a file must be named by its path inside the media folder, without '..'")
    root = root.resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise Refused(403, f"{name!r} leads outside the media folder")
    if not full.is_file():
        raise Refused(404, f"{name!r}: no such file in the media folder")
    return full


def stream_url(url: str) -> str:
    scheme = urlparse(url).scheme.lower()
    if scheme not in URL_SCHEMES:
        raise Refused(400, f"{url!r}: a source URL must be {', '.join(URL_SCHEMES)}")
    return url


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
    def __init__(self, config: ServerConfig):
        self.config = config
        self._open: dict[str, Hosted] = {}
        self._lock = threading.Lock()
        self._opening = 0

    def __len__(self) -> int:
        return len(self._open)

    def all(self) -> list[Hosted]:
        with self._lock:
            return list(self._open.values())

    def open(self, settings: Settings, source: dict | None) -> Hosted:
        """A new session (blocking: the system prompt's prefill); 429 past `max_sessions` or the pool's memory."""
        with self._lock:
            if len(self._open) + self._opening >= self.config.max_sessions:
                raise Refused(429, f"this server holds {self.config.max_sessions} sessions at most; close one or "
                                   "retry later", retry_after=5)
            self._opening += 1
        try:
            try:
                make, label, described = self._source(settings, source or {})
                live = HostedSession(settings, make, label, answers_after_end=True)
            except BadInput as err:
                if isinstance(err.__cause__, PoolFull):
                    raise Refused(429, str(err), retry_after=5) from None
                raise Refused(400, str(err)) from None
            except SourceError as err:  # the media folder's own path is the server's business
                why = str(err).strip().splitlines()[0]
                if self.config.media is not None:
                    why = why.replace(f"{self.config.media.resolve()}/", "")
                raise Refused(400, why) from None
            hosted = Hosted(secrets.token_urlsafe(18), live, live.source if described["kind"] == "push" else None,
                            described, time.time())
            with self._lock:
                self._open[hosted.id] = hosted
            return hosted
        finally:
            with self._lock:
                self._opening -= 1

    def _source(self, settings: Settings, source: dict):
        """(make_source(stop), label, what it is) for the request's source: pushed frames by default."""
        kinds = [k for k in ("file", "url") if source.get(k)]
        if len(kinds) > 1:
            raise Refused(400, "a source is a file or a URL, not both")
        realtime, loops = bool(source.get("realtime", True)), int(source.get("loops", 1))
        if kinds == ["file"]:
            path = media_file(self.config.media, str(source["file"]))
            opened = open_source(video=path, fps=settings.fps, realtime=realtime, loops=loops)  # checked now
            return (lambda stop: opened), path.name, {"kind": "file", "file": str(source["file"])}
        if kinds == ["url"]:
            url = stream_url(str(source["url"]))
            return ((lambda stop: open_source(url=url, fps=settings.fps, realtime=realtime)), url,
                    {"kind": "url", "url": url})
        return (lambda stop: PushedFrames(stop)), "pushed frames", {"kind": "push"}

    def get(self, session_id: str) -> Hosted:
        with self._lock:
            hosted = self._open.get(session_id)
        if hosted is None:
            raise Refused(404, "no such session: unknown, or closed")
        hosted.touch()
        return hosted

    def close(self, session_id: str) -> Hosted:
        with self._lock:
            hosted = self._open.pop(session_id, None)
        if hosted is None:
            raise Refused(404, "no such session: unknown, or closed")
        hosted.live.close()
        return hosted

    def idle(self) -> list[str]:
        """Ids of sessions no request has touched for `idle_s`."""
        now = time.monotonic()
        return [h.id for h in self.all() if now - h.live.last_active > self.config.idle_s]

    def questions_in_flight(self) -> int:
        return sum(h.live.in_flight for h in self.all())

    def close_all(self) -> None:
        for hosted in self.all():
            self.close(hosted.id)
