"""What a request may carry before any handler reads it (issue 61): JSON bodies and headers within limits, and frames
whose announced size is checked before a pixel is decoded.

- A JSON body over `max_json_kb` is refused with 413 as its bytes arrive (a declared length is refused at once), so
  a 64 MB body never sits in memory; uploads keep their own limit (`max_upload_mb`).
- A body whose framing two parsers could read two ways (RFC 9112 §6.1, request smuggling) is refused with 400 and
  the connection closed, before a byte of it is read: Content-Length with Transfer-Encoding, a coding other than
  chunked, two different lengths, or a chunked body on a GET, HEAD or DELETE (no route of those reads one). h11
  refuses most of these itself; the one it takes (both headers: it trusts the chunks) left a plain body waiting
  for a chunk size that never came.
- More than `max_headers` headers: 431. Their total size is capped by the HTTP parser (`python -m serve` runs h11
  with a 64 KB limit on a request's head).
- A frame (JPEG or PNG) is opened lazily: its header says its size, which must be within `MAX_SIDE` a side,
  `MAX_PIXELS` in all and `MAX_ASPECT` between its sides, and at least 1 pixel; only then is it decoded. A 94-byte
  PNG announcing 1×2000 pixels is refused by its shape; one announcing 20000×20000 by its size, before Pillow would
  warn of a decompression bomb.
"""

import io
import json

import numpy as np

MAX_SIDE = 8192
MAX_PIXELS = 40_000_000
MAX_HEADER_BYTES = 32 * 1024
MAX_ASPECT = 8.0  # wider than a 32:9 panorama twice over; a 1×2000 strip is no camera frame


class FrameRefused(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def decode_frame(data: bytes) -> np.ndarray:
    """JPEG or PNG bytes → (H, W, 3) uint8, after the header's size passed the bounds; `FrameRefused` otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("JPEG", "PNG"):
                raise FrameRefused(415, f"a frame must be JPEG or PNG, not {image.format}")
            check_size(image.width, image.height)
            image.draft("RGB", image.size)  # JPEG: no upscaled intermediate
            return np.asarray(image.convert("RGB"))
    except UnidentifiedImageError:
        raise FrameRefused(400, "the frame is not a readable JPEG or PNG") from None
    except Image.DecompressionBombError:
        raise FrameRefused(413, f"a frame of more than {MAX_PIXELS:,} pixels") from None
    except (OSError, SyntaxError, ValueError) as err:
        if isinstance(err, FrameRefused):
            raise
        line = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise FrameRefused(400, f"the frame is not a readable JPEG or PNG ({line})") from None


def check_size(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise FrameRefused(400, f"a {width}x{height} frame has no pixels")
    if width > MAX_SIDE or height > MAX_SIDE or width * height > MAX_PIXELS:
        raise FrameRefused(413, f"a {width}x{height} frame is too large ({MAX_SIDE} pixels a side and "
                                f"{MAX_PIXELS // 1_000_000} megapixels at most)")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise FrameRefused(422, f"a {width}x{height} frame: its sides differ more than {MAX_ASPECT:g}:1")


class RequestLimits:
    """ASGI middleware: too many headers, or too many bytes of them → 431; a JSON body past `max_json_bytes` (or its
    path's own limit in `json_paths`: a chat completion carries its frames) → 413, before more than that is read."""

    def __init__(self, app, max_json_bytes: int, max_headers: int, json_paths: dict[str, int] | None = None):
        self.app, self.max_json_bytes, self.max_headers = app, max_json_bytes, max_headers
        self.json_paths = json_paths or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if (unframed := ambiguous_framing(scope["method"], headers)) is not None:
            return await _refuse(send, 400, unframed, close=True)
        if len(headers) > self.max_headers:
            return await _refuse(send, 431, f"{len(headers)} headers; {self.max_headers} at most")
        size = sum(len(k) + len(v) for k, v in headers)
        if size > MAX_HEADER_BYTES:
            return await _refuse(send, 431, f"{size:,} bytes of headers; {MAX_HEADER_BYTES:,} at most")
        kind = next((v for k, v in headers if k == b"content-type"), b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            return await self.app(scope, receive, send)
        limit = self.json_paths.get(scope.get("path", ""), self.max_json_bytes)
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _refuse(send, 413, f"a JSON body of {int(declared):,} bytes; {limit:,} at most")
        body = bytearray()  # read here, at most the limit, then handed on: a JSON body is small
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            body += message.get("body", b"")
            if len(body) > limit:
                return await _refuse(send, 413, f"a JSON body over {limit:,} bytes")
            if not message.get("more_body"):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": bytes(body), "more_body": False}], receive),
                       send)


BODILESS = ("GET", "HEAD", "DELETE")


def ambiguous_framing(method: str, headers: list) -> str | None:
    """Why this request's body has no one reading (a line), or None: where a proxy in front and this server could
    disagree on where the body ends, what follows it may be read as another client's request."""
    lengths = {v.strip() for k, v in headers if k == b"content-length"}
    codings = [v.strip().lower() for k, v in headers if k == b"transfer-encoding"]
    if codings and lengths:
        return "Content-Length and Transfer-Encoding together (a request-smuggling shape); send one of them"
    if len(lengths) > 1:
        return "Content-Length headers that differ: " + ", ".join(sorted(v.decode("latin-1")[:20] for v in lengths))
    if codings and codings != [b"chunked"]:
        shown = ", ".join(c.decode("latin-1")[:40] for c in codings)
        return f"Transfer-Encoding {shown}: only chunked is taken"
    if codings and method in BODILESS:
        return f"a {method} request carries no body here; Transfer-Encoding refused"
    return None


def _replay(messages: list, then=None):
    """A `receive` that gives `messages`, then defers to `then` (a disconnect, while the response streams)."""
    async def receive():
        if messages:
            return messages.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}
    return receive


async def _refuse(send, status: int, message: str, close: bool = False) -> None:
    """`close`: the connection ends after the answer (the server then reads nothing more from it)."""
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})
