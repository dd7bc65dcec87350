"""What a stream reads, said one way by every front end: `SourceSpec(kind, target, …).open(stop, policy)`.

`stream-qa` names files, webcams and URLs; the server files from its media folder, URLs and frames its clients push;
the app its player (a file released as the page plays it) and the two cameras. Each front end turns what its user gave
into a spec, and the spec alone knows which frame source that is, so a new kind of source is one class and one entry
in `open` here, whoever offers it. A file or a URL is checked when it is opened (a missing file, a refused address:
one line, `SourceError`); the URL rules (`urls.py`) are the caller's (`LOCAL` for a user's own run, the server's own
for a server).
"""

import threading
from dataclasses import dataclass
from pathlib import Path

from .frames import FrameSource, SourceError
from .urls import LOCAL, UrlPolicy, redact

KINDS = ("file", "webcam", "url", "push", "player", "browser-camera")


@dataclass(frozen=True)
class SourceSpec:
    """`kind` (one of `KINDS`); `target`: the file's path, the webcam's index or the URL (none for pushed frames and
    the browser camera); `realtime`: a file or URL paced at its own speed (False: as fast as it decodes); `loops`: a
    file played again, video time running on; `speed`: the player's clock before the page reports a position."""

    kind: str
    target: str | int | None = None
    fps: float = 1.0
    realtime: bool = True
    loops: int = 1
    speed: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SourceError(f"unknown source kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if (self.target is None) != (self.kind in ("push", "browser-camera")):
            raise SourceError(f"a {self.kind} source " + ("takes no target" if self.target is not None
                                                          else "needs a file, a webcam index or a URL"))

    @classmethod
    def of(cls, where: dict, **options) -> "SourceSpec":
        """From the command line's and a session folder's form: {"video": path} | {"webcam": index} | {"url": url}."""
        given = {k: v for k, v in where.items() if v is not None}
        if len(given) != 1:
            raise SourceError("give exactly one source: a video file, --webcam N or --url URL")
        (key, target), = given.items()
        return cls({"video": "file", "webcam": "webcam", "url": "url"}[key], target, **options)

    @property
    def label(self) -> str:
        """What a listing or a page calls it (a URL's credentials left out)."""
        if self.kind in ("file", "player"):
            return Path(self.target).name
        return {"webcam": f"webcam {self.target}", "url": redact(str(self.target)), "push": "pushed frames",
                "browser-camera": "browser camera"}[self.kind]

    def open(self, stop: threading.Event | None = None, policy: UrlPolicy = LOCAL) -> FrameSource:
        """The frame source; `stop` ends the sources that wait for frames (pushed, the player, the browser camera)."""
        if self.kind in ("file", "webcam", "url"):
            from .sources import open_source

            where = {"file": "video", "webcam": "webcam", "url": "url"}[self.kind]
            return open_source(**{where: self.target}, fps=self.fps, realtime=self.realtime, loops=self.loops,
                               policy=policy)
        stop = stop or threading.Event()
        if self.kind == "push":
            from .pushed import PushedFrames

            return PushedFrames(stop, fps=self.fps)
        from .page_sources import BrowserCamera, PlaybackSource

        if self.kind == "player":
            return PlaybackSource(self.target, stop, fps=self.fps, speed=self.speed)
        return BrowserCamera(stop, fps=self.fps)
