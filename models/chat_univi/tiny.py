"""chat-univi-tiny: Chat-UniVi's token merging on tiny-vlm, so the merged-token pipeline runs on CPU.

tiny-vlm gives 16 features (4×4 patches, 1408 wide) per frame and maps features to SmolLM2's
576-d embeddings with its projector. Here a clip's frames are sampled at 1 fps, and their features
merged exactly as Chat-UniVi merges CLIP features: on features, *before* the projector (Chat-UniVi's
`project` in ChatUniVi/model/arch.py clusters first and applies `mm_projector` last). The spatial
steps keep Chat-UniVi's share of the frame (64, 32, 16 of 256 → 4, 2, 1 of 16), so a clip becomes
7 tokens per event instead of tiny-vlm's 16 time-averaged ones. The texts are tiny-vlm's.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..base import AdapterInfo, VideoAdapter
from ..tiny_vlm.encoder import GRID
from ..tiny_vlm.model import WEIGHTS, TinyTurns, TinyVLM
from . import merging
from .vision import MAX_FRAMES, sample_frames

STEPS = merging.scaled_steps(GRID * GRID)


class ChatUniViTiny(TinyTurns, VideoAdapter):
    name = "chat-univi-tiny"

    def __init__(self, weights: str | Path | None = None, device: str = "cpu", trained: bool = True,
                 max_frames: int = MAX_FRAMES, ties: str = "noise", merge_eps: float = merging.MERGE_EPS,
                 seed: int = 0):
        """`ties`, `merge_eps`, `seed`: as `ChatUniVi` (Chat-UniVi's merging by default, seeded per clip)."""
        self.vlm = TinyVLM(weights or WEIGHTS, device=device, trained=trained)
        self.model, self.tokenizer = self.vlm.model, self.vlm.tokenizer
        self.max_frames = max_frames
        if ties not in merging.TIES:
            raise ValueError(f"ties must be one of {merging.TIES}, got {ties!r}")
        self.ties, self.merge_eps, self.seed = ties, merge_eps, seed

    @torch.no_grad()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> torch.Tensor:
        kept = sample_frames(timestamps, len(frames), max_frames=self.max_frames)
        features = self.vlm.encoder(np.asarray(frames)[kept])  # (T, 16, 1408)
        options = merging.Options(self.ties, self.merge_eps, torch.Generator().manual_seed(self.seed))
        return self.vlm.project(merging.clip_tokens(features, STEPS, options=options))

    def describe(self) -> AdapterInfo:
        cfg = self.model.config
        return AdapterInfo(self.name, merging.tokens_per_event(STEPS, GRID * GRID), str(self.model.dtype),
                           str(self.device), cfg.max_position_embeddings, cfg.hidden_size)
