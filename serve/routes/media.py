"""What a client sends a pushed-frames session: frames (JPEG, PNG), chunks of video, and the stream's end."""

import tempfile
from pathlib import Path

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from streaming.errors import one_line
from streaming.sources import FileSource, SourceError

from ..context import AUTHORISED, SERVER, Server
from ..guards import FrameRefused, decode_frame
from ..sessions import Refused

IMAGE_TYPES = ("image/jpeg", "image/png")
VIDEO_TYPES = ("video/mp4", "video/webm", "video/x-matroska", "video/quicktime", "video/x-msvideo",
               "application/octet-stream")

router = APIRouter(prefix="/v1/sessions/{session_id}", dependencies=AUTHORISED)


def pushed_to(hosted):
    if hosted.pushed is None:
        raise Refused(409, f"this session pulls its own frames ({hosted.source['kind']}); it takes none pushed")
    return hosted.pushed


async def push(srv: Server, pushed, rgb, t: float) -> None:
    try:
        took = await run_in_threadpool(pushed.push, rgb, t, srv.config.push_wait_s)
    except SourceError as err:
        raise Refused(409 if pushed.ending else 400, str(err)) from None
    if not took:
        raise Refused(429, "the model is behind this session's frames; retry shortly", retry_after=1)


@router.post("/frames", status_code=202)
async def push_frame(session_id: str, request: Request, t: float, srv: Server = SERVER):
    pushed = pushed_to(await srv.find(session_id))
    data = await srv.body(request, IMAGE_TYPES)
    skipped = pushed.skipped
    await push(srv, pushed, lambda: decode_image(data), t)  # decoded only if the session's rate keeps it
    return {"frames": pushed.pushed, "t": t, "kept": pushed.skipped == skipped}


@router.post("/video", status_code=202)
async def push_video(session_id: str, request: Request, start: float | None = None, srv: Server = SERVER):
    hosted = await srv.find(session_id)
    pushed = pushed_to(hosted)
    data = await srv.body(request, VIDEO_TYPES)
    fps = hosted.live.settings.fps
    if start is None:
        start = 0.0 if pushed.last_t is None else pushed.last_t + 1.0 / fps
    frames = await run_in_threadpool(decode_video, data, fps)
    for frame in frames:
        await push(srv, pushed, frame.rgb, start + frame.t)
    return {"frames": pushed.pushed, "from": start + frames[0].t, "to": pushed.last_t}


@router.post("/end", status_code=202)
async def end(session_id: str, srv: Server = SERVER):
    pushed = pushed_to(await srv.find(session_id))
    await run_in_threadpool(pushed.end)
    return {"frames": pushed.pushed, "ended": True}


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
            raise Refused(400, f"the video cannot be read: {one_line(err)[:300].replace(tmp.name, 'the upload')}") \
                from None
        except Exception as err:  # a decoder's own failure on damaged bytes
            raise Refused(400, f"the video cannot be read ({type(err).__name__})") from None
    if not frames:
        raise Refused(400, "the video holds no frames")
    return frames
