"""Every error as JSON, {"error": "one line"}, with its status; anything unforeseen is a 500 without a traceback. On
the OpenAI-compatible routes the same line is OpenAI's error object, {"error": {"message", "type", "code"}}, which
the official clients read into their exceptions."""

import sys
import traceback

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from streaming.errors import one_line
from streaming.settings import BadInput

from .schema import MODELS_OF, AskRequest, WatchRequest
from .sessions import Refused

OPENAI_PATHS = ("/v1/chat/", "/v1/models")
OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_exceeded", 500: "server_error"}


def error(status: int, message: str, retry_after: float | None = None, path: str = "") -> JSONResponse:
    headers = {"Retry-After": f"{max(1, round(retry_after))}"} if retry_after is not None else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    body = {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"), "param": None,
            "code": status} if path.startswith(OPENAI_PATHS) else message
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _line(text) -> str:
    """The one line a client gets, at most 300 characters."""
    return one_line(text)[:300]


def invalid(path: str, err: RequestValidationError) -> JSONResponse:
    """A body that does not validate: malformed JSON 400; an unknown field 422 naming the known ones; else 422."""
    errors = err.errors()
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0] if errors else {})
    if first.get("type") == "json_invalid":
        return error(400, f"malformed JSON: {_line(first.get('ctx', {}).get('error', 'cannot be read'))}", path=path)
    where_in = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(where_in) or "request"
    if first.get("type") == "extra_forbidden":
        model = AskRequest if path.endswith("/questions") else WatchRequest if path.endswith("/watches") else \
            MODELS_OF.get(".".join(where_in[:-1]))
        known = ", ".join(model.model_fields) if model else "see /docs"
        return error(422, f"{where}: unknown field; known fields: {known}", path=path)
    return error(422, f"{where}: {_line(first.get('msg', 'invalid'))}", path=path)


def install(app: FastAPI, metrics) -> None:
    """The app's exception handlers (a refusal counted in `metrics` when it is a 429)."""

    @app.exception_handler(Refused)
    async def _refused(request, err: Refused):
        if err.status == 429:
            metrics.refused.labels(request.url.path.rsplit("/", 1)[-1] or "root").inc()
        return error(err.status, err.message, err.retry_after, request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request, err: HTTPException):
        return error(err.status_code, _line(err.detail), path=request.url.path)

    @app.exception_handler(BadInput)
    async def _bad_input(request, err: BadInput):  # settings that cannot work, as every front end says it
        return error(400, _line(err), path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        return invalid(request.url.path, err)

    @app.exception_handler(Exception)
    async def _bug(request, err: Exception):
        traceback.print_exception(err, file=sys.stderr)  # the server's log has it; the client gets one line
        return error(500, f"internal error ({type(err).__name__}); the server's log has the details",
                     path=request.url.path)
