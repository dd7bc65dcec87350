"""The app's page-driven sources on the real bikes.mp4 and real frames: ingest follows the player's
position (pauses, seeks, laps of the looping player) and the browser camera is sampled and timed out."""

import threading
import time

import numpy as np
import pytest

from streaming.page_sources import BrowserCamera, PlaybackSource
from streaming.sources import bundled_clip


def pull(source, n):
    """Up to n frames from a source, taken on a thread as the engine's ingest thread would; (frames, thread)."""
    got, it = [], iter(source)

    def run():
        for frame in it:
            got.append(frame)
            if len(got) == n:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return got, t


def waiting(source, rounds=3):
    """Until the source has looked at the playback position `rounds` more times and found its next frame ahead of
    it: it is waiting, not merely slow (no fixed sleep to give it a chance)."""
    seen = source.waits
    return until(lambda: source.waits >= seen + rounds)


def until(done, timeout=30.0):
    """Wait for `done()` on a machine whose cores may be busy; the bound is a hang guard, not a timing."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


class Clock:
    """Monotonic seconds that move only when the test steps them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_frames_are_released_only_up_to_the_player_position():
    stop = threading.Event()
    source = PlaybackSource(bundled_clip(), stop, fps=1.0)
    source.report(3.2)  # the player is at 3.2 s: frames 0..3 may go in, not 4
    got, t = pull(source, 10)
    assert until(lambda: len(got) == 4) and waiting(source)  # frame 4 is not taken early
    assert [f.t for f in got] == pytest.approx([0, 1, 2, 3], abs=0.05) and t.is_alive()  # waiting for playback
    source.report(1.0)  # a seek back: nothing is taken in twice, ingest waits for playback to pass 4 s
    assert waiting(source) and len(got) == 4
    source.report(5.0)
    assert until(lambda: len(got) == 6)
    assert [round(f.t) for f in got] == [0, 1, 2, 3, 4, 5]
    stop.set()  # the engine stopping ends a waiting source at once
    t.join(5.0)
    assert not t.is_alive()


def test_the_looping_player_starts_a_new_lap_and_video_time_runs_on():
    source = PlaybackSource(bundled_clip(), threading.Event(), fps=1.0)
    source.report(9.6)
    source.report(0.4)  # wrapped from the end to the start: lap 2
    assert source.now() == pytest.approx(10.4)
    source.report(4.0)  # an ordinary seek back within the lap
    assert source.now() == pytest.approx(14.0)
    clock = Clock()  # the page's timer reports every second; on a loaded machine one can come seconds late
    late = PlaybackSource(bundled_clip(), threading.Event(), fps=1.0, clock=clock)
    late.report(6.5)
    clock.now = 4.6
    late.report(1.1)  # 4.6 s after 6.5 s the player had passed the end of the 10-s clip: a lap, not a seek back
    assert late.now() == pytest.approx(11.1)
    clock.now = 5.0
    late.report(0.5)  # 0.4 s later: a seek back
    assert late.now() == pytest.approx(10.5) and late.lap == 1


def test_without_a_player_a_server_clock_paces_ingest():
    """No player reports: video time is the server clock times `speed` (10x: 0.25 s of clock is 2.5 s of video)."""
    stop, clock = threading.Event(), Clock()
    source = PlaybackSource(bundled_clip(), stop, fps=2.0, speed=10.0, clock=clock)
    got, t = pull(source, 10)
    assert until(lambda: len(got) == 1) and waiting(source)  # the clock stands still: frame 0.5 s waits
    assert [f.t for f in got] == [0.0]
    clock.now = 0.25
    assert until(lambda: len(got) == 6) and waiting(source)
    assert [f.t for f in got] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], abs=0.05)
    clock.now = 0.45
    assert until(lambda: len(got) == 10) and got[-1].t == pytest.approx(4.5, abs=0.05)
    assert 0 <= source.waited_s <= 0.45  # by the source's clock (how much depends on when decoding ended)
    stop.set()


def test_browser_camera_samples_pushed_frames_and_times_out():
    """16 frames pushed over one second of the camera's clock, sampled at 4 fps: every fourth is kept, each
    stamped with its time; no frame for longer than `timeout` ends the stream with a reason."""
    from skimage import data

    stop, clock = threading.Event(), Clock()
    camera = BrowserCamera(stop, fps=4.0, timeout=0.5, clock=clock)
    frame = data.astronaut()  # a real photo stands in for a webcam frame
    rgba = np.dstack([frame, np.full(frame.shape[:2], 255, np.uint8)])  # RGBA from the page
    frames, kept = iter(camera), []
    for i in range(16):
        clock.now = i / 16
        camera.push(rgba)
        if not camera.frames.empty():
            kept.append(next(frames))
    assert [f.t for f in kept] == [0.0, 0.25, 0.5, 0.75] and camera.received == 16
    assert kept[0].rgb.shape == frame.shape and camera.ended is None
    clock.now = 2.0  # ingest was busy for a second: the frame the page sent meanwhile is taken, no gap is called
    camera.push(rgba)
    clock.now = 2.1
    assert next(frames).t == 2.0 and camera.ended is None
    clock.now = 2.0 + 0.6  # the page's last frame came at 2.0 s
    assert next(frames, None) is None
    assert camera.ended == "the browser camera sent no frame for 0.5 s"
