"""Sampled frames become clips: the one grouping the engine and the benchmarks share.

A clip closes at the first frame `clip_seconds` or more after its own first frame, so a clip holds
whole sampling intervals and its end is the time the next clip starts."""

from collections.abc import Iterable, Iterator

import numpy as np

MAX_CLIP_BYTES = 64 * 2**20  # a clip's decoded frames, at most: past it, every other frame goes (evenly thinned)


def grouped(frames: Iterable, clip_seconds: float,
            max_bytes: int = MAX_CLIP_BYTES) -> Iterator[tuple[list[np.ndarray], list[float]]]:
    """(frames, their video times) per clip, from `Frame(t, rgb)`s in time order. A clip whose frames would pass
    `max_bytes` keeps every other one from then on (and of those it holds), so a long clip of large frames at a high
    frame rate stays evenly sampled in bounded memory."""
    rgb, times, stride, seen, held = [], [], 1, 0, 0
    for frame in frames:
        if rgb and frame.t - times[0] >= clip_seconds:
            yield rgb, times
            rgb, times, stride, seen, held = [], [], 1, 0, 0
        seen += 1
        if (seen - 1) % stride:
            continue
        rgb.append(frame.rgb)
        times.append(frame.t)
        held += frame.rgb.nbytes
        while held > max_bytes and len(rgb) > 1:
            rgb, times, stride = rgb[::2], times[::2], stride * 2
            held = sum(f.nbytes for f in rgb)
    if rgb:
        yield rgb, times


def clip_end(times: list[float], clip_seconds: float) -> float:
    """Where a clip ends: its last frame stands for one sampling interval (a lone frame for the clip)."""
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else clip_seconds
    return times[-1] + step
