"""Bad and odd media made from real files for the reliability cases: videos written with OpenCV, a WAV,
a PNG, a GIF, cut and corrupted copies of the bundled clip, an HTTP stream that stops.

Every file is written at the moment a case is built, into that case's own folder, so a case never
depends on what another one left behind and the committed table needs no media of its own.
"""

import functools
import struct
import threading
import wave
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from streaming.sources import bundled_clip


def write_video(path: Path, w: int, h: int, frames: int = 8, fps: float = 4.0, fourcc: str = "mp4v",
                color: bool = True) -> Path:
    """A real video of solid frames (red, then green) written with OpenCV."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h), color)
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {w}x{h} {fourcc} to {path}")
    for i in range(frames):
        bgr = np.zeros((h, w, 3), np.uint8)
        bgr[..., 2 if i < frames // 2 or frames == 1 else 1] = 220
        writer.write(bgr if color else bgr[..., 2])
    writer.release()
    return path


def video(tmp: Path, name: str, *a, **k) -> str:
    """`write_video` into the case's folder, as the path string stream-qa takes."""
    return str(write_video(tmp / name, *a, **k))


def clip(name: str = "bikes.mp4") -> str:
    return str(bundled_clip(name))


def file_of(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def wav(tmp: Path) -> str:
    path = tmp / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes((np.sin(np.arange(16000) / 8) * 8000).astype(np.int16).tobytes())
    return str(path)


def png(tmp: Path, name: str = "still.png") -> str:
    path = tmp / name
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(path, format="PNG")
    return str(path)


def gif(tmp: Path) -> str:
    frames = [Image.fromarray(np.full((32, 32, 3), c, np.uint8)) for c in (30, 120, 220, 90)]
    path = tmp / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    return str(path)


def corrupt(data: bytes) -> bytes:
    """The middle fifth of the file overwritten with noise: the container is intact, frames are not."""
    n = len(data)
    noise = np.random.default_rng(2).bytes(n // 5)
    return data[: 2 * n // 5] + noise + data[2 * n // 5 + len(noise):]


# --- the MP4 box rewriter ---------------------------------------------------------------------------


def _boxes(data: bytes, start: int = 0, end: int | None = None):
    """(kind, offset, size) of the MP4 boxes between start and end."""
    i, end = start, len(data) if end is None else end
    while i + 8 <= end:
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        size = size or end - i
        yield kind, i, size
        i += size


def faststart(data: bytes) -> bytes:
    """An MP4 with its index (moov) moved before the media data, as streaming encoders write it, so a
    cut file still opens and states its full length. Chunk offsets (stco) shift by the moov size."""
    top = {kind: (i, size) for kind, i, size in _boxes(data)}
    mi, ms = top[b"moov"]
    moov = bytearray(data[mi:mi + ms])

    def patch(start: int, end: int) -> None:
        for kind, i, size in _boxes(moov, start, end):
            if kind in (b"trak", b"mdia", b"minf", b"stbl"):
                patch(i + 8, i + size)
            elif kind == b"stco":
                for j in range(struct.unpack(">I", moov[i + 12:i + 16])[0]):
                    o = i + 16 + 4 * j
                    moov[o:o + 4] = struct.pack(">I", struct.unpack(">I", moov[o:o + 4])[0] + ms)

    patch(8, ms)
    rest = data[:mi] + data[mi + ms:]
    fi, fs = top[b"ftyp"]
    return rest[:fi + fs] + bytes(moov) + rest[fi + fs:]


def cut_faststart(tmp: Path) -> str:
    """10 s of noise frames at 10 fps, index first, cut at 30%: decord counts only the frames present."""
    src = tmp / "src.mp4"
    writer = cv2.VideoWriter(str(src), cv2.VideoWriter_fourcc(*"mp4v"), 10, (160, 120))
    rng = np.random.default_rng(3)
    for _ in range(100):
        writer.write(rng.integers(0, 255, (120, 160, 3), dtype=np.uint8))
    writer.release()
    data = faststart(src.read_bytes())
    return file_of(tmp, "cut_faststart.mp4", data[: len(data) * 3 // 10])


# --- a live source that ends ------------------------------------------------------------------------


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        """No request lines on stderr: the cases read stderr for the product's own messages."""


def serve_file(path: Path) -> tuple[str, ThreadingHTTPServer]:
    """`path` served over HTTP on loopback by a thread of this process: (its URL, the server to shut down)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(path.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/{path.name}", server


def served_stream(tmp: Path) -> str:
    """A real HTTP stream that ends after 3 s of video: an MJPEG AVI served by a local HTTP server, read by
    OpenCV's ffmpeg like any network camera."""
    write_video(tmp / "live.avi", 64, 64, frames=12, fps=4.0, fourcc="MJPG")
    return serve_file(tmp / "live.avi")[0]
