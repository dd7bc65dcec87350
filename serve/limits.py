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

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)
