"""Chat-UniVi's frame sampling: 1 fps, capped at its maximum frame count.

From Chat-UniVi's code (github.com/PKU-YuanGroup/Chat-UniVi):

- `_get_rawvideo_dec` (ChatUniVi/eval/model_video_qa.py, README): frames taken every round(fps / 1)
  source frames, and when more than `max_frames` remain, `max_frames` of them at evenly spaced
  positions; `max_frames` defaults to MAX_IMAGE_LENGTH = 64 (ChatUniVi/constants.py; their README
  demo raises it to 100).
- `CLIPVisionTower` (ChatUniVi/model/multimodal_encoder/clip_encoder.py): layer -2 without CLS, as
  `models.clip_vision.ClipTower` runs it for both ports.
"""

from collections.abc import Sequence

import numpy as np

MAX_FRAMES = 64  # ChatUniVi/constants.py MAX_IMAGE_LENGTH
SAMPLE_FPS = 1


def sample_frames(timestamps: Sequence[float], count: int, fps: float = SAMPLE_FPS,
                  max_frames: int = MAX_FRAMES) -> list[int]:
    """Indices of the frames Chat-UniVi would keep: one per 1/fps seconds, at most `max_frames`.

    The source frame rate is estimated from the timestamps; without usable ones every frame counts.
    """
    stride = 1
    if len(timestamps) == count and count > 1 and timestamps[-1] > timestamps[0]:
        source_fps = (count - 1) / (float(timestamps[-1]) - float(timestamps[0]))
        stride = max(1, round(source_fps / fps))
    kept = list(range(0, count, stride))
    if len(kept) > max_frames:
        kept = [kept[i] for i in np.linspace(0, len(kept) - 1, num=max_frames, dtype=int)]
    return kept
