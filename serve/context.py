"""What every route shares: the server's settings, its sessions and metrics, and the lookups the routes repeat
(a session by id, an upload's body within its limits, a session's state as the API shows it)."""

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from .limits import ServerConfig
from .metrics import Metrics
from .sessions import Refused, Sessions


@dataclass
class Server:
    config: ServerConfig
    sessions: Sessions
    metrics: Metrics
    # awaited whenever this process serves a request of a session: how Ray Serve's multiplexing learns which
    # replica holds it (serve/ray_app.py)
    held: Callable[[str], Awaitable] | None = None
    realtime: dict = field(default_factory=dict)  # session id → its Realtime connection (one at a time)

    @property
    def host(self):
        """The models this server serves, each with its pool (streaming.hosted.Host)."""
        return self.sessions.host

    async def find(self, session_id: str):
        """The session; one this process does not hold is continued from its folder, off the event loop."""
        hosted = self.sessions.held(session_id)
        if hosted is None:
            hosted = await run_in_threadpool(self.sessions.get, session_id)
        if self.held is not None:
            await self.held(session_id)
        return hosted

    def state(self, hosted) -> dict:
        live = hosted.live
        return {"id": hosted.id, "replica": self.config.replica, "settings": live.settings.as_dict(),
                "source": hosted.source, "budget_tokens": live.budget_tokens, "telemetry": live.telemetry(),
                "memory": live.samples[-1] if live.samples else None, "ended": live.source_ended.is_set(),
                "frames_pushed": hosted.pushed.pushed if hosted.pushed else None}

    async def body(self, request: Request, types: tuple[str, ...]) -> bytes:
        """An upload of one of `types`, read within the size limit (declared and streamed)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in types:
            raise Refused(415, f"content type {kind or 'none'!r} is not accepted here; send {', '.join(types)}")
        limit, mb = self.config.max_upload_bytes, self.config.max_upload_mb
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Refused(413, f"upload of {int(declared) / 2**20:.1f} MB; the limit is {mb:g} MB")
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > limit:
                    raise Refused(413, f"upload over the limit of {mb:g} MB")
        except ClientDisconnect:
            raise Refused(400, "the upload ended before its declared length") from None
        if declared is not None and declared.isdigit() and len(data) < int(declared):
            raise Refused(400, "the upload ended before its declared length")
        if not data:
            raise Refused(400, "the upload is empty")
        return bytes(data)


def server(request: Request) -> Server:
    """The route's dependency: the app's `Server`."""
    return request.app.state.server


async def authorised(request: Request) -> None:
    """The bearer token, when the server has one (every /v1 route and /metrics)."""
    if not token_accepted(request.app.state.server.config.token, request.headers.get("authorization", "")):
        raise Refused(401, "a bearer token is required (Authorization: Bearer …)")


def token_accepted(token: str | None, given: str) -> bool:
    """Whether an `Authorization` header carries the server's token (any, when it has none)."""
    return token is None or (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(),
                                                                                     token.encode()))


SERVER = Depends(server)
AUTHORISED = [Depends(authorised)]
