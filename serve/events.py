"""What sessions say without being asked (each clip seen, each alert a watch fired, frames dropped), as server-sent
events: to a client of one session (`GET /v1/sessions/{id}/events`) and to a client of the whole server
(`GET /v1/events`).

A receiver is a `Feed`: a bounded queue on the server's event loop. The model thread hands each event over with one
non-blocking call (`put`), so a slow or vanished receiver never delays ingest or an answer; a receiver that falls
`MAX_QUEUED` events behind loses the newest ones, counted (`stream_qa_events_dropped`) and said to it in its next
chunk. `Broadcast` is every session's subscriber for the whole-server feeds.
"""

import asyncio
import contextlib
import json
import threading

from streaming.events import Alert, ClipSeen, Dropped, Handler, WatchState
from streaming.lines import clip_record

MAX_QUEUED = 256  # events a receiver may be behind
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream


class Feed:
    """One SSE receiver's queue of (session id, event)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics=None, session: str | None = None):
        self.loop, self.metrics, self.session = loop, metrics, session
        self.queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self.lost = 0  # events dropped since the last chunk said so

    def put(self, event, session: str | None = None) -> None:
        """From any thread: the event handed to the loop, never waited for."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is stopping
            self.loop.call_soon_threadsafe(self._put, (session or self.session, event))

    def _put(self, item) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.lost += 1
            if self.metrics is not None:
                self.metrics.events_dropped.inc()

    async def chunks(self, keepalive_s: float = KEEPALIVE_S):
        """The feed's SSE chunks, until the client leaves."""
        while True:
            try:
                session, event = await asyncio.wait_for(self.queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            lost, self.lost = self.lost, 0
            if lost:
                yield sse("lost", {"events": lost})
            chunk = event.to(_Chunk(session))
            if chunk:
                yield chunk


class Broadcast:
    """Every session's events, handed to every whole-server feed; alerts counted."""

    def __init__(self, metrics=None):
        self.metrics, self.feeds, self._lock = metrics, set(), threading.Lock()

    def of(self, session_id: str) -> "_From":
        """What a session subscribes (`LiveSession.subscribe`): its events, tagged with its id."""
        return _From(self, session_id)

    def add(self, feed: Feed) -> None:
        with self._lock:
            self.feeds.add(feed)

    def remove(self, feed: Feed) -> None:
        with self._lock:
            self.feeds.discard(feed)

    def put(self, session_id: str, event) -> None:
        if isinstance(event, Alert) and self.metrics is not None:
            self.metrics.alerts.inc()
        with self._lock:
            feeds = list(self.feeds)
        for feed in feeds:
            feed.put(event, session_id)


class _From:
    def __init__(self, broadcast: Broadcast, session_id: str):
        self.broadcast, self.session_id = broadcast, session_id

    def put(self, event) -> None:
        self.broadcast.put(self.session_id, event)


def sse(event: str, data) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class _Chunk(Handler):
    """An event as its SSE chunk, with the session it came from."""

    def __init__(self, session: str | None):
        self.session = session

    def on_clip_seen(self, event: ClipSeen) -> bytes:
        return sse("clip", {"session": self.session, **clip_record(event.clip)})

    def on_alert(self, event: Alert) -> bytes:
        return sse("alert", {**event.alert, "session": self.session})

    def on_watch_state(self, event: WatchState) -> bytes:
        return sse("watch", {**event.state, "session": self.session})

    def on_dropped(self, event: Dropped) -> bytes:
        return sse("dropped", {"session": self.session, "clips": event.frames})
