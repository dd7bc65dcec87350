"""What one server process takes at most, and where it may read files from."""

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerConfig:
    media: Path | None = None  # the folder sessions may pull files from (None: no files)
    sessions: Path | None = None  # each session's folder goes here, to continue it after a crash (None: memory only)
    token: str | None = None  # a bearer token every /v1 request and /metrics must carry (None: open)
    max_sessions: int = 8  # open sessions; one more is refused with 429
    max_questions: int = 16  # questions asked and not yet answered, all sessions together
    max_upload_mb: float = 32.0  # one frame or one chunk of video
    push_wait_s: float = 5.0  # how long a pushed frame waits for room before 429
    idle_s: float = 600.0  # a session no request touched for this long is closed
    sse_batch_ms: float = 0.0  # an answer's tokens after its first, this close together, go out as one SSE chunk
    replica: str | None = None  # this process's name among a deployment's replicas (Ray Serve), in each state
    preload: tuple[str, ...] = field(default_factory=lambda: ("tiny-vlm",))  # models loaded before serving
    allow_url_hosts: tuple[str, ...] = ()  # source URL hosts opened whatever they resolve to (a camera on the LAN)
    allow_private_urls: bool = False  # source URLs may resolve to private and link-local addresses (not loopback)
    max_session_questions: int = 4  # one session's questions waiting (for video time, or a turn) at once
    max_json_kb: float = 64.0  # a JSON request body
    max_headers: int = 100  # headers in one request; their total size is capped by the HTTP parser (64 KB)

    @property
    def url_policy(self):
        from streaming.urls import UrlPolicy

        return UrlPolicy(allow_hosts=frozenset(h.lower() for h in self.allow_url_hosts),
                         allow_private=self.allow_private_urls)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)
