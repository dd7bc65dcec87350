"""The HTTP API: open a session, push frames or video (or have the server pull a file or URL), ask questions with
answers streamed as server-sent events, read telemetry and the transcript, close. OpenAPI docs at /docs,
served from this machine (docs.py).

Every error is JSON, {"error": "one line"}, with its status: 400 bad input, 401 no or wrong token, 403 a file
outside the media folder, 404 an unknown or closed session, 409 a session that takes no pushed frames, 413 too
large an upload, 415 a wrong content type, 422 a field out of range, 429 (with Retry-After) past a limit.
`create_app` wires the parts: the request limits (`guards.py`), the errors (`errors.py`), the shared state
(`context.py`) and the routers (`routes/`).
"""

import asyncio
import contextlib
import sys

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from streaming.hosted import Host
from streaming.mqtt import Mqtt
from streaming.webhooks import Webhooks

from . import docs, errors
from .context import Server
from .guards import RequestLimits
from .limits import ServerConfig
from .metrics import Metrics
from .routes import ROUTERS
from .sessions import Refused, Sessions


def create_app(config: ServerConfig | None = None, held=None, host: Host | None = None) -> FastAPI:
    """`held(session_id)`, awaited whenever this process serves a request of a session: how Ray Serve's
    multiplexing learns which replica holds it (serve/ray_app.py). `host`: the models served (default: the
    models that load with no folder)."""
    config = config or ServerConfig()
    host = host or Host()
    host.limit_streams(config.max_sessions)  # one cap: the pool admits what the server's count does
    metrics = Metrics()
    srv = Server(config, Sessions(config, host, metrics), metrics, held)
    hooks = Webhooks(config.webhooks, config.url_policy, warn=_warning) if config.webhooks else None
    if hooks is not None:
        srv.sessions.events.add(hooks)
        metrics.webhooks = hooks.counts
    broker = Mqtt(config.mqtt, config.url_policy, warn=_warning) if config.mqtt else None
    if broker is not None:
        srv.sessions.events.add(broker)
        metrics.mqtt = broker.counts

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for name in config.preload:  # loaded before the first request: a session opens in its prefill's time
            await run_in_threadpool(host.pool, name)
        sweeper = asyncio.create_task(_sweep(srv))
        yield
        sweeper.cancel()
        await run_in_threadpool(srv.sessions.close_all)
        for deliverer in (hooks, broker):
            if deliverer is not None:
                await run_in_threadpool(deliverer.close)

    app = FastAPI(title="stream-qa server", lifespan=lifespan, version="1", docs_url=None, redoc_url=None,
                  description="Questions about live video, answered from a bounded KV cache (Inf-MLLM).")
    app.state.server, app.state.sessions = srv, srv.sessions
    app.add_middleware(RequestLimits, max_json_bytes=int(config.max_json_kb * 1024), max_headers=config.max_headers,
                       json_paths={"/v1/chat/completions": config.max_upload_bytes})
    errors.install(app, srv.metrics)
    docs.install(app)  # FastAPI's own /docs and /redoc load their scripts from CDNs
    for router in ROUTERS:
        app.include_router(router)
    return app


def _warning(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


async def _sweep(srv: Server) -> None:
    """Sessions idle past `idle_s` are closed (their folders kept)."""
    while True:
        await asyncio.sleep(min(5.0, srv.config.idle_s))
        for session_id in srv.sessions.idle():
            with contextlib.suppress(Refused):
                await run_in_threadpool(srv.sessions.close, session_id, False)
