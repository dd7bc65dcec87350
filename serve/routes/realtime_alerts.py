"""Realtime's proactive answer: a watch set in `session.update` (`session.stream_qa.watches`, a list of watch texts)
makes the server start a `response.*` sequence by itself when the watch fires, with no `response.create` from the
client: `response.created`, the item and its part added, the alert's description as `response.output_text.delta`,
each `done`, then `response.done` whose response carries the alert: its id, watch, clip, time and description in
`metadata` (strings, as OpenAI's metadata values are) and the whole record in `stream_qa.alert`. An unmodified
`openai` client receives it as it receives any answer. A sequence never interleaves with an answer's: both hold the
connection's `responding` lock."""

import asyncio
import contextlib

from starlette.concurrency import run_in_threadpool

from streaming.events import Alert, Handler
from streaming.watches import MAX_WATCHES

from ..events import Feed
from . import realtime_events as events
from .realtime_events import BadEvent


def split_watches(session):
    """A `session.update`'s session without `stream_qa.watches`, and those watches (None when not given)."""
    if not isinstance(session, dict) or not isinstance(session.get("stream_qa"), dict) or \
            "watches" not in session["stream_qa"]:
        return session, None
    settings = dict(session["stream_qa"])
    texts = settings.pop("watches")
    return session | {"stream_qa": settings}, _checked(texts)


def _checked(texts) -> list[str]:
    if not isinstance(texts, list) or not all(isinstance(t, str) and t.strip() for t in texts):
        raise BadEvent("invalid_value", "stream_qa.watches: a list of watch texts", "session.stream_qa.watches")
    if len(texts) > MAX_WATCHES:
        raise BadEvent("invalid_value", f"stream_qa.watches: at most {MAX_WATCHES}", "session.stream_qa.watches")
    return [" ".join(t.split()) for t in texts]


class Proactive(Handler):
    """One connection's watches and the answers it gives unasked."""

    def __init__(self, connection):
        self.connection = connection
        self.texts: list[str] = []  # the watches the client set (kept when the session is reopened)
        self.feed: Feed | None = None
        self.live = None
        self.task: asyncio.Task | None = None

    def attach(self, hosted) -> None:
        """Listen to the connection's (new) session."""
        self.detach()
        self.live, self.feed = hosted.live, Feed(asyncio.get_running_loop())
        self.live.subscribe(self.feed)
        self.task = asyncio.create_task(self._listen(self.feed))

    def detach(self) -> None:
        if self.live is not None:
            self.live.unsubscribe(self.feed)
        if self.task is not None:
            self.task.cancel()
        self.live = self.feed = self.task = None

    async def set(self, texts: list[str], hosted) -> None:
        """The session's watches made `texts`: those it lacks added, those not named removed (BadEvent: one that
        cannot be watched; the watches are then as they were)."""
        watches = hosted.live.watches
        have = {w["text"]: w["id"] for w in watches.listing()}
        added = []
        try:
            for text in texts:
                if text not in have:
                    added.append((await run_in_threadpool(watches.add, text)).index)
        except ValueError as err:
            for index in added:
                watches.remove(index)
            raise BadEvent("invalid_value", f"stream_qa.watches: {err}", "session.stream_qa.watches") from None
        for text, index in have.items():
            if text not in texts:
                await run_in_threadpool(watches.remove, index)
        self.texts = list(texts)

    async def _listen(self, feed: Feed) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                _, event = await feed.queue.get()
                said = event.to(self)
                if said is not None:
                    await said

    async def on_alert(self, event: Alert) -> None:
        """The alert said as an answer the client did not ask for."""
        alert, send = event.alert, self.connection.send
        rid, iid = events.new_id("resp"), events.new_id("item")
        where = {"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0}
        item = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant", "content": []}
        text = f"[{alert['video_t']:.1f}s] {alert['alert']}: {alert['description']} ({alert['provenance']})"
        response = {"id": rid, "object": "realtime.response", "output_modalities": ["text"],
                    "conversation_id": self.connection.hosted.id,
                    "metadata": {"stream_qa_alert_id": alert["id"], "watch": alert["alert"], "clip": str(alert["clip"]),
                                 "video_t": str(alert["video_t"]), "description": alert["description"][:512]}}
        async with self.connection.responding:
            await send("response.created", response=response | {"status": "in_progress", "output": []})
            await send("response.output_item.added", response_id=rid, output_index=0,
                       item=item | {"status": "in_progress"})
            await send("response.content_part.added", **where, part={"type": "text", "text": ""})
            await send("response.output_text.delta", **where, delta=text)
            await send("response.output_text.done", **where, text=text)
            await send("response.content_part.done", **where, part={"type": "text", "text": text})
            item = item | {"status": "completed", "content": [{"type": "output_text", "text": text}]}
            await send("response.output_item.done", response_id=rid, output_index=0, item=item)
            await send("response.done", response=response | {"status": "completed", "output": [item],
                                                             "stream_qa": {"alert": alert}})
