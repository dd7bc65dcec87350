"""Sampled frames become clips: the one grouping the engine and the benchmarks share.

A clip closes at the first frame `clip_seconds` or more after its own first frame, so a clip holds
whole sampling intervals and its end is the time the next clip starts."""

from collections.abc import Iterable, Iterator

import numpy as np


def grouped(frames: Iterable, clip_seconds: float) -> Iterator[tuple[list[np.ndarray], list[float]]]:
    """(frames, their video times) per clip, from `Frame(t, rgb)`s in time order."""
    rgb, times = [], []
    for frame in frames:
        if rgb and frame.t - times[0] >= clip_seconds:
            yield rgb, times
            rgb, times = [], []
        rgb.append(frame.rgb)
        times.append(frame.t)
    if rgb:
        yield rgb, times


def clip_end(times: list[float], clip_seconds: float) -> float:
    """Where a clip ends: its last frame stands for one sampling interval (a lone frame for the clip)."""
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else clip_seconds
    return times[-1] + step
