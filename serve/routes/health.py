"""Whether the server is up (no token needed) and its Prometheus metrics."""

from fastapi import APIRouter
from fastapi.responses import Response

from ..context import AUTHORISED, SERVER, Server
from ..metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/healthz")
async def healthz(srv: Server = SERVER):
    return {"ok": True, "sessions": len(srv.sessions), "models": srv.host.models, "replica": srv.config.replica}


@router.get("/metrics", dependencies=AUTHORISED)
async def prometheus(srv: Server = SERVER):
    return Response(srv.metrics.render(srv.sessions.all(), srv.host.streams_held()), media_type=CONTENT_TYPE)
