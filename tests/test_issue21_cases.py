"""Issue 21's misleading cases, checked more closely than their rows of the reliability table
(jetson/reliability/cases.py) can: the exact wording, what is and is not written, the video clock of a
served file, a FIFO. Cases decided before the model loads run `stream-qa` in this process; the others
share one real tiny-vlm."""

import contextlib
import json
import os
import sys

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
    assert parse_budget(args.budget).auto


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
    from clocks import SteppedClock

    from streaming.sources import CaptureSource

    fast = CaptureSource(served, fps=1.0, realtime=False)
    assert fast.duration == pytest.approx(10.0) and not fast.live
    assert [round(f.t, 2) for f in fast] == [float(s) for s in range(10)]  # video time, not download time
    paced = CaptureSource(served, fps=1.0)
    assert paced.live  # paced to real time: a clip the model has no room for is dropped, as for a paced file
    clock = SteppedClock()  # the source's clock, moved only by its own waiting
    paced.clock, paced.sleep = clock, clock.sleep
    handed = [(f.t, clock.now) for _, f in zip(range(3), paced, strict=False)]
    assert [t for t, _ in handed] == pytest.approx([0.0, 1.0, 2.0])
    assert [now for _, now in handed] == pytest.approx([0.0, 1.0, 2.0])  # each handed over when its time came


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


def test_a_pipe_carrying_a_stream_plays_as_it_arrives(tmp_path):
    """A FIFO carrying Matroska or MPEG-TS: the first frame comes while the writer still holds back the second
    half of the video (it waits up to 20 s for that frame), the times are the video's own; --loop is refused."""
    import threading

    from jetson.reliability.media import write_video
    from streaming.sources import CaptureSource, SourceError, open_source

    fifo = tmp_path / "video.pipe"
    for name, fourcc, fps in (("v.mkv", "MJPG", 4.0), ("v.ts", "MPG1", 25.0)):
        data = write_video(tmp_path / name, 64, 64, frames=int(60 * fps), fps=fps, fourcc=fourcc).read_bytes()
        os.mkfifo(fifo)
        first_frame, held = threading.Event(), []

        def write(data=data, first_frame=first_frame, held=held):
            with open(fifo, "wb") as pipe:
                pipe.write(data[: len(data) // 2])
                pipe.flush()
                held.append(first_frame.wait(20))  # False: the reader waited for the end of the pipe
                pipe.write(data[len(data) // 2:])

        writer = threading.Thread(target=write)
        writer.start()
        source = open_source(str(fifo), fps=1.0, realtime=False)
        times = []
        for frame in source:
            times.append(frame.t)
            first_frame.set()
        writer.join()
        fifo.unlink()
        assert isinstance(source, CaptureSource) and held == [True], name
        assert times == pytest.approx([float(s) for s in range(60)], abs=0.05), name
    os.mkfifo(fifo)

    def write_all():
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as pipe:  # the reader refuses after a look
            pipe.write((tmp_path / "v.ts").read_bytes())

    writer = threading.Thread(target=write_all)
    writer.start()
    with pytest.raises(SourceError, match="a pipe carrying a stream: it plays once"):
        open_source(str(fifo), fps=1.0, loops=2)
    writer.join(timeout=10)


@pytest.mark.slow
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
