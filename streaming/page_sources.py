"""Frame sources a page drives (the app's): a file released as the player reaches it, and the browser's camera.

Both end promptly when the engine stops (they wait on its `stop` event, never on a bare sleep), so a
released session leaves no thread behind. Both read time from `clock` (monotonic seconds), so a test
can step it instead of waiting on a busy machine's wall clock.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .sources import FileSource, Frame, FrameSource, handed_over


class PlaybackSource(FrameSource):
    """A video file whose sampled frames are released once the player has shown them.

    The page reports the player's position; before any report (an API client, a player that never
    reported) a server clock stands in, running at `speed`. The player loops, so a jump from near the
    end back to the start is a new lap and video time runs on; any other backward jump is a seek, and
    ingest simply waits until playback passes what it has already taken in (nothing is re-ingested).
    """

    live = False

    def __init__(self, path, stop: threading.Event, fps: float = 1.0, loops: int = 1000, speed: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.file = FileSource(path, fps=fps, loops=loops)
        self.duration, self.stop, self.speed, self.clock = self.file.duration, stop, speed, clock
        self.started = clock()
        self.lap, self.position = 0, None  # player laps and its last reported position (None: server clock)
        self.reported_at = self.started  # when the page last reported it
        self.waited_s = 0.0  # time spent waiting for playback, left out of the ingest speed
        self.moved = threading.Event()
        self.waits = 0  # times it looked at the playback position and found the next frame not reached yet

    def report(self, position: float | None) -> None:
        """The player's position in seconds (from the page's timer)."""
        if position is None:
            return
        position, now = float(position), self.clock()
        if self.position is not None and position < self.position and (
                self.position > self.duration - 2.5 and position < 2.5
                # the page's timer late on a loaded machine: the player had time to reach the end since the last
                # report (a lap missed here would read as a seek back, and ingest would wait a lap for nothing)
                or self.position + (now - self.reported_at) >= self.duration - 0.5):
            self.lap += 1
        self.position, self.reported_at = position, now
        self.moved.set()

    def now(self) -> float:
        """Video time the viewer has reached (laps included)."""
        if self.position is None:
            return (self.clock() - self.started) * self.speed
        return self.lap * self.duration + self.position

    next_t: float | None = None  # the frame waiting for the player: every frame before it has been released
    yielded_t: float | None = None  # the newest frame released

    def done_through(self, t: float) -> bool:
        return self.next_t is not None and self.next_t > t

    def asked_at(self) -> float:
        """The player's position, at most a frame past the newest frame released (an ingest behind the player is
        waited for a frame, not until it catches up)."""
        return handed_over(self.now(), self.yielded_t, 1 / self.file.fps)

    def __iter__(self) -> Iterator[Frame]:
        for frame in self.file:
            self.next_t = frame.t
            t0 = self.clock()
            while self.now() < frame.t and not self.stop.is_set():
                self.waits += 1
                self.moved.wait(0.05)
                self.moved.clear()
            self.waited_s += self.clock() - t0
            if self.stop.is_set():
                return
            self.yielded_t = frame.t
            yield frame


class BrowserCamera(FrameSource):
    """Frames sent from the page's webcam stream, sampled at `fps` on the server's clock (live).

    The stream ends when the engine stops or when, once started, no frame has come for `timeout`
    seconds (the page closed the camera or lost it); `ended` then says so.
    """

    live = True

    def __init__(self, stop: threading.Event, fps: float = 1.0, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stop, self.fps, self.timeout, self.clock = stop, fps, timeout, clock
        self.frames: queue.Queue = queue.Queue(maxsize=2)
        self.started, self.next_t, self.ended = None, 0.0, None
        self.received, self.last_received = 0, None
        self.waited_s = 0.0  # time spent waiting for the page's frames, left out of the ingest speed

    def asked_at(self) -> float | None:
        return None if self.started is None else self.clock() - self.started

    def push(self, rgb: np.ndarray) -> None:
        """One frame from the page; frames beyond the sampling rate are not kept."""
        now = self.clock()
        self.started = self.started if self.started is not None else now
        t = now - self.started
        self.received, self.last_received = self.received + 1, now
        if t < self.next_t:
            return
        self.next_t = max(self.next_t + 1.0 / self.fps, t)
        try:
            self.frames.put_nowait(Frame(t, np.ascontiguousarray(rgb[..., :3], dtype=np.uint8)))
        except queue.Full:  # the ingest thread is behind: keep the older frames, drop this one
            pass

    def __iter__(self) -> Iterator[Frame]:
        while not self.stop.is_set():
            frame = self.taken(self.frames)
            if frame is not None:
                yield frame
            # since the page last sent a frame (kept or not), not since ingest took one: a slow clip is no gap
            elif self.last_received is not None and self.clock() - self.last_received > self.timeout:
                self.ended = f"the browser camera sent no frame for {self.timeout:g} s"
                return
