"""The app's page-driven sources on the real bikes.mp4 and real frames: ingest follows the player's
position (pauses, seeks, laps of the looping player) and the browser camera is sampled and timed out."""

import threading
import time

import numpy as np
import pytest

from app.sources import BrowserCamera, PlaybackSource
from streaming.sources import bundled_clip


def pull(source, n, timeout=5.0):
    """Up to n frames from a source on a thread, as the engine's ingest thread would take them."""
    got, it = [], iter(source)

    def run():
        for frame in it:
            got.append(frame)
            if len(got) == n:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return got, t


def test_frames_are_released_only_up_to_the_player_position():
    stop = threading.Event()
    source = PlaybackSource(bundled_clip(), stop, fps=1.0)
    source.report(3.2)  # the player is at 3.2 s: frames 0..3 may go in, not 4
    got, t = pull(source, 10, timeout=1.5)
    assert [f.t for f in got] == pytest.approx([0, 1, 2, 3], abs=0.05) and t.is_alive()  # waiting for playback
    source.report(1.0)  # a seek back: nothing is taken in twice, ingest waits for playback to pass 4 s
    time.sleep(0.3)
    assert len(got) == 4
    source.report(5.0)
    time.sleep(0.5)
    assert [round(f.t) for f in got] == [0, 1, 2, 3, 4, 5]
    stop.set()  # the engine stopping ends a waiting source at once
    t.join(1.0)
    assert not t.is_alive()


def test_the_looping_player_starts_a_new_lap_and_video_time_runs_on():
    source = PlaybackSource(bundled_clip(), threading.Event(), fps=1.0)
    source.report(9.6)
    source.report(0.4)  # wrapped from the end to the start: lap 2
    assert source.now() == pytest.approx(10.4)
    source.report(4.0)  # an ordinary seek back within the lap
    assert source.now() == pytest.approx(14.0)


def test_without_a_player_a_server_clock_paces_ingest():
    stop = threading.Event()
    source = PlaybackSource(bundled_clip(), stop, fps=2.0, speed=10.0)
    t0 = time.monotonic()
    got, _ = pull(source, 10)
    assert len(got) == 10 and got[-1].t == pytest.approx(4.5, abs=0.05)
    assert time.monotonic() - t0 >= 0.4  # 4.5 s of video at 10× takes 0.45 s
    stop.set()


def test_browser_camera_samples_pushed_frames_and_times_out():
    from skimage import data

    stop = threading.Event()
    camera = BrowserCamera(stop, fps=4.0, timeout=0.5)
    frame = data.astronaut()  # a real photo stands in for a webcam frame
    got, t = pull(camera, 100, timeout=3.0)
    for _ in range(20):  # 20 frames over ~1 s, 4 fps kept
        camera.push(np.dstack([frame, np.full(frame.shape[:2], 255, np.uint8)]))  # RGBA from the page
        time.sleep(0.05)
    t.join(2.0)
    assert not t.is_alive() and camera.ended == "the browser camera sent no frame for 0.5 s"
    assert 3 <= len(got) <= 6 and camera.received == 20
    assert got[0].rgb.shape == frame.shape and all(b.t - a.t >= 0.2 for a, b in zip(got, got[1:], strict=False))
