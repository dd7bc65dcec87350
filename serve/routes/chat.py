"""What OpenAI-compatible clients speak (issue 63, part): `GET /v1/models`, and `POST /v1/chat/completions` with
`image_url` parts, a one-shot question about the frames given, answered on a bounded session opened for it and closed
after it: the same hosted session the native routes use, pushed the frames in order, ended, then asked (no second
engine). Frames are `data:` URLs (JPEG or PNG; the server fetches nothing), at 1 s apart unless a part says its
video time (`image_url.t`, an extension); the question is the last user message's text, answered after every frame
of the request is in, at the last frame's time. `stream: true` answers as `chat.completion.chunk` server-sent events
ended by `data: [DONE]`. Decoding is greedy, as every answer here is: `temperature` and `top_p` are taken (OpenAI's
tools send 0.7 or 1) and not applied, and `usage.stream_qa.decoding` says so."""

import asyncio
import base64
import binascii
import json
import time
import uuid
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from streaming.events import Done, Handler, Token, Unanswered
from streaming.hosted import Settings, unknown_model
from streaming.questions import MAX_QUESTION_CHARS

from ..context import AUTHORISED, SERVER, Server
from ..schema import AskRequest
from ..sessions import Refused
from .media import decode_image, push
from .questions import Answering, admit

router = APIRouter(prefix="/v1", dependencies=AUTHORISED)
CREATED = int(time.time())  # when this process began serving its models, as /v1/models reports it
IMAGE_PREFIXES = ("data:image/jpeg;base64,", "data:image/png;base64,", "data:image/jpg;base64,")
MAX_FRAMES = 600  # frames in one request (10 minutes at 1 fps)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=64 * 2**20)
    detail: Literal["auto", "low", "high"] | None = None
    t: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="the frame's video time (seconds)")


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "image_url"]
    text: str | None = Field(None, max_length=MAX_QUESTION_CHARS)
    image_url: ImageURL | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] = Field(max_length=MAX_FRAMES + 8)
    name: str | None = Field(None, max_length=64)


class ChatRequest(BaseModel):
    """OpenAI's chat completion body, the fields this server honours; the sampling fields within OpenAI's own ranges
    are taken and answered greedily (`decoding` in the answer's `usage.stream_qa` says so); one choice (`n` 1)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=200)
    messages: list[Message] = Field(min_length=1, max_length=64)
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = Field(None, ge=1, le=512)
    max_completion_tokens: int | None = Field(None, ge=1, le=512)
    temperature: float | None = Field(None, ge=0, le=2, description="taken; answers are decoded greedily")
    top_p: float | None = Field(None, gt=0, le=1, description="taken; answers are decoded greedily")
    n: int | None = Field(None, ge=1, le=1)
    seed: int | None = None
    user: str | None = Field(None, max_length=256)


@router.get("/models")
async def models(srv: Server = SERVER):
    return {"object": "list", "data": [{"id": name, "object": "model", "created": CREATED, "owned_by": "stream-qa"}
                                       for name in srv.host.models]}


@router.post("/chat/completions")
async def chat_completions(req: ChatRequest, srv: Server = SERVER):
    if (why := unknown_model(req.model, srv.host.models)) is not None:
        raise Refused(404, why)  # OpenAI's status for a model it does not have
    question, frames = read_messages(req.messages, srv.config.max_upload_bytes)
    settings = Settings(model=req.model, max_new_tokens=req.max_completion_tokens or req.max_tokens or 16)
    hosted = await run_in_threadpool(srv.sessions.open, settings, None)
    try:
        for data, t in frames:
            await push(srv, hosted.pushed, lambda data=data: decode_image(data), t)
        await run_in_threadpool(hosted.pushed.end)
        admit(srv, hosted.live)
        answering = Answering(srv, hosted, AskRequest(text=question, stream=req.stream))
    except BaseException:
        await run_in_threadpool(srv.sessions.close, hosted.id)
        raise
    reply = Reply(req.model, req.stream_options, decoding(req))
    if req.stream:
        return StreamingResponse(reply.chunks(srv, hosted, answering), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        whole = Whole(reply, answering)
        while not (event := await answering.queue.queue.get()).final:
            event.to(whole)
        return event.to(whole)
    finally:
        await run_in_threadpool(srv.sessions.close, hosted.id)


def decoding(req: ChatRequest) -> str:
    """How the answer was decoded, in words: greedy, and which sampling fields asked otherwise."""
    asked = [f"{k} {v:g}" for k, v, greedy in (("temperature", req.temperature, 0), ("top_p", req.top_p, 1))
             if v is not None and v != greedy]
    return "greedy" + (f" ({', '.join(asked)} taken, not applied)" if asked else "")


def read_messages(messages: list[Message], max_bytes: int) -> tuple[str, list[tuple[bytes, float]]]:
    """The question (the last user message's text) and the frames (every image part, in order, with its time)."""
    frames, last = [], None
    for message in messages:
        parts = [Part(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        for part in parts:
            if part.type == "image_url":
                if part.image_url is None:
                    raise Refused(400, "an image_url part without its image_url")
                frames.append((image_bytes(part.image_url.url, max_bytes), part.image_url.t))
        if message.role == "user":
            last = " ".join(p.text for p in parts if p.type == "text" and p.text).strip()
    if not last:
        raise Refused(400, "no question: the last user message has no text")
    if not frames:
        raise Refused(400, "no frames: send the video as image_url parts (data:image/jpeg or image/png URLs)")
    if len(frames) > MAX_FRAMES:
        raise Refused(413, f"{len(frames)} frames in one request; at most {MAX_FRAMES}")
    times, t = [], -1.0
    for _, given in frames:
        t = t + 1.0 if given is None else given
        if times and t < times[-1]:
            raise Refused(400, f"frame times go back: {t:g} s after {times[-1]:g} s")
        times.append(t)
    return last, [(data, t) for (data, _), t in zip(frames, times, strict=True)]


def image_bytes(url: str, max_bytes: int) -> bytes:
    """A frame's bytes from its data URL; any other URL is refused (the server fetches nothing for a client)."""
    prefix = next((p for p in IMAGE_PREFIXES if url[:40].lower().startswith(p)), None)
    if prefix is None:
        shown = url[:40] + ("…" if len(url) > 40 else "")
        raise Refused(400, f"image_url {shown!r}: send frames as data:image/jpeg or data:image/png base64 URLs; "
                           "this server fetches no URL")
    if (len(url) - len(prefix)) * 3 // 4 > max_bytes:
        raise Refused(413, f"a frame over the limit of {max_bytes / 2**20:g} MB")
    try:
        return base64.b64decode(url[len(prefix):], validate=True)
    except (binascii.Error, ValueError):
        raise Refused(400, "an image_url whose base64 does not decode") from None


class Reply:
    """An answer record as OpenAI's chat completion (whole, or as chunks); `usage` counts the answer's tokens and
    carries the record (`stream_qa`: KV tokens, time to first token, what was looked up and recalled)."""

    def __init__(self, model: str, stream_options: dict | None, decoding: str = "greedy"):
        self.id, self.model, self.decoding = f"chatcmpl-{uuid.uuid4().hex[:24]}", model, decoding
        self.created, self.usage = int(time.time()), bool((stream_options or {}).get("include_usage"))

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, record: dict, pieces: int) -> dict:
        """`prompt_tokens`: the bounded KV cache the answer read (frames and question as they stand after eviction);
        `completion_tokens`: the answer's streamed pieces (a token each)."""
        return {"prompt_tokens": record["kv_tokens"], "completion_tokens": pieces,
                "total_tokens": record["kv_tokens"] + pieces, "stream_qa": record | {"decoding": self.decoding}}

    def completion(self, record: dict, pieces: int, finish: str = "stop") -> dict:
        message = {"role": "assistant", "content": record["answer"]}
        return self._head("chat.completion") | {
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": self._usage(record, pieces)}

    def chunk(self, delta: dict, finish: str | None = None) -> bytes:
        return _event(self._head("chat.completion.chunk") | {
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    async def chunks(self, srv: Server, hosted, answering: Answering):
        """The answer's tokens as they come; the session closes once it is done (or the client left)."""
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            streamed = Streamed(self, answering)
            while not (event := await answering.queue.queue.get()).final:
                if chunk := event.to(streamed):
                    yield chunk
            yield event.to(streamed)
            yield b"data: [DONE]\n\n"
        finally:
            await asyncio.shield(run_in_threadpool(srv.sessions.close, hosted.id))


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


class Whole(Handler):
    """A question's events read to the whole completion (`"stream": false`): its tokens counted, then the record."""

    def __init__(self, reply: Reply, answering: Answering):
        self.reply, self.answering, self.pieces = reply, answering, 0

    def on_token(self, event: Token) -> bytes:
        self.pieces += 1
        return b""

    def on_done(self, event: Done) -> dict:
        return self.reply.completion(self.answering.answered(event.answer), self.pieces, event.finish_reason)

    def on_unanswered(self, event: Unanswered):
        raise Refused(409, self.answering.unanswered())


class Streamed(Whole):
    """A question's events as completion chunks (`"stream": true`)."""

    def on_token(self, event: Token) -> bytes:
        super().on_token(event)
        return self.reply.chunk({"content": event.text})

    def on_done(self, event: Done) -> bytes:
        reply, record = self.reply, self.answering.answered(event.answer)
        out = reply.chunk({}, event.finish_reason)
        if reply.usage:
            out += _event(reply._head("chat.completion.chunk") | {"choices": [],
                                                                  "usage": reply._usage(record, self.pieces)})
        return out

    def on_unanswered(self, event: Unanswered) -> bytes:
        return _event({"error": {"message": self.answering.unanswered()}})
