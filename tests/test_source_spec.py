"""One source factory (issue 68): every kind a front end offers is named by a `SourceSpec` and opened by it, on real
files; what cannot be opened is one line."""

import threading

import pytest

from streaming.frames import SourceError
from streaming.page_sources import BrowserCamera, PlaybackSource
from streaming.pushed import PushedFrames
from streaming.source_spec import KINDS, SourceSpec
from streaming.sources import FileSource, bundled_clip
from streaming.urls import SERVER, UrlRefused


def test_each_kind_opens_its_source_and_says_its_label():
    clip, stop = str(bundled_clip()), threading.Event()
    file = SourceSpec("file", clip, fps=2.0, realtime=False, loops=2).open()
    assert isinstance(file, FileSource) and file.fps == 2.0 and not file.realtime and file.loops == 2
    times = [f.t for f in file]
    assert 38 <= len(times) <= 42 and times == sorted(times) and times[-1] > 19  # 2 fps, 2 laps of a 10-s clip
    player = SourceSpec("player", clip, speed=4.0).open(stop)
    assert isinstance(player, PlaybackSource) and player.speed == 4.0 and player.stop is stop
    assert isinstance(SourceSpec("push", fps=2.0).open(stop), PushedFrames)
    camera = SourceSpec("browser-camera").open(stop)
    assert isinstance(camera, BrowserCamera) and camera.live
    assert [SourceSpec(k, t).label for k, t in (("file", clip), ("webcam", 0), ("push", None),
                                                  ("browser-camera", None))] == \
        ["bikes.mp4", "webcam 0", "pushed frames", "browser camera"]
    assert SourceSpec("url", "rtsp://cam:secret@192.0.2.7/live").label == "rtsp://***@192.0.2.7/live"
    assert set(KINDS) == {"file", "webcam", "url", "push", "player", "browser-camera"}


def test_the_command_lines_form_is_read_as_a_spec():
    assert SourceSpec.of({"video": "a.mp4", "webcam": None, "url": None}, fps=2.0) == SourceSpec("file", "a.mp4", 2.0)
    assert SourceSpec.of({"webcam": 1}).kind == "webcam" and SourceSpec.of({"url": "rtsp://h/x"}).kind == "url"


@pytest.mark.parametrize("make, says", [
    (lambda: SourceSpec("tape", "x"), "unknown source kind 'tape'"),
    (lambda: SourceSpec("file"), "needs a file, a webcam index or a URL"),
    (lambda: SourceSpec("push", "x"), "takes no target"),
    (lambda: SourceSpec.of({"video": "a.mp4", "webcam": 0}), "give exactly one source"),
    (lambda: SourceSpec.of({}), "give exactly one source"),
    (lambda: SourceSpec("file", "/no/such/video.mp4").open(), "no such video file"),
    (lambda: SourceSpec("url", "http://127.0.0.1:1/cam").open(policy=SERVER), "127.0.0.1"),
])
def test_what_cannot_open_is_one_line(make, says):
    with pytest.raises(SourceError, match=says) as err:
        make()
    assert "\n" not in str(err.value)


def test_a_url_is_held_to_the_callers_rules():
    """The server's rules refuse loopback before anything connects; a user's own run (the default) lets it through to
    the connection, which fails on a port where nothing listens."""
    with pytest.raises(UrlRefused, match="the server opens only"):
        SourceSpec("url", "rtsp://127.0.0.1:9/cam").open(policy=SERVER)
    with pytest.raises(SourceError, match="cannot open stream"):
        SourceSpec("url", "http://127.0.0.1:9/cam.mp4").open()
