"""Frames a client pushes, each with its own video time (the HTTP server's sessions, `stream-qa --server`).

The client's clock is the video's: times must grow, and the engine takes the frames at the session's rate (`fps`):
a frame sooner than 1/fps after the last one kept is counted and let go before it is decoded. A bounded queue
holds what the model has not taken yet; a push that finds it full waits a little, then says so (the server turns
that into 429 and Retry-After), so a client faster than the model slows down instead of filling memory.
"""

import math
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np

from .frames import Frame, FrameSource, SourceError

_END = object()


class PushedFrames(FrameSource):
    live = False  # the client waits for room: nothing it sent is dropped

    def __init__(self, stop: threading.Event, fps: float | None = None, capacity: int = 16,
                 max_bytes: int = 64 * 2**20):
        self.stop = stop
        self.interval = 1.0 / fps if fps else 0.0
        self.due: float | None = None  # when the next frame is due (a quarter interval early still counts)
        self.skipped = 0  # frames let go: sooner than the session's rate
        self.frames: queue.Queue = queue.Queue(maxsize=capacity)
        self.max_bytes, self.queued_bytes = max_bytes, 0  # decoded bytes waiting: a frame count alone lets 16
        self.size: tuple[int, int] | None = None  # the session's frame size: the first frame's (H, W)
        self.last_t: float | None = None
        self.kept_t: float | None = None  # the last frame kept: what "now" is for a question asked without a time
        self.pushed = 0
        self.ending = False
        self.waited_s = 0.0  # time spent waiting for the client's frames, left out of the ingest speed
        self._lock, self._bytes = threading.Lock(), threading.Lock()

    def push(self, rgb, t: float, wait: float = 5.0) -> bool:
        """One frame at video time `t` seconds (an array, or a call that decodes it: made only for a frame kept);
        False when the queue stayed full for `wait` seconds (try later)."""
        with self._lock:  # one push at a time: times stay in order in the queue
            if self.ending:
                raise SourceError("this stream was ended: it takes no more frames")
            if not math.isfinite(t) or t < 0:
                raise SourceError(f"a frame's time must be a number of seconds >= 0, got {t}")
            if self.last_t is not None and t <= self.last_t:
                raise SourceError(f"frame times must grow: {t:g} s after {self.last_t:g} s")
            early = 0.25 * self.interval  # a camera's frames jitter; the kept ones keep the rate on average
            if self.due is not None and t < self.due - early:  # sooner than the session's rate
                self.last_t, self.pushed, self.skipped = float(t), self.pushed + 1, self.skipped + 1
                return True
            rgb = rgb() if callable(rgb) else rgb
            frame = Frame(float(t), self.fitted(np.ascontiguousarray(rgb[..., :3], dtype=np.uint8)))
            deadline = time.monotonic() + wait
            while self.queued_bytes and self.queued_bytes + frame.rgb.nbytes > self.max_bytes:
                if time.monotonic() >= deadline or self.stop.is_set():
                    return False
                time.sleep(0.02)  # the engine takes frames within a clip's time
            try:
                self.frames.put(frame, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                return False
            with self._bytes:
                self.queued_bytes += frame.rgb.nbytes
            self.last_t = self.kept_t = frame.t
            self.due = max(self.due if self.due is not None else frame.t, frame.t - early) + self.interval
            self.pushed += 1
            return True

    def asked_at(self) -> float | None:
        """A question asked without a time is about every frame sent so far: asked at the last one kept."""
        return self.kept_t

    def fitted(self, rgb: np.ndarray) -> np.ndarray:
        """A frame at the session's size: a camera that switches resolution mid-clip is resized, never a stream
        that dies of frames that will not stack."""
        if self.size is None:
            self.size = rgb.shape[:2]
        if rgb.shape[:2] == self.size:
            return rgb
        import cv2

        return cv2.resize(rgb, (self.size[1], self.size[0]), interpolation=cv2.INTER_AREA)

    def end(self) -> None:
        """No more frames: the engine closes the last clip and answers what is still asked."""
        with self._lock:
            if not self.ending:
                self.ending = True
                while not self.stop.is_set():
                    try:
                        self.frames.put(_END, timeout=0.1)
                        return
                    except queue.Full:
                        continue

    def __iter__(self) -> Iterator[Frame]:
        while not self.stop.is_set():
            item = self.taken(self.frames)
            if item is None:
                continue
            if item is _END:
                return
            with self._bytes:
                self.queued_bytes -= item.rgb.nbytes
            yield item
