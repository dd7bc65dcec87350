"""The cases of the reliability table: each bad input or fault, where a user meets it, and the outcome
they should get. A new bad input is one more `Case` here; the test and the committed table pick it up.
"""

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streaming.budgets import auto_budget_for
from streaming.memory import MemorySample
from streaming.questions import SAMPLE_QUESTION
from streaming.soak import describe, verdict
from streaming.sources import FileSource

from .media import clip, corrupt, cut_faststart, file_of, gif, png, served_stream, video, wav, write_video
from .sessions import SHORT, bad_utf8_index, held, served_video, session, settings_only, torn_index

ASK = ["--ask", SAMPLE_QUESTION, "--json", "--fast"]
PLAYS = "plays"  # expected outcome: exit 0 and at least one answer


@dataclass
class Case:
    name: str
    where: str  # "cli", "cli env", "cli stdin", "cli tty", "cli pipe", "cli stdout", "cli fault", "cli signal",
    #             "cli kill", "library"
    expected: str  # PLAYS, or a regex the one stderr line must match (exit 2; library: the error raised)
    build: Callable[[Path], list]  # tmp folder → stream-qa arguments (library: a callable's arguments)
    stdin: bytes | Callable[[Path], bytes] | None = None
    code: int | None = None  # expected exit code; default 0 for PLAYS, 2 otherwise
    slow: bool = False  # runs the model end to end
    call: Callable | None = None  # library cases: call(adapter, *build(tmp)) must raise `expected`
    notes: str = ""
    meta: dict = field(default_factory=dict)
    fault: tuple | None = None  # (kind, at, times) for jetson.faults: the real model fails in a clip's prefill
    warns: str | None = None  # a regex one stderr line must match (a fault's warning)
    env: Callable[[Path], dict] | None = None  # "cli env": tmp folder → the process's variables (None: unset)

    @property
    def exit_code(self) -> int:
        return self.code if self.code is not None else (0 if self.expected == PLAYS else 2)


def fault_args(tmp, *extra) -> list:
    """8 one-second clips of a small real video and two questions, after the fault (clip 3) and before it; its frames
    are solid colours, so the change gate is off (`--no-gate`): every clip is a turn, the third one faults."""
    return [video(tmp, "v.mp4", 64, 64, frames=16, fps=2.0), "--no-gate", "--clip-seconds", "1", "--fast", "--json",
            "--max-new-tokens", "4", "--ask", f"{SAMPLE_QUESTION} @2s",
            "--ask", f"{SAMPLE_QUESTION} @6s", *extra]


def signal_args() -> list:
    """A long run with an answer every second of video, streamed as text."""
    return [clip(), "--loop", "20", "--fast", "--every", "1s", "--question", SAMPLE_QUESTION,
            "--max-new-tokens", "8"]


# --- library cases: what a caller of the adapter or streaming.memory meets ------------------------------


def _encode(adapter, frames):
    adapter.encode(frames, [0.0] * len(frames))


def _auto_budget_without_memory(adapter):
    auto_budget_for(adapter, sample=MemorySample("cpu", 100.0, 4096.0, 900.0, 0.0, 0.0))  # 900 MB available


def _video_deleted_mid_run(adapter, path):
    """Three passes over a video that is deleted after the first."""
    source = iter(FileSource(path, fps=1.0, loops=3))
    for _ in range(10):  # the first pass: 10 s
        next(source)
    Path(path).unlink()
    next(source)


def _short_soak_with_falling_rss(adapter) -> str:
    """The verdict of 20 soak rounds whose RSS falls 0.2 MB a round under ±3 MB of noise: a falling slope is no
    leak, however wide its interval; the verdict must say the run is too short to judge."""
    rss = [900 - 0.2 * r + (3 if r % 2 else -3) for r in range(1, 21)]
    samples = [{"round": r, "t_s": float(r), "rss_mb": m, "kv_tokens": 560, "kv_mb": 20.0, "swap_used_mb": 0.0}
               for r, m in zip(range(1, 21), rss, strict=True)]
    run = {"samples": samples, "budget": 512, "rounds": 20, "policy": "inf_mllm", "elapsed_s": 20.0,
           "s_per_round": 1.0, "peak_kv_tokens": 560, "turn_tokens": 40, "question_tokens": 15, "oom_events": [],
           "stopped": None, "answers": 2, "expected_answers": 2, "empty_answers": 0}
    text = describe(verdict(run, Namespace(warmup=0.2, max_new_tokens=16)))
    said = [line.strip() for line in text.splitlines() if "verdict:" in line or "too few" in line]
    if "verdict: PASS" not in text or "too few to tell a slow leak from noise" not in text:
        raise AssertionError(" / ".join(said) or text)
    return " / ".join(said)


CASES = [
    # files
    Case("missing file", "cli", r"no such video file", lambda t: ["nowhere.mp4", *ASK]),
    Case("folder given as the video", "cli", r"is a folder", lambda t: [str(t), *ASK]),
    Case("zero-byte file", "cli", r"is empty \(0 bytes\)", lambda t: [file_of(t, "empty.mp4", b""), *ASK]),
    Case("text file named .mp4", "cli", r"not a readable video",
         lambda t: [file_of(t, "text.mp4", b"not a video\n" * 50), *ASK]),
    Case("binary garbage named .mp4", "cli", r"not a readable video",
         lambda t: [file_of(t, "garbage.mp4", np.random.default_rng(0).bytes(200_000)), *ASK]),
    Case("truncated mp4 (first third, index at the end)", "cli", r"not a readable video|truncated",
         lambda t: [file_of(t, "cut.mp4", Path(clip()).read_bytes()[: Path(clip()).stat().st_size // 3]), *ASK]),
    Case("truncated mp4 with its index at the start", "cli", r"truncated or corrupt: it ends at frame \d+ of 100",
         lambda t: [cut_faststart(t), *ASK], slow=True,
         notes="decord counted only the frames present and played 3 s of 10 without a word"),
    Case("corrupt mp4 (middle bytes overwritten)", "cli", PLAYS,
         lambda t: [file_of(t, "corrupt.mp4", corrupt(Path(clip()).read_bytes())), *ASK], slow=True,
         notes="damaged frames skipped with one warning; the stream continues"),
    Case("wrong extension: mp4 named .txt", "cli", PLAYS,
         lambda t: [file_of(t, "video.txt", Path(video(t, "v.mp4", 64, 64)).read_bytes()), *ASK], slow=True),
    Case("wrong extension: MJPEG AVI named .mp4", "cli", PLAYS,
         lambda t: [file_of(t, "avi.mp4", Path(video(t, "a.avi", 64, 64, fourcc="MJPG")).read_bytes()), *ASK],
         slow=True),
    Case("still image (PNG)", "cli", r"still image", lambda t: [png(t), *ASK]),
    Case("still image named .mp4", "cli", r"still image", lambda t: [png(t, "photo.mp4"), *ASK]),
    Case("animated GIF", "cli", PLAYS, lambda t: [gif(t), *ASK], slow=True),
    Case("audio-only media (WAV)", "cli", r"has no video stream", lambda t: [wav(t), *ASK]),
    Case("1x1 frames (MJPEG)", "cli", PLAYS, lambda t: [video(t, "1x1.avi", 1, 1, fourcc="MJPG"), *ASK], slow=True),
    Case("2x2 frames", "cli", PLAYS, lambda t: [video(t, "2x2.mp4", 2, 2), *ASK], slow=True),
    Case("16x16 frames", "cli", PLAYS, lambda t: [video(t, "16x16.mp4", 16, 16), *ASK], slow=True,
         notes="decord2 returns padded rows as 6 channels; read with OpenCV"),
    Case("72x40 frames", "cli", PLAYS, lambda t: [video(t, "72x40.mp4", 72, 40), *ASK], slow=True),
    Case("4K frames (3840x2160)", "cli", PLAYS, lambda t: [video(t, "4k.mp4", 3840, 2160, frames=3, fps=1), *ASK],
         slow=True),
    Case("grayscale video", "cli", PLAYS, lambda t: [video(t, "gray.avi", 64, 48, fourcc="MJPG", color=False), *ASK],
         slow=True),
    Case("1-frame video", "cli", PLAYS, lambda t: [video(t, "one.mp4", 64, 64, frames=1), *ASK], slow=True),
    Case("0.1 fps video", "cli", PLAYS, lambda t: [video(t, "slow.mp4", 64, 64, frames=3, fps=0.1), *ASK], slow=True),
    Case("240 fps video", "cli", PLAYS, lambda t: [video(t, "fast.mp4", 64, 64, frames=240, fps=240), *ASK],
         slow=True),
    # live sources
    Case("webcam that does not exist", "cli", r"cannot open webcam 57", lambda t: ["--webcam", "57", *ASK]),
    Case("negative webcam index", "cli", r"--webcam takes a camera index", lambda t: ["--webcam", "-1", *ASK]),
    Case("URL that refuses the connection", "cli", r"cannot open stream",
         lambda t: ["--url", "http://127.0.0.1:9/live.mjpg", *ASK]),
    Case("URL stream that ends mid-stream", "cli", PLAYS,
         lambda t: ["--url", served_stream(t), "--ask", SAMPLE_QUESTION, "--json"], slow=True,
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
    Case("--budget auto", "cli", PLAYS, lambda t: [video(t, "v.mp4", 64, 64), "--budget", "auto", *ASK], slow=True),
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
         lambda t: [clip(), "--questions", file_of(t, "huge.txt", b"what " * 1_000_000 + b"\n"), "--fast"]),
    Case("non-UTF-8 question file", "cli", r"not UTF-8",
         lambda t: [clip(), "--questions", file_of(t, "latin.txt", "qu'\xe9crit ?".encode("latin-1"))]),
    Case("malformed time in a question file", "cli", r"bad\.txt:2",
         lambda t: [clip(), "--questions", file_of(t, "bad.txt", b"good @2s\nbad @2x\n")]),
    Case("--every 0s", "cli", r"--every must be a positive time",
         lambda t: [clip(), "--every", "0s", "--question", "what?"]),
    Case("--every without --question", "cli", r"go together", lambda t: [clip(), "--every", "2s"]),
    Case("non-UTF-8 on stdin", "cli stdin", r"stdin: the question text is not UTF-8",
         lambda t: [video(t, "v.mp4", 64, 64), "--fast"], stdin=b"\xe9t\xe9\n", slow=True),
    Case("binary garbage on stdin", "cli stdin", r"stdin: ",
         lambda t: [video(t, "v.mp4", 64, 64), "--fast"], stdin=np.random.default_rng(1).bytes(100_000),
         slow=True),
    # faults of the terminal and the pipe
    Case("questions typed on a terminal, video ends", "cli tty", PLAYS,
         lambda t: [video(t, "v.mp4", 64, 64), "--fast"], code=0, slow=True,
         notes="was SIGABRT (exit 134) at interpreter shutdown", meta={"answers": 0}),
    Case("stream-qa … | head -1", "cli pipe", PLAYS,
         lambda t: [clip(), "--fast", "--json", "--every", "1s", "--question", SAMPLE_QUESTION],
         code=141, slow=True, notes="was a BrokenPipeError traceback", meta={"answers": 0}),
    # faults inside the model and from outside the process
    Case("exception in one clip turn's prefill (injected)", "cli fault", PLAYS, lambda t: fault_args(t),
         fault=("error", 3, 1), warns=r"clip 3 \(.*\) dropped: InjectedFault.*the stream continues",
         notes="the turn is rolled back and dropped with one warning", meta={"answers": 2}),
    Case("out of memory in a prefill (simulated), bounded cache", "cli fault", PLAYS,
         lambda t: fault_args(t, "--budget", "128"), fault=("oom", 3, 2),
         warns=r"out of memory in clip 3's prefill .*budget 96 -> 72 tokens per layer, retry 2 of 3",
         notes="budget tightened by a quarter twice, the turn retried and kept", meta={"answers": 2}),
    Case("out of memory in a prefill (simulated), full cache", "cli fault", PLAYS,
         lambda t: fault_args(t, "--policy", "full"), fault=("oom", 3, 1),
         warns=r"clip 3 .* dropped: OutOfMemoryError.*a full cache cannot shrink",
         notes="nothing to tighten: the turn is dropped with one warning", meta={"answers": 2}),
    Case("the same fault in every clip turn (a bug)", "cli fault", r"internal error \(InjectedFault.*bug.*traceback",
         lambda t: fault_args(t), fault=("bug", 2, 1), code=1,
         notes="3 turns failing in a row is no passing fault: exit 1, traceback in a log file"),
    Case("SIGINT mid-answer", "cli signal", PLAYS, lambda t: signal_args(), code=130,
         notes="every answered line flushed", meta={"signal": "SIGINT"}),
    Case("SIGTERM mid-answer", "cli signal", PLAYS, lambda t: signal_args(), code=143,
         notes="every answered line flushed", meta={"signal": "SIGTERM"}),
    Case("kill -9 mid-run, --json stdout to a file", "cli kill", PLAYS, lambda t: [*signal_args(), "--json"],
         code=-9, notes="the JSON-lines transcript is whole up to the last answer", meta={"answers": 2}),
    # session folders, disks, outputs and streams (issue 21)
    Case("two stream-qa on one --session folder", "cli", r"another stream-qa \(pid \d+\) is writing this session",
         lambda t: [clip(), "--session", str(held(t)), *ASK],
         notes="both ran and mixed their clips and answers; now the second is refused before the model loads"),
    Case("index record cut mid-append, then --resume", "cli", PLAYS,
         lambda t: ["--resume", str(torn_index(t)), "--json", "--ask", "In clip 1, what did you see?"], slow=True,
         warns=r"1 damaged or torn record\(s\) cut off; 1 span file\(s\) re-indexed",
         notes="a later resume lost a clip; now the record is cut back and its clip re-indexed from its file"),
    Case("one invalid UTF-8 byte in the index, --resume", "cli", PLAYS,
         lambda t: ["--resume", str(bad_utf8_index(t)), "--json", "--ask", SAMPLE_QUESTION], slow=True,
         warns=r"1 damaged or torn record\(s\) cut off.*2 clip\(s\) readable",
         notes="the whole session was refused with a message blaming --policy"),
    Case("disk full mid-session (ENOSPC from the first clip's file on)", "cli fault", PLAYS,
         lambda t: [clip(), "--session", str(t / "s"), *SHORT, "--ask", f"{SAMPLE_QUESTION} @4s",
                    "--ask", f"{SAMPLE_QUESTION} @9s"], fault=("enospc", 9, 1), slow=True,
         warns=r"transcript.jsonl and clips.jsonl cannot be written \(the disk is full\); answers from now on are "
               r"printed",
         notes="was exit 1 'internal error' at the first answer", meta={"answers": 2}),
    Case("disk turns read-only mid-session (EROFS)", "cli fault", PLAYS,
         lambda t: [clip(), "--session", str(t / "s"), *SHORT, "--ask", f"{SAMPLE_QUESTION} @4s",
                    "--ask", f"{SAMPLE_QUESTION} @9s"], fault=("erofs", 9, 1), slow=True,
         warns=r"span store: the disk is read-only .*RAM only", meta={"answers": 2}),
    Case("--resume of a session on a read-only disk", "cli fault", PLAYS,
         lambda t: ["--resume", str(session(t)), "--json", "--ask", SAMPLE_QUESTION], fault=("erofs", 1, 1),
         slow=True, warns=r"running read-only: answers are printed, nothing new is saved"),
    Case("session.json hand-edited: \"fps\": \"2\"", "cli", r"'fps' cannot be \"2\" \(edited by hand\?\)",
         lambda t: ["--resume", str(settings_only(t, fps="2"))], notes="was an internal error"),
    Case("--resume DIR --model X --budget N", "cli", r"--model, --budget differ from them",
         lambda t: ["--resume", str(settings_only(t)), "--model", "chat-univi", "/x", "--budget", "256"],
         notes="both options were silently ignored"),
    Case("question timed before the resume point", "cli", PLAYS,
         lambda t: ["--resume", str(session(t)), "--json", "--ask", "what is in the video? @2s"], slow=True,
         warns=r"1 question\(s\) timed before the resume point .* are asked now",
         notes="was silently dropped"),
    Case("--soak-log in a missing folder", "cli", r"--soak-log .*: the folder .* does not exist",
         lambda t: [clip(), "--soak", "20", "--soak-log", str(t / "nowhere" / "soak.jsonl")]),
    Case("--budget AUTO", "cli", PLAYS, lambda t: [video(t, "v.mp4", 64, 64), "--budget", "AUTO", *ASK], slow=True,
         notes="passed the early check and failed after loading"),
    Case("--budget 9000 (past the 8,192-position context)", "cli", r"runs past the model's context of 8,192",
         lambda t: [clip(), "--budget", "9000", *ASK], notes="ran past the trained positions without a word"),
    Case("HTTP URL serving a 10 s file, question @8s", "cli", PLAYS,
         lambda t: ["--url", served_video(t), "--fast", "--json", "--ask", f"{SAMPLE_QUESTION} @8s"], slow=True,
         notes="follows the video's timestamps; was sampled on the download's wall clock"),
    Case("cat video | stream-qa /dev/stdin", "cli stdin", PLAYS,
         lambda t: ["/dev/stdin", "--fast", "--json", "--max-new-tokens", "4", "--ask", SAMPLE_QUESTION],
         stdin=Path(clip()).read_bytes(), slow=True, notes="said the pipe was empty"),
    Case("MPEG-TS on stdin (ffmpeg … -f mpegts - | stream-qa /dev/stdin)", "cli stdin", PLAYS,
         lambda t: ["/dev/stdin", "--fast", "--json", "--max-new-tokens", "4", "--ask", f"{SAMPLE_QUESTION} @8s"],
         stdin=lambda t: (write_video(t / "v.ts", 64, 64, frames=250, fps=25.0, fourcc="MPG1")).read_bytes(),
         slow=True, notes="plays as it arrives, on its own timestamps; was read to its end first"),
    Case("stdout closed (>&-)", "cli stdout", r"stdout is closed \(>&-\)", lambda t: [clip(), *ASK],
         meta={"stdout": "closed"}, notes="was an internal error after the model loaded"),
    Case("stdout on a full device (/dev/full)", "cli stdout", r"stdout goes to a full disk",
         lambda t: [clip(), *ASK], meta={"stdout": "/dev/full"}, notes="was called a bug"),
    Case("SIGHUP mid-answer", "cli signal", PLAYS, lambda t: signal_args(), code=129,
         notes="killed with no message and a dangling 'A: '", meta={"signal": "SIGHUP"}),
    Case("SIGQUIT mid-answer", "cli signal", PLAYS, lambda t: signal_args(), code=131,
         notes="killed with no message and a dangling 'A: '", meta={"signal": "SIGQUIT"}),
    Case("HOME is not a folder (HOME=/dev/null), model not cached", "cli env",
         r"Not a directory .*a fault of this machine's disk or files, not of stream-qa or your input",
         lambda t: [clip(), *ASK], env=lambda t: {"HOME": "/dev/null", "INF_MLLM_CACHE": None},
         notes="was called a bug"),
    Case("model cache folder blocked by a file ($INF_MLLM_CACHE)", "cli env",
         r"Not a directory .*a fault of this machine's disk or files, not of stream-qa or your input",
         lambda t: [clip(), *ASK], env=lambda t: {"INF_MLLM_CACHE": str(file_of(t, "cache", b"a file") + "/x")},
         notes="was called a bug"),
    Case("video deleted or moved mid-run (--loop 3)", "library", r"was deleted or moved while it played \(after 1 "
         r"of 3 passes\)", lambda t: [file_of(t, "v.mp4", Path(clip()).read_bytes())], call=_video_deleted_mid_run,
         notes="was called a bug"),
    Case("20-round --soak whose RSS falls under noise (its verdict)", "library", PLAYS, lambda t: [],
         call=_short_soak_with_falling_rss, code=0, meta={"answers": 0},
         notes="was FAIL: a negative slope whose interval was too wide to judge"),
    Case("question ending in @banana (not a time)", "cli", r"@banana is not a video time",
         lambda t: [clip(), "--ask", "what is it? @banana", "--fast"], notes="was asked with '@banana' in it"),
    Case("--budget 1 (below one clip turn and a question)", "cli",
         r"budget of 1 token per layer cannot hold one clip turn and a question of tiny-vlm",
         lambda t: [clip(), "--budget", "1", *ASK], notes="was refused only after the model loaded"),
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
