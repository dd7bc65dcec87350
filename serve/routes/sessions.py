"""Open a session (pushed frames, or a file or URL the server pulls), read its state and transcript, close it."""

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from streaming.hosted import Settings

from ..context import AUTHORISED, SERVER, Server
from ..schema import OpenRequest

router = APIRouter(prefix="/v1/sessions", dependencies=AUTHORISED)


@router.post("", status_code=201)
async def open_session(req: OpenRequest, srv: Server = SERVER):
    settings = Settings(**req.model_dump(exclude={"source", "watches"}))
    srv.host.check(req.model)  # BadInput: a 400 (errors.py)
    hosted = await run_in_threadpool(srv.sessions.open, settings, req.source.model_dump() if req.source else None,
                                     req.watches)
    if srv.held is not None:
        await srv.held(hosted.id)
    return srv.state(hosted)


@router.get("/{session_id}")
async def read_state(session_id: str, srv: Server = SERVER):
    return srv.state(await srv.find(session_id))


@router.get("/{session_id}/transcript")
async def transcript(session_id: str, srv: Server = SERVER):
    return [a.as_dict() for a in (await srv.find(session_id)).live.transcript]


@router.delete("/{session_id}")
def close(session_id: str, srv: Server = SERVER):
    hosted = srv.sessions.close(session_id)
    return {"closed": hosted.id, "answers": len(hosted.live.transcript)}
