"""What a frame source is, written once: the engine, `stream-qa`, the app and the soak take any `FrameSource`
(sources.py has the files, cameras, URLs and pipes; page_sources.py the page's player and camera; source_spec.py
names each kind one way for every front end)."""

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .errors import UserError


class SourceError(UserError):
    """A video source cannot be opened or read; the message is one line for the user."""


@dataclass(frozen=True)
class Frame:
    t: float  # seconds of video time since the stream began (grows across loops)
    rgb: np.ndarray  # (H, W, 3) uint8


class FrameSource:
    """What the engine, `stream-qa`, the app and the soak take as a source of frames, written down once. A source
    iterates `Frame`s in video-time order and raises `SourceError` (one line) when it cannot start; it says:

    - `live`: its frames come on a clock the model cannot stop (a camera, a file played in real time), so the
      engine drops a clip it has no room for instead of falling behind;
    - `waited_s`: seconds spent waiting for that clock rather than decoding, left out of the ingest speed;
    - `duration`: seconds of video in one pass, where known (a file, a served file), else None;
    - `ended`: why it stopped before its video did, in words (the app says it in the chat), else None;
    - `asked_at()`: the video time a question asked now is about, where the source has a now (a paced file, a player,
      a camera, a client's last frame), else None: a question asked without a time is asked at it
      (`LiveSession.ask`). A file played to a clock bounds it by the frames it has handed over, so a question never
      waits for an ingest that has fallen behind the clock, only for the frame or two it holds;
    - `done_through(t)`: whether every frame at or before `t` has been yielded already (a paced source knows its
      next frame's time before it is due), so a question at `t` need not wait for the frame after it.

    A source paced to a clock reads `clock` and waits with `sleep` (`pace`): the wall clock, unless a test gives it
    one it steps itself. A new source subclasses this, sets what differs from these defaults, and is named as a kind in
    `source_spec.SourceSpec`, which every front end opens sources through."""

    live: bool = False
    waited_s: float = 0.0
    duration: float | None = None
    ended: str | None = None
    clock: Callable[[], float] = staticmethod(time.monotonic)
    sleep: Callable[[float], None] = staticmethod(time.sleep)

    def pace(self, start: float, t: float) -> float:
        """Wait until video time `t` of a stream that began at `start` on the source's clock; the time waited."""
        delay = start + t - self.clock()
        if delay > 0:
            self.sleep(delay)
        return max(delay, 0.0)

    def taken(self, frames, timeout: float = 0.1):
        """The next item a source's queue of pushed frames holds, or None after `timeout`: the wait counted in
        `waited_s` (a pushed source waits for its sender, not for decoding)."""
        t0 = self.clock()
        try:
            return frames.get(timeout=timeout)
        except queue.Empty:
            return None
        finally:
            self.waited_s += self.clock() - t0

    def asked_at(self) -> float | None:
        return None

    def done_through(self, t: float) -> bool:
        return False

    def __iter__(self) -> Iterator[Frame]:
        raise NotImplementedError
