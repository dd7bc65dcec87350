"""What one server process takes at most, and where it may read files from."""

from dataclasses import dataclass, field, fields
from pathlib import Path

from streaming.settings import IDLE_CLOSE_S


@dataclass
class ServerConfig:
    media: Path | None = None  # the folder sessions may pull files from (None: no files)
    sessions: Path | None = None  # each session's folder goes here, to continue it after a crash (None: memory only)
    token: str | None = None  # a bearer token every /v1 request and /metrics must carry (None: open)
    max_sessions: int = 8  # open sessions; one more is refused with 429
    max_questions: int = 16  # questions asked and not yet answered, all sessions together
    max_upload_mb: float = 32.0  # one frame or one chunk of video
    push_wait_s: float = 5.0  # how long a pushed frame waits for room before 429
    idle_s: float = IDLE_CLOSE_S  # a session no request touched for this long is closed
    sse_batch_ms: float = 0.0  # an answer's tokens after its first, this close together, go out as one SSE chunk
    replica: str | None = None  # this process's name among a deployment's replicas (Ray Serve), in each state
    preload: tuple[str, ...] = field(default_factory=lambda: ("tiny-vlm",))  # models loaded before serving
    allow_url_hosts: tuple[str, ...] = ()  # source URL hosts opened whatever they resolve to (a camera on the LAN)
    allow_private_urls: bool = False  # source URLs may resolve to private and link-local addresses (not loopback)
    max_session_questions: int = 4  # one session's questions waiting (for video time, or a turn) at once
    max_json_kb: float = 64.0  # a JSON request body
    max_headers: int = 100  # headers in one request; their total size is capped by the HTTP parser (64 KB)
    realtime_fps: float = 60.0  # frames one Realtime connection may send a second
    webhooks: tuple[str, ...] = ()  # every session's alerts POSTed here (under `url_policy`)
    mqtt: str | None = None  # every session's alerts published to this broker (under `url_policy`)

    POSITIVE = ("max_sessions", "max_questions", "max_session_questions", "max_upload_mb", "idle_s", "max_json_kb",
                "max_headers", "realtime_fps")

    @classmethod
    def parse(cls, values: dict) -> "ServerConfig":
        """The one reading of a server's settings, from whatever gives them (`python -m serve`'s options; a Ray
        deployment's arguments, strings as a YAML file or `serve run k=v` gives them): each coerced to its field's
        type, the counts and sizes above 0; a name it does not know, or a value it cannot read, is a one-line
        `ValueError`."""
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"unknown server settings: {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(sorted(known))}")
        out = {key: _coerce(key, known[key], value) for key, value in values.items()}
        for key in cls.POSITIVE:
            if key in out and not out[key] > 0:
                raise ValueError(f"{key} must be above 0, got {out[key]:g}")
        return cls(**out)

    @property
    def url_policy(self):
        from streaming.urls import UrlPolicy

        return UrlPolicy(allow_hosts=frozenset(h.lower() for h in self.allow_url_hosts),
                         allow_private=self.allow_private_urls)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)

    @property
    def max_message_bytes(self) -> int:
        """A WebSocket message: a frame at the upload limit as base64 in its event (4/3 of it), and room."""
        return self.max_upload_bytes * 4 // 3 + 64 * 1024


def _coerce(key: str, kind: str, value):
    """A setting's value as its field's type (`kind`: the annotation as written, the module's annotations being
    strings or types alike)."""
    kind = getattr(kind, "__name__", None) or str(kind)
    try:
        if "Path" in kind:
            return Path(value).expanduser() if value else None
        if kind.startswith("tuple"):
            return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
        if kind == "bool":
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if kind in ("int", "float"):
            number = {"int": int, "float": float}[kind](value)
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError
            return number
        return value or None  # the token
    except (TypeError, ValueError):
        raise ValueError(f"{key}: cannot read {value!r} as {kind}") from None
