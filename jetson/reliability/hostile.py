"""The hostile rows of the server's reliability table (issue 61): server-side request forgery through a source URL,
frames that announce more than they carry, requests past their limits, one client holding the others' question
slots. Every listener here is on loopback (127.0.0.1, which the table's server allows as a camera host, and
127.0.0.2, which it does not) and counts what reaches it: a refused place must count 0."""

import http.server
import io
import struct
import threading
import time
import zlib
from contextlib import contextmanager

import httpx
import numpy as np
from PIL import Image

from streaming.remote import encoded


class _Counting(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    hits: list

    def do_GET(self):  # noqa: N802 (the standard library's name)
        self.hits.append(self.path)
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        wanted = self.headers.get("Range", "")
        if status == 200 and wanted.startswith("bytes="):  # FFmpeg seeks in a video served over HTTP
            first, _, last = wanted[6:].partition("-")
            start, end = int(first or 0), min(int(last) if last else len(body) - 1, len(body) - 1)
            headers = headers | {"Content-Range": f"bytes {start}-{end}/{len(body)}"}
            status, body = 206, body[start:end + 1]
        self.send_response(status)
        for key, value in (headers | {"Accept-Ranges": "bytes"}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@contextmanager
def listener(host: str, routes: dict | None = None):
    """An HTTP server on `host` (loopback) that records every path asked of it: yields (base URL, hits)."""
    handler = type("Handler", (_Counting,), {"routes": routes or {}, "hits": []})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}", handler.hits
    finally:
        server.shutdown()
        server.server_close()


def _open_url(ctx, url: str) -> httpx.Response:
    return ctx.http.post("/v1/sessions", json={"source": {"url": url, "realtime": False}})


def ssrf(target: str, path: str = "/x.mp4", via: str | None = None, secret: str | None = None):
    """Open a session on a URL the policy must refuse: `target` is where the request must never arrive (its host,
    a listener started here when it is loopback); `via` a route of an allowed listener that leads there (a redirect,
    a playlist). Passes on 400, 0 hits at the target, and `secret` (a password) absent from the answer."""
    def send(ctx):
        with listener("127.0.0.2") as (inside, inside_hits):
            aim = target.replace("INSIDE", inside)
            routes = {}
            if via == "redirect":
                routes = {"/go": (302, {"Location": aim + path}, b"")}
            elif via == "playlist":
                body = f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2,\n{aim}{path}\n".encode()
                routes = {"/go": (200, {"Content-Type": "application/vnd.apple.mpegurl"}, body)}
            with listener("127.0.0.1", routes) as (outside, _):
                url = f"{outside}/go" if via else aim + path
                response = _open_url(ctx, url)
                time.sleep(0.2)
            answer = response.text
            ok = response.status_code == 400 and not inside_hits and (secret is None or secret not in answer)
            return {"ok": ok, "observed": f"{response.status_code}: {answer[:140]}; requests that reached the "
                                          f"refused place: {len(inside_hits)}"}
    return send


def png_announcing(width: int, height: int) -> bytes:
    """A tiny PNG whose header says `width`×`height` (its data is one row's worth: a decoder would expand it)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def jpeg_announcing(width: int, height: int) -> bytes:
    """A small real JPEG with its frame header's size rewritten to `width`×`height`."""
    data = bytearray(encoded(np.full((16, 16, 3), 90, np.uint8)))
    at = data.index(b"\xff\xc0")
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def strip(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def two_sizes(ctx) -> dict:
    """A camera that switches resolution inside a clip: both frames taken, the question answered."""
    sid = ctx.open(budget="256", clip_seconds=2.0)
    try:
        codes = [ctx.frame(sid, encoded(np.full((h, w, 3), 100, np.uint8)), t).status_code
                 for t, (w, h) in enumerate([(64, 48), (64, 48), (320, 240), (320, 240), (64, 48)])]
        ctx.http.post(f"/v1/sessions/{sid}/end")
        answer = ctx.http.post(f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?", "stream": False})
        ok = codes == [202] * 5 and answer.status_code == 200 and bool(answer.json().get("answer"))
        return {"ok": ok, "observed": f"frames {codes}; question {answer.status_code}: {answer.text[:80]}"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def far_future(ctx, limit: int) -> dict:
    """One session asks `limit` questions at a video time it will not reach: its next is refused (429), while
    another session's question is still answered (not 429: the waiting ones hold no server slot)."""
    hog, other = ctx.open(budget="256"), ctx.open(budget="256", clip_seconds=1.0)
    streams = []
    try:
        for _ in range(limit):
            streams.append(ctx.http.build_request("POST", f"/v1/sessions/{hog}/questions",
                                                  json={"text": "what is on screen?", "at": 99999}))
            response = ctx.http.send(streams[-1], stream=True)
            first = next(response.iter_lines(), "")
            streams[-1] = response
        over = ctx.http.post(f"/v1/sessions/{hog}/questions", json={"text": "is there a car?", "at": 99999})
        ctx.frame(other, encoded(np.full((48, 64, 3), 100, np.uint8)), 0.0)
        ctx.http.post(f"/v1/sessions/{other}/end")
        theirs = ctx.http.post(f"/v1/sessions/{other}/questions", json={"text": "what is on screen?",
                                                                       "stream": False})
        ok = over.status_code == 429 and theirs.status_code == 200 and first.startswith("event: waiting")
        return {"ok": ok, "observed": f"first event {first!r}; the hog's next: {over.status_code}; another "
                                      f"session's: {theirs.status_code}"}
    finally:
        for response in streams:
            response.close()
        ctx.http.delete(f"/v1/sessions/{hog}")
        ctx.http.delete(f"/v1/sessions/{other}")


def many_headers(count: int):
    return lambda ctx: ctx.http.get("/healthz", headers={f"x-h{i}": "1" for i in range(count)})


def huge_header(ctx) -> dict:
    try:
        response = ctx.http.get("/healthz", headers={"x-big": "a" * 200_000})
        code = response.status_code
    except httpx.HTTPError as err:  # the parser may close the connection instead of answering
        code = type(err).__name__
    up = ctx.http.get("/healthz").status_code == 200
    return {"ok": code != 200 and code != 500 and up, "observed": f"{code}; server up: {up}"}


def big_json(size: int, chunked: bool = False):
    body = b'{"budget": "256", "policy": "' + b"x" * size + b'"}'

    def send(ctx):
        content = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
        return ctx.http.post("/v1/sessions", content=content, headers={"content-type": "application/json"})
    return send


def raw_json(path: str, text: str):
    def send(ctx):
        if path.startswith("/q"):
            sid = ctx.open(budget="256")
            try:
                return ctx.http.post(f"/v1/sessions/{sid}/questions", content=text.encode(),
                                     headers={"content-type": "application/json"})
            finally:
                ctx.http.delete(f"/v1/sessions/{sid}")
        return ctx.http.post("/v1/sessions", content=text.encode(), headers={"content-type": "application/json"})
    return send


def rows(Row, pushed_then, limits: dict) -> list:
    """The hostile rows (`Row` and the frame helper come from `server.py`, which adds these to its table)."""
    return [
        # server-side request forgery: nothing reaches a refused place, whichever field or hop leads there
        Row("URL to a loopback listener", 0, ssrf("INSIDE")),
        Row("URL to localhost by name", 0, ssrf("http://localhost:9")),
        Row("URL to [::1]", 0, ssrf("http://[::1]:9")),
        Row("URL to a private address", 0, ssrf("http://10.20.30.40")),
        Row("URL to the link-local metadata address", 0, ssrf("http://169.254.169.254", "/latest/meta-data")),
        Row("URL to 0.0.0.0", 0, ssrf("http://0.0.0.0:9")),
        Row("URL to a multicast address", 0, ssrf("rtsp://239.1.2.3")),
        Row("RTSP URL to loopback", 0, ssrf("rtsp://127.0.0.2:8554", "/cam")),
        Row("URL redirected to a loopback listener", 0, ssrf("INSIDE", via="redirect")),
        Row("URL redirected to a file:", 0, ssrf("file:///etc", "/passwd", via="redirect")),
        Row("HLS playlist with an entry on a loopback listener", 0, ssrf("INSIDE", "/seg.ts", via="playlist")),
        Row("HLS playlist with a file: entry", 0, ssrf("file:///etc", "/passwd", via="playlist")),
        Row("URL with credentials, refused: no password echoed", 0,
            ssrf("http://admin:hunter2@10.0.0.9", secret="hunter2")),
        Row("URL with a broken IPv6 literal", 400, lambda ctx: _open_url(ctx, "http://[::1/x")),
        Row("URL with a port past 65535", 400, lambda ctx: _open_url(ctx, "http://8.8.8.8:99999/x")),
        Row("URL of 3000 characters", 422, lambda ctx: _open_url(ctx, "http://a.example/" + "x" * 3000)),
        Row("data: URL", 400, lambda ctx: _open_url(ctx, "data:video/mp4;base64,AAAA")),
        # requests: unknown fields, numbers that are no numbers, sizes
        Row("misspelt field 'bugdet'", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"bugdet": "256"})),
        Row("misspelt field 'fsp'", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"fsp": 2})),
        Row("misspelt source field", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"source": {"fiel": "x"}})),
        Row("misspelt question field", 422, raw_json("/q", '{"txt": "what is on screen?"}')),
        Row("bias NaN", 422, raw_json("/s", '{"bias": NaN}')),
        Row("bias Infinity", 422, raw_json("/s", '{"bias": Infinity}')),
        Row("fps NaN", 422, raw_json("/s", '{"fps": NaN}')),
        Row("clip seconds -Infinity", 422, raw_json("/s", '{"clip_seconds": -Infinity}')),
        Row("question at Infinity", 422, raw_json("/q", '{"text": "what?", "at": Infinity}')),
        Row("question at NaN", 422, raw_json("/q", '{"text": "what?", "at": NaN}')),
        Row("budget of 100 characters", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"budget": "9" * 100})),
        Row("file name of 300 characters", 422, lambda ctx: ctx.http.post(
            "/v1/sessions", json={"source": {"file": "a" * 300 + ".mp4"}})),
        Row("JSON body of 2 MB", 413, big_json(2 * 2**20)),
        Row("JSON body of 2 MB, chunked", 413, big_json(2 * 2**20, chunked=True)),
        Row("200 headers", 431, many_headers(200)),
        Row("a 200 KB header", 0, huge_header),
        # frames: what they announce is checked before a pixel is decoded
        Row("PNG announcing 20000x20000", 413, lambda ctx: pushed_then(ctx, png_announcing(20000, 20000), 0.0,
                                                                       "image/png")),
        Row("PNG announcing 65500x65500", 413, lambda ctx: pushed_then(ctx, png_announcing(65500, 65500), 0.0,
                                                                       "image/png")),
        Row("JPEG announcing 65500x65500", 413, lambda ctx: pushed_then(ctx, jpeg_announcing(65500, 65500), 0.0)),
        Row("PNG announcing 0x0", 400, lambda ctx: pushed_then(ctx, png_announcing(0, 0), 0.0, "image/png")),
        Row("PNG of 1x2000", 422, lambda ctx: pushed_then(ctx, strip(1, 2000), 0.0, "image/png")),
        Row("PNG of 2000x1", 422, lambda ctx: pushed_then(ctx, strip(2000, 1), 0.0, "image/png")),
        Row("frames of two sizes in one clip", 0, two_sizes),
        # fairness: one client's waiting questions are its own
        Row("far-future questions past a session's limit, while another asks", 0,
            lambda ctx: far_future(ctx, limits["max_session_questions"])),
    ]
