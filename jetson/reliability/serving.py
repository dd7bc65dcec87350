"""The server the reliability rows, the server's tests and its benchmarks run against: a real `python -m serve` in its
own process on a free loopback port, with a token, the table's small limits, and a media folder of real files and a
link leading out of it. `serving(tmp)` yields it and stops it (SIGTERM, then SIGKILL after a grace) however the
caller ends; nothing here talks to any address but 127.0.0.1.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .hostile import image
from .media import clip, write_video

TOKEN = "reliability-token"
LIMITS = {"max_sessions": 4, "max_questions": 4, "max_upload_mb": 1.0, "max_session_questions": 6}


def media_folder(tmp: Path) -> Path:
    """Real files the pulling rows name, and a link that leads out of the folder."""
    media = tmp / "media"
    media.mkdir(parents=True, exist_ok=True)
    (media / "bikes.mp4").write_bytes(Path(clip()).read_bytes())
    (media / "picture.png").write_bytes(image("PNG"))
    (media / "empty.mp4").write_bytes(b"")
    outside = write_video(tmp / "outside-real.mp4", 64, 48)
    with contextlib.suppress(FileExistsError):
        (media / "outside.mp4").symlink_to(outside)
    return media


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(tmp: Path, *extra: str, token: str | None = TOKEN, **limits):
    """`python -m serve` on a free loopback port with the table's limits; yields (url, media, process)."""
    media = media_folder(tmp)
    port = free_port()
    settings = LIMITS | limits
    args = [sys.executable, "-m", "serve", "--port", str(port), "--media", str(media),
            "--max-sessions", str(settings["max_sessions"]), "--max-questions", str(settings["max_questions"]),
            "--max-upload-mb", str(settings["max_upload_mb"]),
            "--max-session-questions", str(settings["max_session_questions"]),
            "--allow-url-host", "127.0.0.1", *extra]  # a camera host the operator allows: 127.0.0.2 stays refused
    env = dict(os.environ, STREAM_QA_TOKEN=token or "")
    log = open(tmp / "server.log", "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, f"{url}/healthz", tmp / "server.log", timeout=300)
        yield url, media, process
    finally:
        stop(process, log, grace=30)


def wait_until_up(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until `url` answers 200; a process that exits first, or `timeout` seconds, is an error with its log."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[2]} exited ({process.returncode}): {log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:g} s: {log.read_text()[-2000:]}")
        time.sleep(0.25)


def stop(process: subprocess.Popen, log, grace: float) -> None:
    """SIGTERM, `grace` seconds to finish, then SIGKILL; its log file closed."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()
