"""A question to a session: its limits (its session's, the server's), then its answer as server-sent events
(`waiting` while the video has not reached its time; `start`, `token`…, `answer`; `error` if the stream ended
first) or, with `"stream": false`, the answer's record alone.

A question with `at` is answered once every frame at or before video time `at` is in, stamped `at`; without it,
it is about everything sent so far: a pushed-frames session answers it after the last frame pushed (asked at that
frame's time), a pulled file or URL at the time it has played to. A pushed-frames session that has taken no frame
yet refuses it at once (409): there is nothing to answer about, and nothing it would wait for."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from streaming.events import Done, Handler, Started, Token, Unanswered

from ..context import AUTHORISED, SERVER, Server
from ..events import sse
from ..schema import AskRequest
from ..sessions import Refused

UNANSWERED = "the stream ended before this question's turn"
WAITING_EVERY_S = 5.0  # a question waiting for video says so this often

router = APIRouter(prefix="/v1/sessions/{session_id}", dependencies=AUTHORISED)


@router.post("/questions")
async def ask(session_id: str, req: AskRequest, srv: Server = SERVER):
    hosted = await srv.find(session_id)
    admit(srv, hosted.live)
    pushed = hosted.pushed
    if req.at is None and pushed is not None and pushed.kept_t is None and not hosted.live.engine.has_clips:
        raise Refused(409, f"this session has taken no frame yet ({pushed.pushed} pushed and kept none): push "
                           "frames, then ask; or ask with at=T to wait for video time T")
    answering = Answering(srv, hosted, req)
    if req.stream:
        return StreamingResponse(answering.events(srv.config.sse_batch_ms / 1e3), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await answering.record()


def admit(srv: Server, live) -> None:
    """A question's limits: its session's questions in flight (waiting for video included), then the server's
    (only those whose video time has come), and a stream that can still answer."""
    config = srv.config
    if live.in_flight >= config.max_session_questions:
        raise Refused(429, f"this session has {live.in_flight} questions waiting ({config.max_session_questions} "
                           "at most); retry once one is answered", retry_after=1)
    if srv.sessions.questions_in_flight() >= config.max_questions:
        raise Refused(429, f"{config.max_questions} questions are being answered; retry shortly", retry_after=1)
    if live.finished.is_set():
        raise Refused(409, "this session's stream failed; it answers no more questions (see its notices)")


class _ToLoop:
    """A thread's `put` handed to an asyncio queue on the server's loop (a live session's answer events)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Answering:
    """One question asked of a live session, its events carried from the model's thread to this loop."""

    def __init__(self, srv: Server, hosted, req: AskRequest):
        self.srv, self.hosted, self.live, self.req = srv, hosted, hosted.live, req
        self.queue = _ToLoop(asyncio.get_running_loop())
        self.live.ask(req.text, req.at, out=self.queue)

    def waiting(self) -> bytes:
        """While the video has not reached the question's time: an SSE `waiting` event (now / needed), so a client
        can tell waiting from hanging."""
        now, at = self.live.engine.video_t, self.req.at
        if at is None or now >= at:
            return b""
        pushed = self.hosted.pushed
        return sse("waiting", {"video_t": round(now, 3), "needed": at,
                               "frames_pushed": pushed.pushed if pushed else None})

    def unanswered(self) -> str:
        now, at = self.live.engine.video_t, self.req.at
        if at is None or now >= at:
            return UNANSWERED
        pushed = f"; {self.hosted.pushed.pushed} frames pushed" if self.hosted.pushed else ""
        return f"the stream ended at {now:.1f} s of video, before this question's time ({at:g} s){pushed}"

    def answered(self, item) -> dict:
        self.srv.metrics.answered(item, self.live.telemetry())
        return item.as_dict()

    async def record(self) -> dict:
        """The answer's record alone: the start and the tokens are passed over."""
        while not (event := await self.queue.queue.get()).final:
            continue
        return event.to(_Record(self))

    async def events(self, batch_s: float):
        """SSE chunks of the answer's events; tokens after the first that come within `batch_s` of each other go
        out as one chunk (each chunk costs a hop through a proxy such as Ray's); `waiting` events at once and every
        few seconds while the question waits for video."""
        loop, pending, deadline, started, chunks = asyncio.get_running_loop(), b"", None, False, _Chunks(self)
        getter = asyncio.ensure_future(self.queue.queue.get())  # kept across waits: a timed-out wait loses nothing
        try:
            if first := self.waiting():
                yield first
            while True:
                if deadline is None and not started:
                    done, _ = await asyncio.wait({getter}, timeout=WAITING_EVERY_S)
                    if not done:
                        yield self.waiting() or b": still working\n\n"
                        continue
                if deadline is not None:
                    done, _ = await asyncio.wait({getter}, timeout=max(0.0, deadline - loop.time()))
                    if not done:
                        yield pending
                        pending, deadline = b"", None
                        continue
                event = await getter
                getter = asyncio.ensure_future(self.queue.queue.get())
                chunk, batched = event.to(chunks)
                started = True
                if event.final:
                    yield pending + chunk
                    return
                if batched and batch_s > 0:
                    pending += chunk
                    deadline = deadline if deadline is not None else loop.time() + batch_s
                else:
                    yield pending + chunk
                    pending, deadline = b"", None
        finally:
            getter.cancel()


class _Record(Handler):
    """The end of a question asked with `"stream": false`: its record, or a 409."""

    def __init__(self, answering: Answering):
        self.answering = answering

    def on_done(self, event: Done) -> dict:
        return self.answering.answered(event.answer)

    def on_unanswered(self, event: Unanswered) -> dict:
        raise Refused(409, self.answering.unanswered())


class _Chunks(_Record):
    """Each event as its SSE chunk, and whether it may wait to go out with the tokens after it (a token after the
    first)."""

    def __init__(self, answering: Answering):
        super().__init__(answering)
        self.tokens = 0

    def on_started(self, event: Started) -> tuple[bytes, bool]:
        return sse("start", {"video_t": event.video_t}), False

    def on_token(self, event: Token) -> tuple[bytes, bool]:
        self.tokens += 1
        return sse("token", {"text": event.text}), self.tokens > 1

    def on_done(self, event: Done) -> tuple[bytes, bool]:
        return sse("answer", super().on_done(event)), False

    def on_unanswered(self, event: Unanswered) -> tuple[bytes, bool]:
        return sse("error", {"error": self.answering.unanswered()}), False
