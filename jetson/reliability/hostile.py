"""The hostile rows of the server's reliability table (issue 61): frames that announce more than they carry, requests
past their limits, one client holding the others' question slots, and (from `forgery.py`) server-side request
forgery through a source URL; `rows` puts them in the order of the committed results."""

import io
import struct
import threading
import time
import zlib

import httpx
import numpy as np
from PIL import Image

from streaming.remote import encoded

from . import forgery


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
    return image("PNG", w=width, h=height)


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


class Weighed:
    """The server process's CPU seconds and its peak RSS (sampled every 5 ms) while a block runs."""

    def __init__(self, pid: int):
        import psutil

        self.process = psutil.Process(pid)

    def __enter__(self):
        self.cpu0, self.rss0 = sum(self.process.cpu_times()[:2]), self.process.memory_info().rss
        self.peak, self.done = self.rss0, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self.done.set()
        self.cpu_s = sum(self.process.cpu_times()[:2]) - self.cpu0
        self.rise_mb = (self.peak - self.rss0) / 2**20


def accepted(data: bytes, kind: str = "image/png", then_ask: bool = False):
    """A frame a real camera may send (any JPEG/PNG flavour, a tiny size): taken (202); with `then_ask`, three of
    them, the stream ended and a question answered, the server's CPU and peak RSS for it all reported."""
    def send(ctx):
        sid = ctx.open(budget="256", clip_seconds=2.0)
        try:
            with Weighed(ctx.pid) as cost:
                codes = [ctx.frame(sid, data, t, kind).status_code for t in ((0.0, 1.0, 2.0) if then_ask else (0.0,))]
                answer = None
                if then_ask:
                    ctx.http.post(f"/v1/sessions/{sid}/end")
                    answer = ctx.http.post(f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?",
                                                                                   "stream": False})
            ok = set(codes) == {202} and (answer is None or (answer.status_code == 200 and answer.json()["answer"]))
            said = "" if answer is None else f"; answer {answer.status_code}: {answer.text[:60]}"
            return {"ok": ok, "observed": f"frames {codes}{said}; server CPU {cost.cpu_s * 1000:.0f} ms, "
                                          f"RSS +{cost.rise_mb:.1f} MB"}
        finally:
            ctx.http.delete(f"/v1/sessions/{sid}")
    return send


def thin_frames(ctx) -> dict:
    """The issue's 94-byte frame (a 1x2000 PNG), three of them: refused before decoding, < 100 ms of CPU and
    < 20 MB each."""
    data = strip(1, 2000)
    sid = ctx.open(budget="256")
    try:
        with Weighed(ctx.pid) as cost:
            codes = [ctx.frame(sid, data, t, "image/png").status_code for t in (0.0, 1.0, 2.0)]
        ok = codes == [422] * 3 and cost.cpu_s / 3 < 0.1 and cost.rise_mb < 20
        return {"ok": ok, "observed": f"{len(data)}-byte frames {codes}; server CPU {cost.cpu_s / 3 * 1000:.0f} ms "
                                      f"a frame, RSS +{cost.rise_mb:.1f} MB"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def decoded_flood(ctx) -> dict:
    """48 small PNGs that decode to 7.3 MB each, pushed inside one clip as fast as the server takes them: each
    taken (202) or refused for now (429), the session's RSS bounded by its decoded-bytes budget (64 MB)."""
    buf = io.BytesIO()
    Image.new("RGB", (1900, 1280), (40, 90, 160)).save(buf, "PNG")
    data = buf.getvalue()
    sid = ctx.open(budget="256", clip_seconds=60.0, fps=10.0)  # every frame is due: the clip holds them all
    try:
        with Weighed(ctx.pid) as cost:
            codes = [ctx.frame(sid, data, i * 0.1, "image/png").status_code for i in range(48)]
        counts = {c: codes.count(c) for c in sorted(set(codes))}
        ok = set(codes) <= {202, 429} and cost.rise_mb < 120
        return {"ok": ok, "observed": f"{len(data)}-byte PNGs: {counts}; server RSS +{cost.rise_mb:.0f} MB at its "
                                      f"peak (unbounded: 48 x 7.3 = 350 MB)"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def ends_waiting(ctx) -> dict:
    """A question at a video time the stream never reaches: `waiting` at once, then, when the stream ends short of
    it, an end that says so (not a hang)."""
    sid = ctx.open(budget="256", clip_seconds=1.0)
    try:
        ctx.frame(sid, encoded(np.full((48, 64, 3), 100, np.uint8)), 0.0)
        with ctx.http.stream("POST", f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?",
                                                                           "at": 500}) as response:
            lines = response.iter_lines()
            first = next(lines, "")
            ctx.http.post(f"/v1/sessions/{sid}/end")
            t0 = time.monotonic()
            rest = [line for line in lines if line.startswith(("event:", "data:"))]
            took = time.monotonic() - t0
        said = " ".join(rest)[-160:]
        ok = first.startswith("event: waiting") and "event: error" in said and "ended at" in said and took < 30
        return {"ok": ok, "observed": f"first {first!r}; after the end, in {took:.1f} s: {said}"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def long_request_line(ctx) -> dict:
    """A request line of 100 KB (a path no route has), sent on a raw socket: refused by the HTTP parser or as
    404/414, never a 500."""
    import socket

    host, port = ctx.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(b"GET /v1/sessions/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            head = s.recv(200).split(b"\r\n", 1)[0].decode("latin-1")
        except OSError as err:  # the server may close the connection mid-request
            head = type(err).__name__
    up = ctx.http.get("/healthz").status_code == 200
    return {"ok": " 200 " not in head and " 500 " not in head and up, "observed": f"{head or 'closed'}; server up: "
                                                                                   f"{up}"}


def image(kind: str, mode: str = "RGB", w: int = 64, h: int = 48, **save) -> bytes:
    """A plain image in `kind` (PNG, JPEG, GIF…) of `mode` (RGB, L, I;16, P, RGBA, CMYK)."""
    buf = io.BytesIO()
    Image.new(mode, (w, h), 120 if mode in ("L", "I;16", "P") else (120,) * len(mode)).save(buf, kind, **save)
    return buf.getvalue()


def rows(Row, pushed_then) -> list:
    """The hostile rows (`Row` and the frame helper come from `server.py`, which adds these to its table), in the
    order of the committed results."""
    return [
        *forgery.rows(Row), *_requests(Row), *_frames(Row, pushed_then),
        # fairness: one client's waiting questions are its own
        Row("far-future questions past a session's limit, while another asks", 0,
            lambda ctx: far_future(ctx, ctx.limits["max_session_questions"])),
        *forgery.forms(Row), *forgery.hops(Row), *_requests_more(Row), *_frames_more(Row, pushed_then),
        # fairness: a wait that cannot end says so
        Row("a question waiting for a time the stream never reaches", 0, ends_waiting),
    ]


def _requests(Row) -> list:
    """Requests: unknown fields, numbers that are no numbers, sizes."""
    return [
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
    ]


def _frames(Row, pushed_then) -> list:
    """Frames: what they announce is checked before a pixel is decoded."""
    return [
        Row("PNG announcing 20000x20000", 413, lambda ctx: pushed_then(ctx, png_announcing(20000, 20000), 0.0,
                                                                       "image/png")),
        Row("PNG announcing 65500x65500", 413, lambda ctx: pushed_then(ctx, png_announcing(65500, 65500), 0.0,
                                                                       "image/png")),
        Row("JPEG announcing 65500x65500", 413, lambda ctx: pushed_then(ctx, jpeg_announcing(65500, 65500), 0.0)),
        Row("PNG announcing 0x0", 400, lambda ctx: pushed_then(ctx, png_announcing(0, 0), 0.0, "image/png")),
        Row("PNG of 1x2000", 422, lambda ctx: pushed_then(ctx, strip(1, 2000), 0.0, "image/png")),
        Row("PNG of 2000x1", 422, lambda ctx: pushed_then(ctx, strip(2000, 1), 0.0, "image/png")),
        Row("frames of two sizes in one clip", 0, two_sizes),
    ]


def _requests_more(Row) -> list:
    """Requests: more numbers and shapes."""
    return [
        Row("bias 1e308", 400, raw_json("/s", '{"policy": "inf_mllm", "bias": 1e308}')),
        Row("window negative", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"window": -1})),
        Row("max new tokens 3.5", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"max_new_tokens": 3.5})),
        Row("fps 1e9", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"fps": 1e9})),
        Row("clip seconds 1e9", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"clip_seconds": 1e9})),
        Row("loops 10^9", 422, lambda ctx: ctx.http.post("/v1/sessions", json={"source": {"file": "bikes.mp4",
                                                                                      "loops": 10**9}})),
        Row("question at 10^12 s", 422, raw_json("/q", '{"text": "what?", "at": 1e12}')),
        Row("question text a number", 422, raw_json("/q", '{"text": 42}')),
        Row("JSON nested 10000 deep", (400, 422), raw_json("/s", "[" * 10000 + "]" * 10000)),
        Row("JSON nested 30000 deep", (400, 422), raw_json("/s", "[" * 30000 + "]" * 30000)),
        Row("a request line of 100 KB", 0, long_request_line),
    ]


def _frames_more(Row, pushed_then) -> list:
    """Frames: what cameras send is taken, in bounded time; what they do not is refused before decoding."""
    return [
        Row("PNG announcing 8193x1000 (a side past 8192)", 413, lambda ctx: pushed_then(
            ctx, png_announcing(8193, 1000), 0.0, "image/png")),
        Row("PNG of 900x100 (9:1)", 422, lambda ctx: pushed_then(ctx, strip(900, 100), 0.0, "image/png")),
        Row("the 94-byte 1x2000 PNG, three times: CPU and RSS", 0, thin_frames),
        Row("PNG of 1x1, three frames, then a question", 0, accepted(strip(1, 1), then_ask=True)),
        Row("PNG of 1x8, three frames, then a question", 0, accepted(strip(1, 8), then_ask=True)),
        Row("PNG of 16-bit grey", 0, accepted(image("PNG", "I;16"))),
        Row("PNG of 8-bit grey", 0, accepted(image("PNG", "L"))),
        Row("PNG with alpha", 0, accepted(image("PNG", "RGBA"))),
        Row("PNG with a palette", 0, accepted(image("PNG", "P"))),
        Row("JPEG in CMYK", 0, accepted(image("JPEG", "CMYK"), "image/jpeg")),
        Row("JPEG progressive", 0, accepted(image("JPEG", progressive=True), "image/jpeg")),
        Row("JPEG grey", 0, accepted(image("JPEG", "L"), "image/jpeg")),
        Row("a JPEG sent as image/png", 0, accepted(image("JPEG"), "image/png")),
        Row("WebP frame", 415, lambda ctx: pushed_then(ctx, image("WEBP"), 0.0, "image/png")),
        Row("BMP frame", 415, lambda ctx: pushed_then(ctx, image("BMP"), 0.0, "image/png")),
        Row("TIFF frame", 415, lambda ctx: pushed_then(ctx, image("TIFF"), 0.0, "image/png")),
        Row("48 PNGs decoding to 7.3 MB each in one clip", 0, decoded_flood),
    ]
