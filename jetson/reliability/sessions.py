"""Session folders for the table's issue-21 cases: a real session made by `stream-qa --session` in this
process (the table's runner loads the model for it; the in-process test hands it the shared one), then
broken the way a crash, a hand edit or a second writer breaks it; and a longer served video for a URL
that must follow the video's own clock.
"""

import contextlib
import io
import json
from pathlib import Path

from inf_mllm.diskio import FolderLock
from streaming.questions import SAMPLE_QUESTION

from .media import clip, serve_file, write_video

HELD = []  # locks this process holds for a case's whole run: the "other writer"
SHORT = ["--fast", "--clip-seconds", "5", "--max-new-tokens", "4", "--json"]


def session(tmp: Path, name: str = "s") -> Path:
    """A real 2-clip session of the bundled clip with one answer, made by stream-qa in this process."""
    from streaming.cli import main

    folder = tmp / name
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main([clip(), "--session", str(folder), *SHORT, "--ask", f"{SAMPLE_QUESTION} @4s"])
    if code != 0:
        raise RuntimeError(f"building the session for a case failed (exit {code})")
    return folder


def settings_only(tmp: Path, **edits) -> Path:
    """A session folder holding only settings (what a refusal before the model loads reads), with `edits`."""
    folder = tmp / "s"
    folder.mkdir()
    settings = {"video": clip(), "webcam": None, "url": None, "fps": 1.0, "clip_seconds": 4.0, "fast": True,
                "loop": 1, "model": ["tiny-vlm"], "policy": "inf_mllm+recall", "budget": "512", "bias": None,
                "window": None, "max_new_tokens": 16, "device": "cpu"}
    (folder / "session.json").write_text(json.dumps(settings | edits))
    return folder


def held(tmp: Path) -> Path:
    """A session folder another writer (this process) has open."""
    folder = tmp / "s"
    folder.mkdir()
    lock = FolderLock(folder)
    lock.acquire()
    HELD.append(lock)
    return folder


def torn_index(tmp: Path) -> Path:
    """A session whose last index record a crash cut in the middle of its append."""
    folder = session(tmp)
    index = folder / "store" / "index.jsonl"
    data = index.read_bytes()
    index.write_bytes(data[: len(data) - 60])
    return folder


def bad_utf8_index(tmp: Path) -> Path:
    """A session with one byte of its index's first record made invalid UTF-8."""
    folder = session(tmp)
    index = folder / "store" / "index.jsonl"
    data = bytearray(index.read_bytes())
    data[10] = 0xFF
    index.write_bytes(bytes(data))
    return folder


def served_video(tmp: Path) -> str:
    """A 10 s MJPEG AVI served over HTTP (a file, not a live stream) by a thread of this process."""
    write_video(tmp / "ten.avi", 64, 64, frames=40, fps=4.0, fourcc="MJPG")
    return serve_file(tmp / "ten.avi")[0]
