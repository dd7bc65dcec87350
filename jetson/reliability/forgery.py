"""The server-side request forgery rows of the server's reliability table (issue 61): a source URL that leads to a
refused place, by its address, its number forms, its scheme, a redirect, a playlist, its key or map, a DASH manifest,
or a live playlist's later reload. Every listener here is on loopback (127.0.0.1, which the table's server allows as
a camera host, and 127.0.0.2, which it does not) and counts what reaches it: a refused place must count 0."""

import http.server
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np


class _Counting(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    hits: list

    def do_GET(self):  # noqa: N802 (the standard library's name)
        self.hits.append(self.path)
        served = self.routes.get(self.path, (404, {}, b""))
        if isinstance(served, list):  # answers in turn, the last one from then on (a live playlist's reloads)
            served = served[min(self.hits.count(self.path), len(served)) - 1]
        status, headers, body = served
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
        """Quiet: every request is in `hits`."""


@contextmanager
def listener(host: str, routes: dict | None = None):
    """An HTTP server on `host` (loopback) that records every path asked of it: yields (base URL, hits). `routes`
    ({path: (status, headers, body)}) is served as it is when asked: it may be filled after the start."""
    handler = type("Handler", (_Counting,), {"routes": {} if routes is None else routes, "hits": []})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}", handler.hits
    finally:
        server.shutdown()
        server.server_close()


def _open_url(ctx, url: str) -> httpx.Response:
    return ctx.http.post("/v1/sessions", json={"source": {"url": url, "realtime": False}})


def _playlist(*lines: str) -> tuple:
    body = "\n".join(["#EXTM3U", "#EXT-X-TARGETDURATION:2", *lines]) + "\n"
    return 200, {"Content-Type": "application/vnd.apple.mpegurl"}, body.encode()


def _routes(via: str | None, aim: str, outside: str) -> dict:
    """What the allowed listener serves at /go for each way of leading to `aim` (the refused place)."""
    seg = "#EXTINF:2,"
    return {
        None: {},
        "redirect": {"/go": (302, {"Location": aim}, b"")},
        "redirect 307": {"/go": (307, {"Location": aim}, b"")},
        "redirect 308": {"/go": (308, {"Location": aim}, b"")},
        "redirect chain": {"/go": (302, {"Location": "/hop"}, b""), "/hop": (301, {"Location": aim}, b"")},
        "playlist": {"/go": _playlist(seg, aim)},
        "playlist key": {"/go": _playlist(f'#EXT-X-KEY:METHOD=AES-128,URI="{aim}"', seg, f"{outside}/seg.ts")},
        "playlist map": {"/go": _playlist(f'#EXT-X-MAP:URI="{aim}"', seg, f"{outside}/seg.ts")},
        "master playlist": {"/go": _playlist("#EXT-X-STREAM-INF:BANDWIDTH=1000", "/variant.m3u8"),
                            "/variant.m3u8": _playlist(seg, aim)},
        "dash": {"/go": (200, {"Content-Type": "application/dash+xml"},
                         f'<?xml version="1.0"?><MPD><Period><BaseURL>{aim}</BaseURL></Period></MPD>'.encode())},
        "redirect to a playlist": {"/go": (302, {"Location": "/list.m3u8"}, b""), "/list.m3u8": _playlist(seg, aim)},
    }[via]


def ssrf(target: str, path: str = "/x.mp4", via: str | None = None, secret: str | None = None):
    """Open a session on a URL the policy must refuse: `target` is where the request must never arrive (its host;
    INSIDE is a listener started here on 127.0.0.2, PORT its port); `via` how an allowed listener (127.0.0.1) leads
    there (redirects, playlists, their keys and maps, a DASH manifest). Passes on 400, 0 hits at the target, and
    `secret` (a password) absent from the answer."""
    def send(ctx):
        with listener("127.0.0.2") as (inside, inside_hits):
            aim = target.replace("INSIDE", inside).replace("PORT", inside.rsplit(":", 1)[1]) + path
            routes = {}  # filled once the listener's own URL is known (a playlist may name it)
            with listener("127.0.0.1", routes) as (outside, _):
                routes.update(_routes(via, aim, outside))
                url = f"{outside}/go" if via else aim
                response = _open_url(ctx, url)
                time.sleep(0.2)
            answer = response.text
            ok = response.status_code == 400 and not inside_hits and (secret is None or secret not in answer)
            return {"ok": ok, "observed": f"{response.status_code}: {answer[:140]}; requests that reached the "
                                          f"refused place: {len(inside_hits)}"}
    return send


def ts_segment(seconds: int = 4, fps: float = 2.0) -> bytes:
    """A real MPEG-TS segment (MPEG-4 video, 64x48), as an HLS camera serves them."""
    import cv2

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "seg.ts")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
        for i in range(int(seconds * fps)):
            writer.write(np.full((48, 64, 3), 30 * i % 255, np.uint8))
        writer.release()
        return Path(path).read_bytes()


def ssrf_later(via: str):
    """A URL whose first look is clean, on the allowed listener, that leads to the refused place only once FFmpeg
    reads on: an HLS segment that redirects there, or a live playlist whose reload names it. Passes when nothing
    reaches the refused place within 4 s (the session opened or refused)."""
    def send(ctx):
        with listener("127.0.0.2") as (inside, inside_hits):
            video = ts_segment()
            routes = {}
            with listener("127.0.0.1", routes) as (outside, outside_hits):
                seg = f"#EXTINF:2,\n{outside}/seg.ts"
                if via == "segment redirect":
                    routes.update({"/go.m3u8": _playlist(seg, "#EXT-X-ENDLIST"),
                                   "/seg.ts": (302, {"Location": f"{inside}/seg.ts"}, b"")})
                else:  # a live playlist: clean when first read, a refused entry on FFmpeg's reloads
                    later = _playlist("#EXT-X-MEDIA-SEQUENCE:1", f"#EXTINF:2,\n{inside}/seg2.ts")
                    routes.update({"/go.m3u8": [_playlist(seg), _playlist(seg), later],
                                   "/seg.ts": (200, {"Content-Type": "video/mp2t"}, video)})
                response = _open_url(ctx, f"{outside}/go.m3u8")
                if response.status_code == 201:
                    time.sleep(4.0)
                    ctx.http.delete(f"/v1/sessions/{response.json()['id']}")
            return {"ok": response.status_code in (201, 400) and not inside_hits,
                    "observed": f"{response.status_code}: {response.text[:100]}; requests to the allowed host: "
                                f"{len(outside_hits)}, to the refused place: {len(inside_hits)}"}
    return send


def rows(Row) -> list:
    """Server-side request forgery: nothing reaches a refused place, whichever field or hop leads there."""
    return [
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
    ]


def forms(Row) -> list:
    """More ways to name a refused place: number forms of 127.0.0.2, every non-public range, other schemes."""
    return [
        Row("URL to 127.0.0.2 as one decimal number", 0, ssrf("http://2130706434:PORT")),
        Row("URL to 127.0.0.2 in hexadecimal", 0, ssrf("http://0x7f000002:PORT")),
        Row("URL to 127.0.0.2 in octal", 0, ssrf("http://0177.0.0.2:PORT")),
        Row("URL to 127.0.0.2 shortened to 127.2", 0, ssrf("http://127.2:PORT")),
        Row("URL to 127.0.0.2 as an IPv4-mapped IPv6 address", 0, ssrf("http://[::ffff:127.0.0.2]:PORT")),
        Row("URL with credentials to a loopback listener", 0, ssrf("http://admin:s3cr3t@127.0.0.2:PORT",
                                                                   secret="s3cr3t")),
        *[Row(f"URL to {name}", 0, ssrf(f"http://{host}")) for name, host in (
            ("172.16.0.1 (private)", "172.16.0.1"), ("192.168.1.1 (private)", "192.168.1.1"),
            ("100.64.0.1 (shared address space)", "100.64.0.1"), ("198.18.0.1 (benchmarking)", "198.18.0.1"),
            ("240.0.0.1 (reserved)", "240.0.0.1"), ("255.255.255.255 (broadcast)", "255.255.255.255"),
            ("[fc00::1] (unique local)", "[fc00::1]"), ("[fe80::1] (link-local)", "[fe80::1]"),
            ("[::] (unspecified)", "[::]"), ("[ff02::1] (multicast)", "[ff02::1]"),
            ("[::ffff:10.0.0.1] (mapped private)", "[::ffff:10.0.0.1]"))],
        *[Row(f"{scheme} URL", 400, lambda ctx, u=url: _open_url(ctx, u)) for scheme, url in (
            ("gopher://", "gopher://127.0.0.2:70/_x"), ("rtmp://", "rtmp://127.0.0.2/live"),
            ("tcp://", "tcp://127.0.0.2:80"), ("udp://", "udp://127.0.0.2:5000"),
            ("concat:", "concat:/etc/passwd|/etc/hosts"), ("subfile:", "subfile,,start,0,end,0,,:/etc/passwd"),
            ("hls+http://", "hls+http://127.0.0.2/x.m3u8"), ("async:", "async:http://127.0.0.2/x"),
            ("pipe:", "pipe:0"), ("crypto+http://", "crypto+http://127.0.0.2/x"), ("srt://", "srt://127.0.0.2:9000"),
            ("scheme-less path", "/etc/passwd"))],
    ]


def hops(Row) -> list:
    """More ways to lead there from an allowed host."""
    return [
        Row("URL redirected (307) to a loopback listener", 0, ssrf("INSIDE", via="redirect 307")),
        Row("URL redirected (308) to a loopback listener", 0, ssrf("INSIDE", via="redirect 308")),
        Row("URL redirected twice, then to a loopback listener", 0, ssrf("INSIDE", via="redirect chain")),
        Row("URL redirected to a loopback listener in IPv4-mapped form", 0,
            ssrf("http://[::ffff:127.0.0.2]:PORT", via="redirect")),
        Row("URL redirected to RTSP on loopback", 0, ssrf("rtsp://127.0.0.2:PORT", "/cam", via="redirect")),
        Row("URL redirected to gopher://", 0, ssrf("gopher://127.0.0.2:PORT", "/_x", via="redirect")),
        Row("URL redirected to a playlist naming a loopback listener", 0,
            ssrf("INSIDE", "/seg.ts", via="redirect to a playlist")),
        Row("HLS playlist whose key is on a loopback listener", 0, ssrf("INSIDE", "/key", via="playlist key")),
        Row("HLS playlist whose map is a file:", 0, ssrf("file:///etc", "/passwd", via="playlist map")),
        Row("HLS master playlist whose variant names a loopback listener", 0,
            ssrf("INSIDE", "/seg.ts", via="master playlist")),
        Row("DASH manifest whose BaseURL is a loopback listener", 0, ssrf("INSIDE", "/", via="dash")),
        Row("HLS segment that redirects to a loopback listener", 0, ssrf_later("segment redirect")),
        Row("live HLS playlist naming a loopback listener on reload", 0, ssrf_later("reload")),
    ]
