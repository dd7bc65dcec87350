"""Issue 21's misleading cases, each with the message or behaviour a user should get. They are meant as rows
of the reliability table (jetson/reliability.py); until that table's split into a package lands they live
here. Cases decided before the model loads run `stream-qa` in this process; the others share one real
tiny-vlm; an environment fault inside the model loader runs in its own process."""

import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from streaming.checks import check_args
from streaming.cli import build_parser, main
from streaming.sources import bundled_clip

ASK = ["--fast", "--clip-seconds", "5", "--max-new-tokens", "2", "--json"]


@pytest.fixture
def shared_model(vlm, monkeypatch):
    import models

    monkeypatch.setattr(models, "load_adapter", lambda name, path=None, device="cpu": vlm)
    return vlm


def last_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "no message"
    return lines[-1]


def test_budget_auto_in_capitals_is_auto():
    from inf_mllm.spec import parse_budget

    args = build_parser().parse_args([str(bundled_clip()), "--budget", "AUTO"])
    check_args(args)  # passes here, and load_session reads it the same way: it cannot fail after loading
    assert parse_budget(args.budget) == "auto"


def test_a_soak_log_in_a_missing_folder_is_refused_before_the_model_loads(tmp_path, capsys):
    log = tmp_path / "no-such-folder" / "soak.jsonl"
    code = main([str(bundled_clip()), "--soak", "20", "--soak-log", str(log)])
    assert code == 2
    assert last_line(capsys) == f"stream-qa: --soak-log {log}: the folder {log.parent} does not exist"


def test_resume_refuses_options_it_would_ignore(tmp_path, capsys, shared_model):
    folder = tmp_path / "s"
    assert main([str(bundled_clip()), "--session", str(folder), *ASK, "--ask", "what is it? @4s"]) == 0
    capsys.readouterr()
    code = main(["--resume", str(folder), "--model", "chat-univi", "/x", "--budget", "256"])
    assert code == 2
    assert last_line(capsys) == (f"stream-qa: --resume {folder} continues with the settings the session started "
                                 f"with; --model, --budget differ from them: leave them out, or start a new --session")
    # a question timed before the resume point is asked now (from the stored clips), one asked already is not
    code = main(["--resume", str(folder), "--json", "--ask", "what is it? @4s", "--ask", "what is the color? @2s"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-1500:]
    asked = [json.loads(line)["question"] for line in captured.out.splitlines()]
    assert asked == ["what is the color?"]
    assert "1 question(s) timed before the resume point (10.0 s of video) are asked now" in captured.err


def test_a_budget_past_the_models_context_is_refused(capsys, shared_model):
    code = main([str(bundled_clip()), *ASK, "--budget", "9000"])
    assert code == 2
    line = last_line(capsys)
    assert line.startswith("stream-qa: budget of 9,000 tokens per layer runs past the model's context of 8,192 "
                           "positions"), line
    assert line.endswith("or less")


def test_a_short_soak_with_a_falling_slope_is_no_leak():
    """20 rounds whose RSS falls with noise: the interval is wide, the slope negative. Not a FAIL: a leak grows;
    the description says the run is too short to judge."""
    from streaming.soak import describe, verdict

    rss = [900 - 0.2 * r + (3 if r % 2 else -3) for r in range(1, 21)]
    samples = [{"round": r, "t_s": float(r), "rss_mb": m, "kv_tokens": 560, "kv_mb": 20.0, "swap_used_mb": 0.0}
               for r, m in zip(range(1, 21), rss, strict=True)]
    run = {"samples": samples, "budget": 512, "rounds": 20, "policy": "inf_mllm", "elapsed_s": 20.0,
           "s_per_round": 1.0, "peak_kv_tokens": 560, "turn_tokens": 40, "question_tokens": 15, "oom_events": [],
           "stopped": None, "answers": 2, "expected_answers": 2, "empty_answers": 0}
    v = verdict(run, Namespace(warmup=0.2, max_new_tokens=16))
    assert v["rss_slope_mb_per_round"] < 0 and v["rss_slope_ci95_mb_per_round"] > 0.01 and v["passed"]
    text = describe(v)
    assert "verdict: PASS" in text and "20 rounds are too few to tell a slow leak from noise" in text
    assert not math.isnan(v["rss_slope_mb_per_round"])


def test_a_model_cache_that_cannot_be_written_is_an_environment_fault_not_a_bug(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    env = {**os.environ, "INF_MLLM_CACHE": str(blocker / "cache"), "STREAM_QA_LOG_DIR": str(tmp_path / "logs")}
    out = subprocess.run([sys.executable, "-m", "streaming.cli", str(bundled_clip()), "--fast", "--ask", "what?"],
                         capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last.startswith("stream-qa: Not a directory") and "not of stream-qa or your input" in last
    assert "bug" not in last


def test_stdout_filling_up_mid_run_is_one_line_and_the_answer_is_kept(tmp_path, capsys, monkeypatch, shared_model):
    """stdout on a disk that fills during the run: the first answer cannot be printed. One line naming the cause
    (exit 2, no "bug"), and the session transcript already holds that answer."""
    import errno

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            """Nothing buffered: every write fails at once."""

    monkeypatch.setattr(sys, "stdout", FullDisk())
    folder = tmp_path / "s"
    code = main([str(bundled_clip()), "--session", str(folder), *ASK, "--ask", "what is it? @4s"])
    line = last_line(capsys)
    assert code == 2 and "bug" not in line
    assert line.startswith("stream-qa: cannot write the answers to stdout (No space left on device)")
    saved = [json.loads(x) for x in (folder / "transcript.jsonl").read_text().splitlines()]
    assert [r["question"] for r in saved] == ["what is it?"]


# --- streams paced by video time, pipes -------------------------------------------------------------


@pytest.fixture
def served(tmp_path):
    """A 10 s MJPEG AVI (40 frames at 4 fps) served over HTTP by a thread of this process."""
    from jetson.reliability.media import serve_file, write_video

    write_video(tmp_path / "ten.avi", 64, 64, frames=40, fps=4.0, fourcc="MJPG")
    url, server = serve_file(tmp_path / "ten.avi")
    yield url
    server.shutdown()


def test_a_url_serving_a_file_follows_the_videos_own_clock(served):
    import time

    from streaming.sources import CaptureSource

    fast = CaptureSource(served, fps=1.0, realtime=False)
    assert fast.duration == pytest.approx(10.0) and not fast.live
    assert [round(f.t, 2) for f in fast] == [float(s) for s in range(10)]  # video time, not download time
    paced = CaptureSource(served, fps=1.0)
    assert paced.live  # paced to real time: a clip the model has no room for is dropped, as for a paced file
    start = time.monotonic()
    times = [f.t for _, f in zip(range(3), paced, strict=False)]
    assert times == pytest.approx([0.0, 1.0, 2.0]) and time.monotonic() - start >= 1.9


def test_a_pipe_is_read_as_the_video_it_carries(tmp_path):
    import threading

    from streaming.sources import FileSource, SourceError

    fifo = tmp_path / "video.pipe"
    for data in (bundled_clip().read_bytes(), b""):
        os.mkfifo(fifo)

        def write(data=data):
            with open(fifo, "wb") as pipe:
                pipe.write(data)

        writer = threading.Thread(target=write)
        writer.start()
        if data:
            source = FileSource(fifo, fps=1.0)
            assert source.duration == pytest.approx(10.0) and [f.t for f in source] == [float(s) for s in range(10)]
        else:
            with pytest.raises(SourceError, match="a pipe that carried no data"):
                FileSource(fifo, fps=1.0)
        writer.join()
        fifo.unlink()


@pytest.mark.slow
def test_cat_video_into_stream_qa_dev_stdin_plays():
    out = subprocess.run([sys.executable, "-m", "streaming.cli", "/dev/stdin", *ASK, "--ask", "what is it?"],
                         input=bundled_clip().read_bytes(), capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert [json.loads(line)["question"] for line in out.stdout.splitlines()] == ["what is it?"]


def test_a_video_deleted_mid_run_ends_in_one_line_not_a_bug(tmp_path):
    from streaming.sources import FileSource, SourceError

    video = tmp_path / "v.mp4"
    video.write_bytes(bundled_clip().read_bytes())
    frames = iter(FileSource(video, fps=1.0, loops=3))
    first_pass = [next(frames) for _ in range(10)]
    video.unlink()
    with pytest.raises(SourceError, match=r"was deleted or moved while it played \(after 1 of 3 passes\)"):
        next(frames)
    assert first_pass[-1].t == 9.0


def test_resume_of_a_session_on_a_read_only_disk_answers_without_writing(tmp_path, capsys, monkeypatch, shared_model):
    """Every write into the folder fails with EROFS (a disk remounted read-only): --resume still answers from the
    stored clips, with one warning, and the folder is exactly as it was."""
    import errno

    from inf_mllm import diskio

    folder = tmp_path / "s"
    assert main([str(bundled_clip()), "--session", str(folder), *ASK, "--ask", "what is it? @4s"]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def read_only(op, path, fd, data):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(diskio, "hook", read_only)
    code = main(["--resume", str(folder), "--json", "--ask", "In clip 1, what did you see?"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-1500:]
    assert [json.loads(x)["question"] for x in captured.out.splitlines()] == ["In clip 1, what did you see?"]
    warned = [x for x in captured.err.splitlines() if x.startswith("warning:")]
    assert len(warned) == 1 and "running read-only" in warned[0], warned
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
