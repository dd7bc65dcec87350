"""A session's watches (standing conditions judged on every clip), the alerts they fired, and what sessions say
without being asked as server-sent events: one session's (`clip`, `alert`, `dropped`) and the whole server's."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..context import AUTHORISED, SERVER, Server
from ..events import Feed
from ..schema import WatchRequest
from ..sessions import Refused

router = APIRouter(prefix="/v1", dependencies=AUTHORISED)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/sessions/{session_id}/watches", status_code=201)
async def add_watch(session_id: str, req: WatchRequest, srv: Server = SERVER):
    watches = (await srv.find(session_id)).live.watches
    try:
        return (await run_in_threadpool(watches.add, req.text, req.rearm_clips, req.cooldown_s)).as_dict()
    except ValueError as err:
        raise Refused(400, str(err)) from None


@router.get("/sessions/{session_id}/watches")
async def list_watches(session_id: str, srv: Server = SERVER):
    return (await srv.find(session_id)).live.watches.listing()


@router.delete("/sessions/{session_id}/watches/{watch_id}")
async def remove_watch(session_id: str, watch_id: int, srv: Server = SERVER):
    gone = await run_in_threadpool((await srv.find(session_id)).live.watches.remove, watch_id)
    if gone is None:
        raise Refused(404, f"this session has no watch {watch_id}")
    return {"removed": watch_id, "alerts": gone.alerts}


@router.get("/sessions/{session_id}/alerts")
async def alerts(session_id: str, srv: Server = SERVER):
    """Every alert the session's watches fired, oldest first: those its folder keeps (from before a restart too),
    then any of this run's the folder could not take."""
    live = (await srv.find(session_id)).live
    folder = live.folder
    stored = await run_in_threadpool(folder.alerts) if folder is not None else []
    kept = {a.get("id") for a in stored}
    return stored + [a for a in list(live.watches.alerts) if a["id"] not in kept]


@router.get("/sessions/{session_id}/events")
async def session_events(session_id: str, srv: Server = SERVER):
    live = (await srv.find(session_id)).live
    feed = Feed(asyncio.get_running_loop(), srv.metrics, session_id)
    live.subscribe(feed)
    return StreamingResponse(_until_gone(feed.chunks(), lambda: live.unsubscribe(feed)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/events")
async def server_events(srv: Server = SERVER):
    """Every session's clips, alerts and drops, each tagged with its session."""
    feed = Feed(asyncio.get_running_loop(), srv.metrics)
    srv.sessions.events.add(feed)
    return StreamingResponse(_until_gone(feed.chunks(), lambda: srv.sessions.events.remove(feed)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _until_gone(chunks, leave):
    """The chunks until the client leaves; then the feed stops receiving."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        leave()
