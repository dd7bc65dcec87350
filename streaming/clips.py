"""Sampled frames become clips: the one grouping the engine and the benchmarks share.

A clip closes at the first frame `clip_seconds` or more after its own first frame, so a clip holds
whole sampling intervals and its end is the time the next clip starts. A question asked at video time T
closes the open clip early, after its last frame at or before T (`ClipGrouper.cut`): the answer sees every
frame up to the moment it was asked, never a clip later."""

import bisect
import threading
from collections.abc import Iterable, Iterator

import numpy as np

MAX_CLIP_BYTES = 64 * 2**20  # a clip's decoded frames, at most: past it, every other frame goes (evenly thinned)


def clip_end(times: list[float], lone: float) -> float:
    """Where a clip ends: its last frame stands for one sampling interval (a lone frame for `lone` seconds)."""
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else lone
    return times[-1] + step


class ClipGrouper:
    """The open clip, filled a frame at a time. A clip whose frames would pass `max_bytes` keeps every other one
    from then on (and of those it holds), so a long clip of large frames at a high frame rate stays evenly sampled
    in bounded memory."""

    def __init__(self, clip_seconds: float, max_bytes: int = MAX_CLIP_BYTES):
        self.clip_seconds, self.max_bytes = clip_seconds, max_bytes
        self._reset()
        self.last_t: float | None = None  # the newest frame taken, kept or thinned out
        self.gap: float | None = None  # the last interval between frames: what a lone frame in a clip stands for

    def _reset(self) -> None:
        self.rgb, self.times, self.stride, self.seen, self.held = [], [], 1, 0, 0

    def full_before(self, t: float) -> bool:
        """A frame at `t` begins the next clip."""
        return bool(self.times) and t - self.times[0] >= self.clip_seconds

    def add(self, frame) -> tuple | None:
        """Take a frame; the clip it closed (it begins the next one), if it did."""
        closed = self.close() if self.full_before(frame.t) else None
        self.gap = frame.t - self.last_t if self.last_t is not None else self.gap
        self.last_t = frame.t
        self.seen += 1
        if (self.seen - 1) % self.stride == 0:
            self.rgb.append(frame.rgb)
            self.times.append(frame.t)
            self.held += frame.rgb.nbytes
            while self.held > self.max_bytes and len(self.rgb) > 1:
                self.rgb, self.times, self.stride = self.rgb[::2], self.times[::2], self.stride * 2
                self.held = sum(f.nbytes for f in self.rgb)
        return closed

    def close(self, at: float | None = None) -> tuple | None:
        """The open clip as (frames, times, end, cut): ended where its frames say (`clip_end`) or, cut short by a
        question, at `at`."""
        if not self.times:
            return None
        end = clip_end(self.times, self.gap or self.clip_seconds) if at is None else max(at, self.times[-1])
        out = self.rgb, self.times, end, at is not None
        self._reset()
        return out

    def before(self, at: float, passed: bool) -> bool:
        """Every frame at or before `at` is in a closed clip already: nothing for a question at `at` to cut."""
        if self.times:
            return self.times[0] > at
        return passed or (self.last_t is not None and self.last_t >= at)

    def cut(self, at: float, passed: bool) -> tuple | None:
        """Close the open clip for a question at `at`, once no frame at or before `at` can still come: the open
        clip's newest frame is at `at` or later, or `passed` (the next frame is known to be later)."""
        if not self.times or self.times[0] > at or not (passed or self.last_t >= at):
            return None
        return self.close(at)


def grouped(frames: Iterable, clip_seconds: float,
            max_bytes: int = MAX_CLIP_BYTES) -> Iterator[tuple[list[np.ndarray], list[float]]]:
    """(frames, their video times) per clip, from `Frame(t, rgb)`s in time order, with no question to cut them."""
    grouper = ClipGrouper(clip_seconds, max_bytes)
    for frame in frames:
        closed = grouper.add(frame)
        if closed:
            yield closed[:2]
    closed = grouper.close()
    if closed:
        yield closed[:2]


class Cuts:
    """The video times questions were asked at, not yet reached by ingest: each closes the open clip there.
    Added from any thread (a viewer's question), read by the ingest thread."""

    def __init__(self, wake=lambda: None):
        """`wake()`: tells the ingest thread, which may be waiting for a frame, that a cut was added."""
        self._times: list[float] = []
        self._lock = threading.Lock()
        self.wake = wake

    def add(self, t: float | None) -> None:
        if t is not None:
            with self._lock:
                bisect.insort(self._times, float(t))
            self.wake()

    def add_all(self, times) -> None:
        for t in times:
            self.add(t)

    def first(self) -> float | None:
        with self._lock:
            return self._times[0] if self._times else None

    def done(self, t: float, inclusive: bool = True) -> None:
        """Every cut at or before `t` (before it: `inclusive` False) is done: its frames are in clips already."""
        with self._lock:
            cut = bisect.bisect_right if inclusive else bisect.bisect_left
            del self._times[:cut(self._times, t)]
