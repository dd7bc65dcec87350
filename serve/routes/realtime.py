"""OpenAI's Realtime protocol on a WebSocket, `/v1/realtime` (issue 63): a connection is a hosted session of pushed
frames, the one the native routes use (no second engine), so the unmodified `openai` package streams a camera into
a bounded session and asks about it.

- Connect: `?model=NAME` opens a session; `?session=ID` continues one (held here, or from its folder).
  `session.created` gives its id.
- `session.update`: `instructions` kept and echoed (tiny-vlm answers with the system prompt it was trained with);
  `max_output_tokens`, `model`, and the extension key `stream_qa`'s session settings, changed only before the
  session's first frame (it is reopened with them); `stream_qa.watches`, at any time: answers unasked when one fires.
- `conversation.item.create`, a user message: `input_image` parts (JPEG/PNG `data:` URLs) are frames at their
  extension field `t` (seconds), else at their arrival time but at least one frame interval (the session's fps)
  after the frame before (a burst is spaced at the session's rate); `input_text` parts are the question.
- `response.create` answers it about every frame sent before it (the clip still filling closes at the last one),
  streamed as OpenAI streams text; `response.done`'s `usage.stream_qa` is the answer's record.
- What cannot be done (audio, tools, a bad event) is an `error` event and the connection stays; a full server is an
  `error` event, then a close (1013) that says when to retry; idle past `--idle`, the connection closes. On close the
  session is closed too, its folder (with `--sessions`) kept for `?session=ID`.
"""

import asyncio
import contextlib
import json
import sys
import time
import traceback
from collections import deque

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.concurrency import run_in_threadpool

from streaming.hosted import Settings, unknown_model
from streaming.questions import MAX_QUESTION_CHARS

from ..context import Server, token_accepted
from ..schema import AskRequest
from ..sessions import Refused
from . import realtime_events as events
from .media import decode_image, push
from .questions import Answering, admit
from .realtime_alerts import Proactive, split_watches
from .realtime_events import BadEvent

router = APIRouter()
TRY_AGAIN_LATER, POLICY_VIOLATION = 1013, 1008  # WebSocket close codes (RFC 6455, IANA registry)
RECONNECT_GRACE_S = 2.0  # how long a resume waits for the session's last connection to see its client's close


class Connection:
    """One WebSocket: its session, the question being gathered, and the answer streaming out."""

    def __init__(self, srv: Server, ws: WebSocket):
        self.srv, self.ws, self.config = srv, ws, srv.config
        self.hosted, self.instructions, self.question = None, "", []
        self.stored_clips = 0  # a resumed session's: questions can be asked before any new clip
        self.since: tuple[float, float] | None = None  # (arrival clock, video time) of this connection's first frame
        self.arrivals: deque = deque()  # recent frames' arrival times: the per-connection frame rate
        self.answering: asyncio.Task | None = None
        self.leaving, self.closed = False, asyncio.Event()  # its session being closed; closed
        self._send = asyncio.Lock()
        self.responding = asyncio.Lock()  # one response.* sequence at a time: an answer's, or an alert's
        self.proactive = Proactive(self)  # the session's watches, and what they make it say unasked

    # --- the wire -------------------------------------------------------------------------------

    async def send(self, kind: str, **body) -> None:
        async with self._send:  # the answer's task and the event loop both send
            await self.ws.send_text(json.dumps({"type": kind, "event_id": events.new_id("event"), **body}))

    async def error(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> None:
        kind = "invalid_request_error" if code not in ("server_error", "rate_limit_exceeded") else code
        await self.send("error", error={"type": kind, "code": code, "message": message, "param": param,
                                        "event_id": event_id})

    async def refuse(self, code: int, error: str, message: str) -> None:
        """An `error` event, then the close with its reason (a close reason is at most 123 bytes)."""
        await self.error(error, message)
        await self.ws.close(code, message.encode()[:123].decode(errors="ignore"))

    # --- the connection's life ------------------------------------------------------------------

    async def run(self) -> None:
        await self.ws.accept()
        metrics = self.srv.metrics
        metrics.realtime_connections.inc()
        try:
            with contextlib.suppress(WebSocketDisconnect):  # the client left: its session is closed below
                if await self.start():
                    await self.serve_events()
        finally:
            metrics.realtime_connections.dec()
            self.leaving = True
            self.proactive.detach()
            if self.answering is not None:
                self.answering.cancel()
            if self.hosted is not None:  # closed, its folder kept: `?session=ID` continues it
                with contextlib.suppress(Refused):
                    await asyncio.shield(run_in_threadpool(self.srv.sessions.close, self.hosted.id, False))
                if self.srv.realtime.get(self.hosted.id) is self:
                    del self.srv.realtime[self.hosted.id]
            self.closed.set()

    async def start(self) -> bool:
        """The token, then the session (opened, or continued with `?session=ID`); False when refused."""
        query = self.ws.query_params
        if not token_accepted(self.config.token, self.ws.headers.get("authorization", "")):
            await self.refuse(POLICY_VIOLATION, "invalid_api_key", "a bearer token is required (Authorization: "
                                                                   "Bearer …)")
            return False
        model = query.get("model") or Settings().model
        if (why := unknown_model(model, self.srv.host.models)) is not None:
            await self.refuse(POLICY_VIOLATION, "model_not_found", why)
            return False
        try:
            if query.get("session"):
                await self.resume(query["session"], model)
            else:
                await self.open(Settings(model=model))
        except Refused as err:
            await self.refuse(TRY_AGAIN_LATER if err.status in (429, 503) else POLICY_VIOLATION,
                              "rate_limit_exceeded" if err.status == 429 else "session_refused", events.said(err))
            return False
        await self.send("session.created", session=self.described())
        return True

    async def open(self, settings: Settings) -> None:
        self.hosted = await run_in_threadpool(self.srv.sessions.open, settings, None)
        self.srv.realtime[self.hosted.id] = self
        self.proactive.attach(self.hosted)
        if self.srv.held is not None:  # behind Ray Serve: the router learns which replica holds it
            await self.srv.held(self.hosted.id)

    async def resume(self, session_id: str, model: str) -> None:
        other = self.srv.realtime.get(session_id)
        if other is not None:  # a client reconnecting at once can arrive before its last connection saw the close
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(other.closed.wait(), timeout=RECONNECT_GRACE_S)
            if not other.leaving:
                raise Refused(409, "this session already has a Realtime connection")
            with contextlib.suppress(TimeoutError):  # it is closing the session: wait for that
                await asyncio.wait_for(other.closed.wait(), timeout=30)
        hosted = await self.srv.find(session_id)
        if hosted.pushed is None:
            raise Refused(409, f"this session pulls its own frames ({hosted.source['kind']}); it takes none pushed")
        if hosted.live.settings.model != model:
            raise Refused(409, f"this session runs {hosted.live.settings.model}, not {model}")
        self.srv.realtime[hosted.id] = self
        self.hosted, self.stored_clips = hosted, hosted.live.engine.resume_at[0]
        self.proactive.attach(hosted)

    def described(self) -> dict:
        """The session as OpenAI describes one, with its `stream_qa` settings and state."""
        live = self.hosted.live
        settings = live.settings
        return {"type": "realtime", "object": "realtime.session", "id": self.hosted.id, "model": settings.model,
                "instructions": self.instructions, "output_modalities": ["text"],
                "max_output_tokens": settings.max_new_tokens,
                "stream_qa": settings.as_dict() | {"budget_tokens": live.budget_tokens,
                                                  "video_t": round(live.engine.video_t, 3),
                                                  "stored_clips": self.stored_clips,
                                                  "watches": [w["text"] for w in live.watches.listing()]}}

    async def serve_events(self) -> None:
        """Events until the client leaves or stays idle past `idle_s` (an answer streaming is not idle), or the
        connection has lost its session (`reopen`)."""
        while self.hosted is not None:
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=self.config.idle_s)
            except TimeoutError:
                if self.answering is not None and not self.answering.done():
                    continue
                await self.ws.close(1000, f"idle for {self.config.idle_s:g} s; continue with ?session=ID")
                return
            if message["type"] == "websocket.disconnect":
                return
            await self.handle(message)

    async def handle(self, message: dict) -> None:
        """One message: parsed, dispatched; whatever it cannot do is an `error` event, never a dropped connection."""
        event_id = None
        try:
            if message.get("text") is None:
                raise BadEvent("invalid_event", "a binary message: events are JSON text")
            try:
                event = json.loads(message["text"])
            except (ValueError, RecursionError):
                raise BadEvent("invalid_json", "the message is not JSON") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise BadEvent("invalid_event", "an event is a JSON object with a string 'type'")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            kind = event["type"]
            self.srv.metrics.realtime_events.labels(kind if kind in events.CLIENT_EVENTS else "other").inc()
            self.hosted.touch()
            await self.dispatch(kind, event)
        except BadEvent as err:
            await self.error(err.code, err.message, err.param, event_id)
        except Refused as err:
            code = "rate_limit_exceeded" if err.status == 429 else "invalid_request_error"
            await self.error(code, events.said(err), None, event_id)
        except (WebSocketDisconnect, asyncio.CancelledError):
            raise
        except Exception as err:  # a bug: the log has it, the client gets one line and keeps its connection
            traceback.print_exception(err, file=sys.stderr)
            await self.error("server_error", f"internal error ({type(err).__name__}); the server's log has the "
                                             "details", None, event_id)

    async def dispatch(self, kind: str, event: dict) -> None:
        handlers = {"session.update": self.session_update, "conversation.item.create": self.item_create,
                    "response.create": self.response_create}
        if kind in handlers:
            return await handlers[kind](event)
        if kind in events.AUDIO_EVENTS:
            raise BadEvent("audio_not_supported", f"{kind}: this server takes images and text, not audio")
        if kind in events.NOT_HERE:
            raise BadEvent("unsupported_event", f"{kind} is not supported by this server")
        raise BadEvent("unknown_event", f"unknown event type {kind[:80]!r}; this server takes session.update, "
                                        "conversation.item.create, response.create")

    # --- session.update --------------------------------------------------------------------------

    async def session_update(self, event: dict) -> None:
        session, watches = split_watches(event.get("session"))
        settings, instructions = events.read_session(session, self.hosted.live.settings, self.instructions,
                                                     self.srv.host.models)
        if settings != self.hosted.live.settings:
            await self.reopen(settings)
            watches = self.proactive.texts if watches is None else watches  # the reopened session keeps them
        if watches is not None:
            await self.proactive.set(watches, self.hosted)
        self.instructions = instructions
        await self.send("session.updated", session=self.described())

    async def reopen(self, settings: Settings) -> None:
        """New settings: the session is opened again with them, before it has any frame (a frame's clip was made
        under the old ones)."""
        pushed = self.hosted.pushed
        if pushed.pushed or self.stored_clips:
            raise BadEvent("session_settings_locked", "settings change only before the session's first frame; "
                                                      "open a new connection for new settings")
        old = self.hosted
        await run_in_threadpool(self.srv.sessions.close, old.id)
        del self.srv.realtime[old.id]
        try:
            await self.open(settings)
        except Refused:
            try:
                await self.open(old.live.settings)  # the connection keeps a session, under its former settings
            except Refused as err:  # the room it held went to another client: nothing left to serve
                self.hosted = None
                await self.refuse(TRY_AGAIN_LATER, "rate_limit_exceeded", f"{err.message}; connect again")
            raise

    # --- conversation.item.create -----------------------------------------------------------------

    async def item_create(self, event: dict) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type") != "message":
            raise BadEvent("invalid_item", "conversation.item.create takes an item of type 'message'", "item.type")
        if item.get("role") != "user":
            raise BadEvent("invalid_item", "only user messages are taken (instructions go in session.update)",
                           "item.role")
        frames, texts = events.read_parts(item.get("content"), self.config.max_upload_bytes)
        question = " ".join(self.question + texts)
        if len(question) > MAX_QUESTION_CHARS:
            raise BadEvent("invalid_value", f"a question of more than {MAX_QUESTION_CHARS} characters",
                           "item.content")
        echo = []
        for data, given in frames:
            self.rate_check()
            t = self.frame_time(given)
            kept = await self.push_frame(data, t)
            echo.append({"type": "input_image", "t": t, "kept": kept, "bytes": len(data)})
        self.question += texts
        echo += [{"type": "input_text", "text": text} for text in texts]
        item_id = item.get("id") if isinstance(item.get("id"), str) and len(item["id"]) <= 64 else events.new_id("item")
        await self.send("conversation.item.created", previous_item_id=None, item={
            "id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
            "content": echo})

    def rate_check(self) -> None:
        """At most `realtime_fps` frames a second arrive on one connection."""
        now, limit = time.monotonic(), self.config.realtime_fps
        while self.arrivals and now - self.arrivals[0] > 1.0:
            self.arrivals.popleft()
        if len(self.arrivals) >= limit:
            raise BadEvent("rate_limit_exceeded", f"more than {limit:g} frames a second on this connection; "
                                                  "this frame was not taken")
        self.arrivals.append(now)

    def frame_time(self, given: float | None) -> float:
        """A frame's video time: its given `t`; else its arrival time after this connection's first frame (which
        follows what a resumed session stored), but never sooner than one frame interval (the session's fps) after
        the frame before it: frames sent in a burst are spaced at the session's rate, so none is let go as too soon
        and every one is in the next answer."""
        pushed, now = self.hosted.pushed, time.monotonic()
        start = self.hosted.live.engine.resume_at[1]
        if self.since is None:
            self.since = (now, start if given is None else float(given))
        if given is not None:
            if given < start:
                raise BadEvent("invalid_value", f"t {given:g} s: this session's stored video runs to {start:g} s")
            return float(given)
        t = self.since[1] + (now - self.since[0])
        return t if pushed.last_t is None else max(t, pushed.last_t + 1.0 / self.hosted.live.settings.fps)

    async def push_frame(self, data: bytes, t: float) -> bool:
        """The frame pushed into the session (decoded only if its rate keeps it); whether it was kept."""
        pushed = self.hosted.pushed
        skipped = pushed.skipped
        await push(self.srv, pushed, lambda: decode_image(data), t)
        self.srv.metrics.realtime_frames.inc()
        return pushed.skipped == skipped

    # --- response.create -------------------------------------------------------------------------

    async def response_create(self, event: dict) -> None:
        if self.answering is not None and not self.answering.done():
            raise BadEvent("conversation_already_has_active_response",
                           "an answer is streaming; send response.create once its response.done has come")
        response = event.get("response") or {}
        if not isinstance(response, dict):
            raise BadEvent("invalid_event", "response: an object", "response")
        events.text_only(response, "response")
        if not self.question:
            raise BadEvent("no_question", "nothing to answer: send a user message with an input_text part first")
        if self.hosted.pushed.kept_t is None and not self.stored_clips:
            raise BadEvent("no_frame", "no frame has been taken yet: send input_image frames, then ask")
        admit(self.srv, self.hosted.live)
        # about every frame sent before it: asked at the last one, whose clip closes there (`LiveSession.ask`)
        answering = Answering(self.srv, self.hosted, AskRequest(text=" ".join(self.question)))
        self.question = []
        self.answering = asyncio.create_task(self.stream(answering))
        self.answering.add_done_callback(_quiet)

    async def _stream(self, answering: Answering) -> None:
        """The answer as OpenAI streams text: created, the item and its part added, deltas, then each done."""
        rid, iid = events.new_id("resp"), events.new_id("item")
        where = {"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0}
        item = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant", "content": []}
        response = {"id": rid, "object": "realtime.response", "output_modalities": ["text"],
                    "conversation_id": self.hosted.id}
        await self.send("response.created", response=response | {"status": "in_progress", "output": []})
        await self.send("response.output_item.added", response_id=rid, output_index=0,
                        item=item | {"status": "in_progress"})
        await self.send("response.content_part.added", **where, part={"type": "text", "text": ""})
        told = events.Told(self, answering, where, item, response)
        while True:
            event = await answering.queue.queue.get()
            self.hosted.touch()
            await event.to(told)
            if event.final:
                return

    async def stream(self, answering: Answering) -> None:
        async with self.responding:  # an alert's sequence waits for the answer's end
            await self._stream(answering)

    async def finish(self, record: dict, pieces: int, where: dict, item: dict, response: dict) -> None:
        text = record["answer"]
        await self.send("response.output_text.done", **where, text=text)
        await self.send("response.content_part.done", **where, part={"type": "text", "text": text})
        item = item | {"status": "completed", "content": [{"type": "output_text", "text": text}]}
        await self.send("response.output_item.done", response_id=where["response_id"], output_index=0, item=item)
        usage = {"input_tokens": record["kv_tokens"], "output_tokens": pieces,
                 "total_tokens": record["kv_tokens"] + pieces, "stream_qa": record}
        await self.send("response.done", response=response | {"status": "completed", "output": [item],
                                                               "usage": usage})


def _quiet(task: asyncio.Task) -> None:
    """An answer's task that ended by the client's leaving (its send failed): nothing more to tell anyone."""
    if not task.cancelled():
        task.exception()


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket):
    await Connection(ws.app.state.server, ws).run()

