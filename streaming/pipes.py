"""A pipe as a video source (/dev/stdin, a FIFO): what it carries, and a path OpenCV can read it from."""

import contextlib
import os
import stat
import threading
from pathlib import Path


def is_pipe(path: Path) -> bool:
    mode = path.stat().st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def read_head(pipe, size: int = 3 * 188) -> bytes:
    """The pipe's first `size` bytes (fewer if it ends first)."""
    head = b""
    while len(head) < size and (chunk := pipe.read(size - len(head))):
        head += chunk
    return head


def streamable(head: bytes) -> bool:
    """Containers ffmpeg decodes front to back, with no index to seek to: Matroska/WebM (an EBML header) and
    MPEG-TS (a sync byte every 188 bytes)."""
    return head.startswith(b"\x1a\x45\xdf\xa3") or (len(head) >= 3 * 188 and head[0:377:188] == b"GGG")


def relay(pipe, head: bytes) -> str:
    """A path OpenCV can open that carries `head` and then the rest of `pipe` (a thread copies it over an OS
    pipe); the copy ends when the pipe does or when the reader closes its end."""
    read_fd, write_fd = os.pipe()

    def copy():
        # an OSError (BrokenPipeError: the reader has gone) ends the copy, quietly
        with pipe, contextlib.suppress(OSError), os.fdopen(write_fd, "wb", buffering=0) as out:
            out.write(head)
            while chunk := pipe.read(1 << 16):
                out.write(chunk)

    threading.Thread(target=copy, name="pipe-relay", daemon=True).start()
    return f"/proc/{os.getpid()}/fd/{read_fd}"
