"""The HTTP API: open a session, push frames or video (or have the server pull a file or URL), ask questions with
answers streamed as server-sent events, read telemetry and the transcript, close. OpenAPI docs at /docs.

Every error is JSON, {"error": "one line"}, with its status: 400 bad input, 401 no or wrong token, 403 a file
outside the media folder, 404 an unknown or closed session, 409 a session that takes no pushed frames, 413 too
large an upload, 415 a wrong content type, 422 a field out of range, 429 (with Retry-After) past a limit.
"""

import asyncio
import contextlib
import json
import secrets
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from streaming.hosted import MODELS, Settings, shared_pool
from streaming.sources import FileSource, SourceError

from .guards import FrameRefused, RequestLimits, decode_frame
from .limits import ServerConfig
from .metrics import CONTENT_TYPE, Metrics
from .sessions import Refused, Sessions

IMAGE_TYPES = ("image/jpeg", "image/png")
UNANSWERED = "the stream ended before this question's turn"
VIDEO_TYPES = ("video/mp4", "video/webm", "video/x-matroska", "video/quicktime", "video/x-msvideo",
               "application/octet-stream")


STRICT = ConfigDict(extra="forbid")  # a misspelt field is refused with the known ones, never silently defaulted


class SourceSpec(BaseModel):
    model_config = STRICT
    file: str | None = Field(None, max_length=1024, description="a file inside the server's media folder")
    url: str | None = Field(None, max_length=2048, description="an RTSP or HTTP(S) stream on an allowed host")
    realtime: bool = Field(True, description="play a file at its own speed (false: as fast as the model takes it)")
    loops: int = Field(1, ge=1, le=1000)


class OpenRequest(BaseModel):
    model_config = STRICT
    model: str = Field("tiny-vlm", max_length=200)
    policy: str = Field("inf_mllm+recall", max_length=200, description="as stream-qa --policy")
    budget: str = Field("256", max_length=32, description="as stream-qa --budget: tokens a layer, or a size: 64MB")
    bias: float | None = Field(None, allow_inf_nan=False)
    window: int | None = Field(None, ge=1, le=1_000_000)
    fps: float = Field(1.0, gt=0, le=30, allow_inf_nan=False)
    clip_seconds: float = Field(2.0, gt=0, le=600, allow_inf_nan=False)
    max_new_tokens: int = Field(16, ge=1, le=512)
    source: SourceSpec | None = Field(None, description="none: the client pushes frames")


class AskRequest(BaseModel):
    model_config = STRICT
    text: str = Field(min_length=1, max_length=2000)
    at: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False,
                             description="answer at this video time (seconds), as '… @30s'")
    stream: bool = Field(True, description="server-sent events (start, token…, answer); false: the record as JSON")


MODELS_OF = {"source": SourceSpec, "": OpenRequest}  # where an unknown field sits → the model it does not belong to
WAITING_EVERY_S = 5.0  # a question waiting for video says so this often


def error(status: int, message: str, retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": f"{max(1, round(retry_after))}"} if retry_after is not None else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:300] if lines else ""


class _ToLoop:
    """A thread's `put` handed to an asyncio queue on the server's loop (a live session's answer events)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _sse(event: str, data) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def create_app(config: ServerConfig | None = None, held=None) -> FastAPI:
    """`held(session_id)`, awaited whenever this process serves a request of a session: how Ray Serve's
    multiplexing learns which replica holds it (serve/ray_app.py)."""
    config = config or ServerConfig()
    sessions, metrics = Sessions(config), Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for name in config.preload:  # loaded before the first request: a session opens in its prefill's time
            await run_in_threadpool(shared_pool, name)
        sweeper = asyncio.create_task(_sweep())
        yield
        sweeper.cancel()
        await run_in_threadpool(sessions.close_all)

    async def _sweep():
        while True:
            await asyncio.sleep(min(5.0, config.idle_s))
            for session_id in sessions.idle():
                with contextlib.suppress(Refused):
                    await run_in_threadpool(sessions.close, session_id, False)

    app = FastAPI(title="stream-qa server", lifespan=lifespan, version="1",
                  description="Questions about live video, answered from a bounded KV cache (Inf-MLLM).")
    app.state.sessions, app.state.metrics, app.state.config = sessions, metrics, config
    app.add_middleware(RequestLimits, max_json_bytes=int(config.max_json_kb * 1024), max_headers=config.max_headers)

    @app.exception_handler(Refused)
    async def _refused(request, err: Refused):
        if err.status == 429:
            metrics.refused.labels(request.url.path.rsplit("/", 1)[-1] or "root").inc()
        return error(err.status, err.message, err.retry_after)

    @app.exception_handler(HTTPException)
    async def _http(request, err: HTTPException):
        return error(err.status_code, one_line(err.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        errors = err.errors()
        first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0] if errors else {})
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {one_line(first.get('ctx', {}).get('error', 'cannot be read'))}")
        path = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(path) or "request"
        if first.get("type") == "extra_forbidden":
            model = AskRequest if request.url.path.endswith("/questions") else MODELS_OF.get(".".join(path[:-1]))
            known = ", ".join(model.model_fields) if model else "see /docs"
            return error(422, f"{where}: unknown field; known fields: {known}")
        return error(422, f"{where}: {one_line(first.get('msg', 'invalid'))}")

    @app.exception_handler(Exception)
    async def _bug(request, err: Exception):
        traceback.print_exception(err, file=sys.stderr)  # the server's log has it; the client gets one line
        return error(500, f"internal error ({type(err).__name__}); the server's log has the details")

    async def authorised(request: Request) -> None:
        if config.token is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), config.token.encode())):
            raise Refused(401, "a bearer token is required (Authorization: Bearer …)")

    async def body(request: Request, types: tuple[str, ...]) -> bytes:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in types:
            raise Refused(415, f"content type {kind or 'none'!r} is not accepted here; send {', '.join(types)}")
        limit = config.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Refused(413, f"upload of {int(declared) / 2**20:.1f} MB; the limit is {config.max_upload_mb:g} MB")
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > limit:
                    raise Refused(413, f"upload over the limit of {config.max_upload_mb:g} MB")
        except ClientDisconnect:
            raise Refused(400, "the upload ended before its declared length") from None
        if declared is not None and declared.isdigit() and len(data) < int(declared):
            raise Refused(400, "the upload ended before its declared length")
        if not data:
            raise Refused(400, "the upload is empty")
        return bytes(data)

    async def find(session_id: str):
        """The session; one this process does not hold is continued from its folder, off the event loop."""
        hosted = sessions.held(session_id)
        if hosted is None:
            hosted = await run_in_threadpool(sessions.get, session_id)
        if held is not None:
            await held(session_id)
        return hosted

    def pushed_to(hosted):
        if hosted.pushed is None:
            raise Refused(409, f"this session pulls its own frames ({hosted.source['kind']}); it takes none pushed")
        return hosted.pushed

    def state(hosted) -> dict:
        live = hosted.live
        return {"id": hosted.id, "replica": config.replica, "settings": live.settings.__dict__, "source": hosted.source,
                "budget_tokens": live.budget_tokens, "telemetry": live.telemetry(),
                "memory": live.samples[-1] if live.samples else None, "ended": live.source_ended.is_set(),
                "frames_pushed": hosted.pushed.pushed if hosted.pushed else None}

    v1 = [Depends(authorised)]

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "sessions": len(sessions), "models": MODELS, "replica": config.replica}

    @app.get("/metrics", dependencies=v1)
    async def prometheus():
        return Response(metrics.render(sessions.all()), media_type=CONTENT_TYPE)

    @app.post("/v1/sessions", status_code=201, dependencies=v1)
    async def open_session(req: OpenRequest):
        settings = Settings(model=req.model, policy=req.policy, budget=req.budget, bias=req.bias,
                            window=req.window, fps=req.fps, clip_seconds=req.clip_seconds,
                            max_new_tokens=req.max_new_tokens)
        if req.model not in MODELS:
            raise Refused(400, f"unknown model {req.model!r}; available: {', '.join(MODELS)}")
        hosted = await run_in_threadpool(sessions.open, settings, req.source.model_dump() if req.source else None)
        if held is not None:
            await held(hosted.id)
        return state(hosted)

    @app.get("/v1/sessions/{session_id}", dependencies=v1)
    async def read_state(session_id: str):
        return state(await find(session_id))

    @app.get("/v1/sessions/{session_id}/transcript", dependencies=v1)
    async def transcript(session_id: str):
        return [a.as_dict() for a in (await find(session_id)).live.transcript]

    @app.delete("/v1/sessions/{session_id}", dependencies=v1)
    def close(session_id: str):
        hosted = sessions.close(session_id)
        return {"closed": hosted.id, "answers": len(hosted.live.transcript)}

    @app.post("/v1/sessions/{session_id}/frames", status_code=202, dependencies=v1)
    async def push_frame(session_id: str, request: Request, t: float):
        pushed = pushed_to(await find(session_id))
        data = await body(request, IMAGE_TYPES)
        skipped = pushed.skipped
        await push(pushed, lambda: decode_image(data), t)  # decoded only if the session's rate keeps it
        return {"frames": pushed.pushed, "t": t, "kept": pushed.skipped == skipped}

    async def push(pushed, rgb, t):
        try:
            took = await run_in_threadpool(pushed.push, rgb, t, config.push_wait_s)
        except SourceError as err:
            raise Refused(409 if pushed.ending else 400, str(err)) from None
        if not took:
            raise Refused(429, "the model is behind this session's frames; retry shortly", retry_after=1)

    @app.post("/v1/sessions/{session_id}/video", status_code=202, dependencies=v1)
    async def push_video(session_id: str, request: Request, start: float | None = None):
        hosted = await find(session_id)
        pushed = pushed_to(hosted)
        data = await body(request, VIDEO_TYPES)
        fps = hosted.live.settings.fps
        if start is None:
            start = 0.0 if pushed.last_t is None else pushed.last_t + 1.0 / fps
        frames = await run_in_threadpool(decode_video, data, fps)
        first = None
        for frame in frames:
            await push(pushed, frame.rgb, start + frame.t)
            first = start + frame.t if first is None else first
        return {"frames": pushed.pushed, "from": first, "to": pushed.last_t}

    @app.post("/v1/sessions/{session_id}/end", status_code=202, dependencies=v1)
    async def end(session_id: str):
        pushed = pushed_to(await find(session_id))
        await run_in_threadpool(pushed.end)
        return {"frames": pushed.pushed, "ended": True}

    @app.post("/v1/sessions/{session_id}/questions", dependencies=v1)
    async def ask(session_id: str, req: AskRequest):
        hosted = await find(session_id)
        live = hosted.live
        if live.in_flight >= config.max_session_questions:
            raise Refused(429, f"this session has {live.in_flight} questions waiting ({config.max_session_questions} "
                               "at most); retry once one is answered", retry_after=1)
        if sessions.questions_in_flight() >= config.max_questions:
            raise Refused(429, f"{config.max_questions} questions are being answered; retry shortly",
                          retry_after=1)
        if live.finished.is_set():
            raise Refused(409, "this session's stream failed; it answers no more questions (see its notices)")
        events = _ToLoop(asyncio.get_running_loop())
        live.ask(req.text, req.at, out=events)

        def waiting() -> bytes:
            """While the video has not reached the question's time: an SSE `waiting` event (now / needed), so a
            client can tell waiting from hanging."""
            now = live.engine.video_t
            if req.at is None or now >= req.at:
                return b""
            return _sse("waiting", {"video_t": round(now, 3), "needed": req.at,
                                    "frames_pushed": hosted.pushed.pushed if hosted.pushed else None})

        def unanswered() -> str:
            now = live.engine.video_t
            if req.at is None or now >= req.at:
                return UNANSWERED
            pushed = f"; {hosted.pushed.pushed} frames pushed" if hosted.pushed else ""
            return f"the stream ended at {now:.1f} s of video, before this question's time ({req.at:g} s){pushed}"

        async def answer_events(batch_s: float):
            """SSE chunks of the answer's events; tokens after the first that come within `batch_s` of each other
            go out as one chunk (each chunk costs a hop through a proxy such as Ray's); `waiting` events at once and
            every few seconds while the question waits for video."""
            loop, pending, deadline, tokens = asyncio.get_running_loop(), b"", None, 0
            getter = asyncio.ensure_future(events.queue.get())  # kept across waits: a timed-out wait loses nothing
            started = False
            try:
                first = waiting()
                if first:
                    yield first
                while True:
                    if not started and deadline is None:
                        done, _ = await asyncio.wait({getter}, timeout=WAITING_EVERY_S)
                        if not done:
                            yield waiting() or b": still working\n\n"
                            continue
                    if deadline is not None:
                        done, _ = await asyncio.wait({getter}, timeout=max(0.0, deadline - loop.time()))
                        if not done:
                            yield pending
                            pending, deadline = b"", None
                            continue
                    item = await getter
                    getter = asyncio.ensure_future(events.queue.get())
                    if item is None:
                        yield pending + _sse("error", {"error": unanswered()})
                        return
                    if isinstance(item, tuple):
                        chunk, started = _sse("start", {"video_t": item[1]}), True
                    elif isinstance(item, str):
                        chunk, tokens = _sse("token", {"text": item}), tokens + 1
                    else:
                        metrics.answered(item, hosted.live.telemetry())
                        yield pending + _sse("answer", item.as_dict())
                        return
                    if isinstance(item, str) and tokens > 1 and batch_s > 0:
                        pending += chunk
                        deadline = deadline if deadline is not None else loop.time() + batch_s
                    else:
                        yield pending + chunk
                        pending, deadline = b"", None
            finally:
                getter.cancel()

        if req.stream:
            return StreamingResponse(answer_events(config.sse_batch_ms / 1e3), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while True:  # the record alone: the start and the tokens are passed over
            item = await events.queue.get()
            if item is None:
                raise Refused(409, unanswered())
            if not isinstance(item, tuple | str):
                metrics.answered(item, hosted.live.telemetry())
                return item.as_dict()

    return app


def decode_image(data: bytes) -> np.ndarray:
    """A pushed frame, its announced size checked before it is decoded (`guards.decode_frame`)."""
    try:
        return decode_frame(data)
    except FrameRefused as err:
        raise Refused(err.status, str(err)) from None


def decode_video(data: bytes, fps: float) -> list:
    """The frames of an uploaded chunk of video, sampled at `fps`, times from the chunk's start."""
    with tempfile.NamedTemporaryFile(suffix=".video") as tmp:
        Path(tmp.name).write_bytes(data)
        try:
            frames = list(FileSource(tmp.name, fps=fps))
        except SourceError as err:
            raise Refused(400, f"the video cannot be read: {one_line(err).replace(tmp.name, 'the upload')}") \
                from None
        except Exception as err:  # a decoder's own failure on damaged bytes
            raise Refused(400, f"the video cannot be read ({type(err).__name__})") from None
    if not frames:
        raise Refused(400, "the video holds no frames")
    return frames
