"""The change gate (issue 70): a clip whose frames all look like the last frame perception saw is not seen again.

An edge camera shows the same scene most of the hour, and perception (the classifier, its tiles, the encoder and the
detector: ~290 ms a frame on a 2-core CPU) is most of what a stream costs. Ingest asks the gate about each clip before
`adapter.see`: when every frame is unchanged against the reference (the last frame that went through perception), the
clip reuses that perception, becomes no KV turn and no store span, and the clip log's newest entry grows to cover it
(`TurnEngine.feed`). The gate decides on pixels alone, before any model runs, so it is the same for every model.

The measure, on each frame's luma shrunk by area averaging to 96×54 (sensor noise and compression's blocks average
out there), against the reference shrunk the same way:
- a gain and an offset fitted by least squares take out the whole frame's lighting (a slow drift, auto exposure);
  a fitted gain outside `GAIN` (the lights went off or on) counts as a change;
- what is left is averaged over a 16×9 grid of cells, and a cell at `CELL_LEVELS` or more (of 255) is a change: a
  thing entering moves the cells it covers even when it is small in the frame.
`CELL_LEVELS` comes from `python -m benchmarks gate` (benchmarks/results/README.md, "gate"): real photos encoded
frame by frame with sensor noise up to σ 8, an 8% lighting drift and JPEG compression stay under 6; consecutive 1-fps
frames of the natural hour's real clips are 48 or more; a figure a twelfth of the frame's height (25-33 px) sliding in
from the edge reaches 10 once about half of it is in view (a sliver of a few pixels is under the gate's grain: the
clip's later frames, with more of it in, are what open the gate).
"""

from dataclasses import dataclass, field

import cv2
import numpy as np

GRID = (96, 54)  # (width, height) a frame's luma is shrunk to
CELLS = (16, 9)  # the grid of cells a change is looked for in
CELL_LEVELS = 10.0  # a cell's mean absolute difference (of 255), lighting taken out, from which it changed
GAIN = (0.8, 1.25)  # a fitted lighting gain outside this is a change (lights on or off), not a drift
FLAT = 1.0  # a reference whose luma varies less than this (its standard deviation) has no texture to fit a gain to


def shrunk(rgb: np.ndarray) -> np.ndarray:
    """A frame's luma at `GRID`, as floats."""
    luma = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    return cv2.resize(luma, GRID, interpolation=cv2.INTER_AREA).astype(np.float32)


def difference(frame: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(fitted gain, the largest cell's mean absolute difference) of two shrunk frames, lighting taken out."""
    if reference.std() < FLAT:  # no texture to fit a gain to (a black screen): the brightness's step is the gain
        gain = (frame.mean() + 16) / (reference.mean() + 16)  # 16: a black screen's noise is no light switched on
        rest = np.abs(frame - frame.mean())
    else:
        design = np.stack([reference.ravel(), np.ones(reference.size, np.float32)], axis=1)
        (gain, offset), *_ = np.linalg.lstsq(design, frame.ravel(), rcond=None)
        rest = np.abs(frame - (gain * reference + offset))
    (cols, rows), (width, height) = CELLS, GRID
    cells = rest[: height // rows * rows, : width // cols * cols].reshape(rows, height // rows, cols, width // cols)
    return float(gain), float(cells.mean(axis=(1, 3)).max())


def changed(frame: np.ndarray, reference: np.ndarray, cell_levels: float = CELL_LEVELS) -> bool:
    """Whether a shrunk frame differs from the reference by more than noise, drift and compression do."""
    gain, most = difference(frame, reference)
    return most >= cell_levels or not GAIN[0] <= gain <= GAIN[1]


@dataclass
class ChangeGate:
    """One stream's gate: the reference is the last frame that went through perception."""

    cell_levels: float = CELL_LEVELS
    _reference: np.ndarray | None = field(default=None, repr=False)

    def unchanged(self, frames: np.ndarray) -> bool:
        """Whether every frame of a clip is unchanged against the reference (never before the first perception)."""
        if self._reference is None:
            return False
        return not any(changed(shrunk(f), self._reference, self.cell_levels) for f in frames)

    def perceived(self, frames: np.ndarray) -> None:
        """A clip went through perception: its last frame is the reference now."""
        self._reference = shrunk(frames[-1])
