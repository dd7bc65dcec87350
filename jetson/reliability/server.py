"""The server rows of the reliability table: bad requests to a real `python -m serve` over loopback, each with the
HTTP status it must get, a JSON body of one line and no traceback, and the server still up after it.

`serving.serving(tmp)` starts the server the rows run against; `run_rows(url, media)` runs every row and judges it.
Nothing here talks to any address but 127.0.0.1.
"""

import asyncio
import io
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from streaming.remote import encoded

from . import edges, hostile, watches
from .media import clip
from .serving import LIMITS, TOKEN


@dataclass
class Row:
    name: str
    status: int | tuple  # the status (or any of them) the request must get
    send: Callable  # (Ctx) -> httpx.Response, or a dict judged by itself ({"ok", "observed"})
    notes: str = ""


@dataclass
class Ctx:
    http: httpx.Client
    url: str
    media: Path
    pid: int | None = None  # the server's process: rows that weigh what a request cost read its CPU and RSS
    limits: dict = field(default_factory=lambda: dict(LIMITS))  # what the server was started with

    def open(self, **body) -> str:
        response = self.http.post("/v1/sessions", json=body)
        response.raise_for_status()
        return response.json()["id"]

    def frame(self, sid: str, data: bytes, t: float, kind: str = "image/jpeg") -> httpx.Response:
        return self.http.post(f"/v1/sessions/{sid}/frames", params={"t": t}, content=data,
                              headers={"content-type": kind})


def jpeg(w: int = 64, h: int = 48) -> bytes:
    return encoded(np.full((h, w, 3), 120, np.uint8))


def pushing(ctx: Ctx) -> str:
    """A fresh pushed-frames session (closed by `rows`' caller when the row ends)."""
    return ctx.open(budget="256")


def _closed(ctx: Ctx, then: Callable) -> httpx.Response:
    sid = pushing(ctx)
    ctx.http.delete(f"/v1/sessions/{sid}")
    return then(sid)


def _pushed_then(ctx: Ctx, data: bytes, t: float, kind="image/jpeg", first: float | None = None) -> httpx.Response:
    sid = pushing(ctx)
    try:
        if first is not None:
            ctx.frame(sid, jpeg(), first).raise_for_status()
        return ctx.frame(sid, data, t, kind)
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def _on_session(ctx: Ctx, call: Callable) -> httpx.Response:
    sid = pushing(ctx)
    try:
        return call(sid)
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def _truncated_upload(ctx: Ctx) -> dict:
    """A frame upload whose body stops short of its Content-Length, the connection then closed: the server must
    drop it and go on."""
    sid = pushing(ctx)
    try:
        host, port = ctx.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/sessions/{sid}/frames?t=0 HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}"
                      f"\r\nContent-Type: image/jpeg\r\nContent-Length: 50000\r\n\r\n".encode() + jpeg()[:200])
            time.sleep(0.3)
        up = ctx.http.get("/healthz").status_code == 200
        state = ctx.http.get(f"/v1/sessions/{sid}").json()
        ok = up and state["frames_pushed"] == 0
        return {"ok": ok, "observed": f"connection dropped; server up: {up}; frames taken: {state['frames_pushed']}"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def _slow_client(ctx: Ctx) -> dict:
    """A client that sends its request headers a byte at a time and never finishes: others are still served."""
    host, port = ctx.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for byte in b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n":
            s.send(bytes([byte]))
            time.sleep(0.005)
        t0 = time.perf_counter()
        response = ctx.http.get("/healthz")
        took = time.perf_counter() - t0
    ok = response.status_code == 200 and took < 2.0
    return {"ok": ok, "observed": f"another client's /healthz: {response.status_code} in {took * 1000:.0f} ms"}


def _many_opens(ctx: Ctx, count: int = 500) -> dict:
    """`count` opens at once: each is opened (201) or refused (429 with Retry-After); none fails."""

    async def go():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=ctx.url, headers=ctx.http.headers, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(c.post("/v1/sessions", json={"budget": "256"}) for _ in range(count)),
                                        return_exceptions=True)

    responses = asyncio.run(go())
    codes = [str(r.status_code) if isinstance(r, httpx.Response) else type(r).__name__ for r in responses]
    for r in responses:
        if isinstance(r, httpx.Response) and r.status_code == 201:
            ctx.http.delete(f"/v1/sessions/{r.json()['id']}")
    retry = all(r.headers.get("retry-after") for r in responses if isinstance(r, httpx.Response)
                and r.status_code == 429)
    counts = {c: codes.count(c) for c in sorted(set(codes))}
    ok = set(codes) <= {"201", "429"} and 0 < codes.count("201") <= ctx.limits["max_sessions"] and retry
    return {"ok": ok, "observed": f"{counts}" + ("" if retry else "; a 429 without Retry-After")}


def _questions_over_limit(ctx: Ctx) -> httpx.Response:
    """More questions in flight than the server takes: untimed ones after one frame, each held while the one before
    it is answered (a session that has taken no frame refuses them with 409, so one frame goes first)."""
    sid = pushing(ctx)
    try:
        ctx.frame(sid, jpeg(), 0.0).raise_for_status()
        for _ in range(min(ctx.limits["max_questions"], ctx.limits["max_session_questions"])):
            _ask_and_leave(ctx, sid)
        return ctx.http.post(f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?", "stream": False})
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def _ask_and_leave(ctx: Ctx, sid: str) -> None:
    """Ask with a streamed answer and take only the response's head: the question stays in flight."""
    request = ctx.http.build_request("POST", f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?"})
    response = ctx.http.send(request, stream=True)
    response.close()


def _link_out(ctx: Ctx) -> httpx.Response:
    return ctx.http.post("/v1/sessions", json={"source": {"file": "outside.mp4", "realtime": False}})


def _open(**body):
    return lambda ctx: ctx.http.post("/v1/sessions", json=body)


def _raw_open(data: bytes, kind: str = "application/json"):
    return lambda ctx: ctx.http.post("/v1/sessions", content=data, headers={"content-type": kind})


def _source(**source):
    return _open(source={"realtime": False} | source)


def _video(data: bytes, kind: str = "video/mp4"):
    return lambda ctx: _on_session(ctx, lambda sid: ctx.http.post(f"/v1/sessions/{sid}/video", content=data,
                                                                  headers={"content-type": kind}))


def _ask(body: dict | bytes):
    def send(ctx):
        def call(sid):
            if isinstance(body, bytes):
                return ctx.http.post(f"/v1/sessions/{sid}/questions", content=body,
                                     headers={"content-type": "application/json"})
            return ctx.http.post(f"/v1/sessions/{sid}/questions", json=body)
        return _on_session(ctx, call)
    return send


def _chunked(size: int):
    """An upload with no Content-Length (chunked), larger than the limit."""
    def chunks():
        for _ in range(size // 65536):
            yield b"\xff" * 65536
    return lambda ctx: _on_session(ctx, lambda sid: ctx.http.post(
        f"/v1/sessions/{sid}/frames", params={"t": 0}, content=chunks(), headers={"content-type": "image/jpeg"}))


def _pulling_then_push(ctx: Ctx) -> httpx.Response:
    sid = ctx.open(source={"file": "bikes.mp4", "realtime": False})
    try:
        return ctx.frame(sid, jpeg(), 0.0)
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def _push_after_end(ctx: Ctx) -> httpx.Response:
    def call(sid):
        ctx.frame(sid, jpeg(), 0.0).raise_for_status()
        ctx.http.post(f"/v1/sessions/{sid}/end").raise_for_status()
        return ctx.frame(sid, jpeg(), 1.0)
    return _on_session(ctx, call)


def _bomb() -> bytes:
    """A PNG of 9000x9000 pixels in a few hundred kilobytes: decoding it would take 243 MB."""
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _mp4_bytes(cut: float = 1.0) -> bytes:
    data = Path(clip()).read_bytes()
    return data[: int(len(data) * cut)]


def _unauthorised(headers: dict):
    def send(ctx):
        with httpx.Client(base_url=ctx.url, headers=headers, timeout=30) as bare:
            return bare.post("/v1/sessions", json={})
    return send


ROWS = [
    # opening a session: the body
    Row("malformed JSON", 400, _raw_open(b'{"budget": 256,')),
    Row("JSON that is not an object", 422, _raw_open(b'[1, 2, 3]')),
    Row("empty body", 422, _raw_open(b"")),
    Row("body sent as text/plain", 422, _raw_open(b'{"budget": "256"}', "text/plain")),
    Row("fps is a word", 422, _open(fps="fast")),
    Row("fps negative", 422, _open(fps=-1)),
    Row("fps zero", 422, _open(fps=0)),
    Row("clip seconds zero", 422, _open(clip_seconds=0)),
    Row("max new tokens zero", 422, _open(max_new_tokens=0)),
    Row("max new tokens 100000", 422, _open(max_new_tokens=100000)),
    Row("unknown model", 400, _open(model="gpt-9")),
    Row("unknown policy", 400, _open(policy="fastest")),
    Row("budget is a word", 400, _open(budget="lots")),
    Row("budget below what the policy keeps", 400, _open(budget="3")),
    Row("window larger than the budget", 400, _open(budget="96", window=4096)),
    # sources: nothing outside the media folder
    Row("file with '..'", 403, _source(file="../../etc/passwd")),
    Row("absolute file path", 403, _source(file="/etc/passwd")),
    Row("link in the media folder leading out of it", 403, _link_out),
    Row("file not in the media folder", 404, _source(file="nothing-here.mp4")),
    Row("file that is a PNG", 400, _source(file="picture.png")),
    Row("file that is empty", 400, _source(file="empty.mp4")),
    Row("file and URL both", 400, _source(file="bikes.mp4", url="rtsp://127.0.0.1:1/x")),
    Row("file:// URL", 400, _source(url="file:///etc/passwd")),
    Row("ftp:// URL", 400, _source(url="ftp://127.0.0.1/x.mp4")),
    # sessions
    Row("unknown session", 404, lambda ctx: ctx.http.get("/v1/sessions/not-a-session")),
    Row("closed session: state", 404, lambda ctx: _closed(ctx, lambda sid: ctx.http.get(f"/v1/sessions/{sid}"))),
    Row("closed session: question", 404, lambda ctx: _closed(ctx, lambda sid: ctx.http.post(
        f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?"}))),
    Row("closed session: frame", 404, lambda ctx: _closed(ctx, lambda sid: ctx.frame(sid, jpeg(), 0.0))),
    Row("closed session: closed again", 404, lambda ctx: _closed(ctx, lambda sid: ctx.http.delete(
        f"/v1/sessions/{sid}"))),
    Row("session id with '../'", 404, lambda ctx: ctx.http.get("/v1/sessions/..%2F..%2Fhealthz")),
    # frames
    Row("frame without its time", 422, lambda ctx: _on_session(ctx, lambda sid: ctx.http.post(
        f"/v1/sessions/{sid}/frames", content=jpeg(), headers={"content-type": "image/jpeg"}))),
    Row("frame time negative", 400, lambda ctx: _pushed_then(ctx, jpeg(), -1.0)),
    Row("frame time going back", 400, lambda ctx: _pushed_then(ctx, jpeg(), 1.0, first=2.0)),
    Row("frame time the same again", 400, lambda ctx: _pushed_then(ctx, jpeg(), 2.0, first=2.0)),
    Row("frame bytes that are no image", 400, lambda ctx: _pushed_then(ctx, os.urandom(3000), 0.0)),
    Row("frame JPEG cut short", 400, lambda ctx: _pushed_then(ctx, jpeg(640, 480)[:700], 0.0)),
    Row("frame that is a GIF", 415, lambda ctx: _pushed_then(ctx, hostile.image("GIF"), 0.0)),
    Row("frame as text/plain", 415, lambda ctx: _pushed_then(ctx, jpeg(), 0.0, "text/plain")),
    Row("frame with no content type", 415, lambda ctx: _pushed_then(ctx, jpeg(), 0.0, "")),
    Row("frame body empty", 400, lambda ctx: _pushed_then(ctx, b"", 0.0)),
    Row("frame over the upload limit", 413, lambda ctx: _pushed_then(ctx, os.urandom(2 * 2**20), 0.0)),
    Row("frame over the limit, chunked", 413, _chunked(3 * 2**20)),
    Row("frame of 81 megapixels in a small PNG", 413, lambda ctx: _pushed_then(ctx, _bomb(), 0.0, "image/png")),
    Row("frame cut off mid-upload, connection closed", 0, _truncated_upload),
    Row("frame to a session that pulls a file", 409, _pulling_then_push),
    Row("frame after the stream's end", 409, _push_after_end),
    # video chunks
    Row("video bytes that are no video", 400, _video(os.urandom(4000))),
    Row("video cut to its first tenth", 400, _video(_mp4_bytes(0.1))),
    Row("video as image/jpeg", 415, _video(_mp4_bytes(), "image/jpeg")),
    # questions
    Row("question with empty text", 422, _ask({"text": ""})),
    Row("question of 5000 characters", 422, _ask({"text": "what " * 1000})),
    Row("question at a negative time", 422, _ask({"text": "what is on screen?", "at": -3})),
    Row("question as malformed JSON", 400, _ask(b'{"text": ')),
    Row("questions past the in-flight limit", 429, _questions_over_limit),
    # the door
    Row("no bearer token", 401, _unauthorised({})),
    Row("wrong bearer token", 401, _unauthorised({"Authorization": "Bearer guess"})),
    Row("metrics without the token", 401, lambda ctx: httpx.get(f"{ctx.url}/metrics")),
    Row("method not allowed", 405, lambda ctx: ctx.http.put("/v1/sessions")),
    Row("unknown route", 404, lambda ctx: ctx.http.get("/v2/everything")),
    Row("slow client holding a connection", 0, _slow_client),
    Row("500 opens at once", 0, _many_opens),
]
ROWS += hostile.rows(Row, _pushed_then)
ROWS += edges.rows(Row)
ROWS += watches.rows(Row)


def judge(row: Row, result) -> dict:
    """A row passes on its status, a JSON body {"error": one line} with no traceback, and the server up after."""
    if isinstance(result, dict):
        return {"ok": result["ok"], "observed": result["observed"]}
    statuses = row.status if isinstance(row.status, tuple) else (row.status,)
    text = result.text
    try:
        body = result.json()
        line = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        line = None
    clean = line is not None and "\n" not in line and "Traceback" not in text
    retry = result.status_code != 429 or bool(result.headers.get("retry-after"))
    ok = result.status_code in statuses and clean and retry
    return {"ok": ok, "observed": f"{result.status_code}: {(line or text)[:160]}"
            + ("" if retry else " [no Retry-After]")}


def run_rows(url: str, media: Path, only: str | None = None, pid: int | None = None,
             limits: dict | None = None, each: Callable | None = None) -> list[dict]:
    """Every row against the server at `url` (its process `pid`, started with `limits`); each row's result, and
    whether the server answered after it (`each(row)` called as each is done)."""
    import re

    rows = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        ctx = Ctx(http, url, media, pid, LIMITS | (limits or {}))
        for row in ROWS:
            if only and not re.search(only, row.name):
                continue
            try:
                outcome = judge(row, row.send(ctx))
            except Exception as err:  # the row's own request failed: that is its observation
                outcome = {"ok": False, "observed": f"{type(err).__name__}: {str(err)[:160]}"}
            try:
                up = http.get("/healthz").status_code == 200
            except httpx.HTTPError:
                up = False
            expected = (f"{row.status}" if row.status else "see observed") + ", one JSON line, server up"
            rows.append({"input": f"server: {row.name}", "where": "server", "expected": expected,
                         "observed": outcome["observed"] + ("" if up else " [SERVER DOWN]"),
                         "ok": outcome["ok"] and up})
            if each is not None:
                each(rows[-1])
    return rows
