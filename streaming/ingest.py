"""One stream's ingest: frames read from the source, grouped into clips, encoded, and queued for the model thread.

Two threads: the reader takes the source's frames as they come (a file decodes, a camera or a client delivers),
and the ingest thread groups them (`clips.ClipGrouper`) and encodes each clip (the adapter's pure `see`). They are
apart so that a question can close the open clip at its time while the source is still waiting for its next frame:
a question asked after the last frame a client sent, or mid-clip while a player plays, is answered about every frame
up to that moment, not a clip later. With `drop_when_full` (live sources: a camera cannot wait) a clip that finds
the queue full is dropped and counted rather than falling behind.
"""

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from models.base import EncodedClip

from .clips import ClipGrouper, Cuts
from .gate import ChangeGate

END = object()  # the source has ended
WAKE = object()  # nothing to take: look again (a question arrived, or a poll timed out)
CUT_POLL_S = 0.05  # how often ingest, waiting for a frame, looks whether a question's clip can close
IDLE_POLL_S = 0.25  # how often it looks for a stop when no question waits
SHOWN_WIDTH = 640


@dataclass
class Clip:
    index: int  # 1-based, as the model hears it ("Clip 3")
    start: float
    end: float
    encoded: EncodedClip  # the adapter's `encode`: (N, hidden) embeddings (or features) and what it learned
    encode_s: float
    frame: np.ndarray | None = None  # its last frame, at most `SHOWN_WIDTH` wide: what the app draws the boxes on
    last: float | None = None  # its last frame's video time
    cut: bool = False  # closed early, at a question's time (`end`): it holds every frame up to its end
    shown: tuple = ()  # (video time, frame at most `SHOWN_WIDTH` wide): the last, and those counts were read in
    merged: int = 0  # frames the change gate found unchanged, when it found all of them: `encoded` is the last
    # perceived clip's (0: perceived)


@dataclass
class Telemetry:
    clips: int = 0
    dropped: int = 0
    video_s: float = 0.0
    ingest_s: float = 0.0  # seconds spent decoding (the reader thread) and encoding (the ingest thread)
    failed: int = 0  # clip turns dropped because their prefill raised
    oom_retries: int = 0  # prefills retried after an out-of-memory error, with a tighter budget
    gated: int = 0  # frames the change gate found unchanged (their perception reused)
    merged: int = 0  # clips of such frames alone: the clip log's previous entry grew over them, no KV turn

    @property
    def ingest_speed(self) -> float:
        """Video seconds encoded per second of ingest work (≥ 1: keeps up with real time)."""
        return self.video_s / self.ingest_s if self.ingest_s else float("inf")


@dataclass(frozen=True)
class Reached:
    """Every frame at or before `t` is in the clips queued already: a question at `t` with nothing new to see (the
    clip before it closed at an earlier question, or between frames) is answered now, not with the next clip."""

    t: float


def shown(frame: np.ndarray) -> np.ndarray:
    """A frame small enough to keep one per stream for display (every other row and column until it fits)."""
    step = -(-frame.shape[1] // SHOWN_WIDTH)
    return np.ascontiguousarray(frame[::step, ::step])


def _nudge(frames: queue.Queue) -> None:
    """Wake the ingest thread from its wait for a frame; a full queue needs none."""
    with contextlib.suppress(queue.Full):
        frames.put_nowait(WAKE)


class Ingest:
    """What the engine's ingest thread does for one run of a source: clips into `clips`, `END` last. An error on
    either thread is kept in `error` (the model thread raises it); `stop` ends both promptly."""

    def __init__(self, adapter, clip_seconds: float, clips: queue.Queue, stop: threading.Event, telemetry: Telemetry,
                 cuts: Cuts, drop_when_full: bool, resume_at: tuple[int, float], gate: ChangeGate | None = None):
        self.adapter, self.clip_seconds, self.clips, self.stop = adapter, clip_seconds, clips, stop
        self.telemetry, self.cuts, self.drop_when_full, self.gate = telemetry, cuts, drop_when_full, gate
        self._perceived: EncodedClip | None = None  # the last clip that went through perception (the gate's)
        self.index, self.skip_before = resume_at
        self.error: BaseException | None = None
        self._frames: queue.Queue = queue.Queue(maxsize=1)  # a frame read ahead at most: little memory held
        self._read_s = 0.0  # decoding work of the reader thread, its waits for the video left out
        self._read_counted = 0.0  # the part of it counted into the clips emitted so far

    # --- the reader thread ----------------------------------------------------------------------

    def _read(self, source) -> None:
        frames_in = iter(source)
        started = self._clock(source)
        try:
            while (frame := next(frames_in, None)) is not None:
                if self.stop.is_set():
                    return
                if frame.t < self.skip_before:  # a resumed session holds it already: its decoding is not ingest
                    started = self._clock(source)
                    continue
                self._read_s += self._clock(source) - started
                if not self._offer(frame):
                    return
                started = self._clock(source)
        except BaseException as err:  # handed to the model thread, which reports it
            self.error = err
        finally:
            close = getattr(frames_in, "close", None)
            if close:  # a generator source releases its file or camera now, not at garbage collection
                close()
            self._offer(END)

    def _offer(self, item) -> bool:
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                self._frames.put(item, timeout=0.2)
                return True
        return False

    # --- the ingest thread ----------------------------------------------------------------------

    def run(self, source) -> None:
        self.cuts.wake = lambda: _nudge(self._frames)
        reader = threading.Thread(target=self._read, args=(source,), name="frames", daemon=True)
        reader.start()
        grouper = ClipGrouper(self.clip_seconds)
        try:
            while not self.stop.is_set():
                try:
                    item = self._frames.get(timeout=CUT_POLL_S if self.cuts.first() is not None else IDLE_POLL_S)
                except queue.Empty:
                    item = WAKE
                if item is END:
                    break
                for clip in self._closed(grouper, source, None if item is WAKE else item):
                    if self.stop.is_set():
                        return
                    self.put(clip, force=True) if isinstance(clip, Reached) else self._emit(*clip, source)
            if self.error is None and not self.stop.is_set() and (last := grouper.close()):
                self._emit(*last, source)  # the source ended: its last clip goes in whole
        except BaseException as err:  # handed to the model thread, which reports it
            self.error = err
        finally:
            if self.error is not None:  # the reader may be waiting to hand over a frame: it stops too
                self.stop.set()
            reader.join(timeout=5)
            self.put(END, force=True)

    def _closed(self, grouper: ClipGrouper, source, frame):
        """The clips a frame (or, None, a pause in the frames) closes: by length, or early at a question's time;
        then `Reached(t)` for the question's time, whether a clip closed for it or nothing was left to close."""
        while frame is not None and (at := self.cuts.first()) is not None and at < frame.t:
            # the frame is past a question: the clip open before it ends there (or by its own length, if it is full)
            closed = grouper.close() if grouper.full_before(frame.t) else grouper.cut(at, passed=True)
            if closed:
                yield closed
            self.cuts.done(at)
            yield Reached(at)
        if frame is not None and (closed := grouper.add(frame)):
            yield closed
        while (at := self.cuts.first()) is not None:
            # the source is asked first: a frame it has let go is in the queue by then, and a waiting frame goes first
            passed = source.done_through(at) and self._frames.empty()
            cut = grouper.cut(at, passed)
            if cut is None and not grouper.before(at, passed):
                return  # frames at or before the question's time may still come
            self.cuts.done(at)
            yield cut or Reached(at)

    @staticmethod
    def _clock(source) -> float:
        """Seconds of ingest work so far: wall time less what a paced source spent waiting for the video."""
        return time.perf_counter() - source.waited_s

    def _emit(self, frames, times, end: float, cut: bool, source) -> None:
        """A clip's ingest work is its encoding here plus its frames' decoding on the reader thread, which runs
        ahead in parallel: the ingest thread's own wall time would count the reader's waits for the video."""
        started = time.perf_counter()
        stacked = np.stack(frames)
        merged = self.gate is not None and self._perceived is not None and self.gate.unchanged(stacked)
        if merged:  # nothing moved since perception last ran: its findings stand, and the clip costs no model work
            visual = self._perceived
        else:
            with torch.inference_mode():
                visual = self.adapter.see(stacked, times)
            if self.gate is not None:
                self.gate.perceived(stacked)
                self._perceived = visual
        read_s, self._read_counted = self._read_s - self._read_counted, self._read_s
        spent = time.perf_counter() - started + read_s
        self.telemetry.ingest_s += spent
        self.telemetry.video_s += end - times[0]
        self.index += 1
        # small copies of the last frame and of those the detector's counts were read in (an alert's snapshot), not
        # of every frame: this runs for every frame of every stream
        counted = set(visual.meta.get("counted_at", {}).values())
        kept = tuple((float(t), shown(f)) for t, f in zip(times[:-1], frames[:-1], strict=True) if t in counted)
        last = shown(frames[-1])
        kept += ((float(times[-1]), last),)
        self.put(Clip(self.index, times[0], end, visual, spent, last, times[-1], cut, kept, len(frames) * merged))

    def put(self, item, force: bool = False) -> None:
        """Queue a clip (or, `force`d, the end): never dropped, but given up once the model thread has stopped."""
        while not self.stop.is_set():
            try:
                self.clips.put(item, timeout=0.2)
                return
            except queue.Full:
                if self.drop_when_full and not force:
                    self.telemetry.dropped += 1
                    return
