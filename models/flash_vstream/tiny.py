"""flash-vstream-tiny: Flash-VStream's STAR memory around tiny-vlm's encoder, projector and SmolLM2.

Runs the whole memory pipeline on a CPU with a real (small) model: tiny-vlm's frame encoder gives
4×4 = 16 tokens of 1408 features per frame, the STAR memory (sizes below) compresses the stream,
and tiny-vlm's projector maps the read-out into SmolLM2-135M's embeddings. tiny-vlm was trained on
clip-averaged tokens, which live in the same feature space as the memory's pooled tokens.

Sizes, scaled from Flash-VStream-7B's 16×16 CLIP grid to tiny-vlm's 4×4 grid: the spatial memory
keeps frames at full 4×4 (the 7B pools 16×16 to 8×8, but 2×2 would leave too little detail), the
temporal memory pools to 2×2 (the 7B: 4×4), the abstract memory to 1×1 (as the 7B). Lengths are the
7B's: 25 temporal centroids, 25 abstract slots, 3 retrieved frames, 1 current frame, so a full
read-out is 25·1 + 25·4 + 3·16 + 1·16 = 189 tokens. With no trained abstract-memory attention,
slots are updated by plain scaled dot-product attention (identical for one token per frame).
"""

from pathlib import Path

import numpy as np
import torch

from ..base import AdapterInfo
from ..tiny_vlm.model import WEIGHTS, TinyTurns, TinyVLM
from .adapter import MemoryAdapter
from .star_memory import StarConfig, StarMemory

TINY_STAR = StarConfig(spatial_size=4, temporal_size=2, abstract_size=1)


class FlashVStreamTiny(TinyTurns, MemoryAdapter):
    name = "flash-vstream-tiny"

    def __init__(self, weights: str | Path = WEIGHTS, device: str = "cpu", trained: bool = True,
                 star: StarConfig = TINY_STAR, seed: int = 0):
        """Arguments as TinyVLM's (so `load_adapter` can pass a weights folder), plus the memory's sizes."""
        self.vlm = TinyVLM(weights, device=device, trained=trained)
        self.model, self.tokenizer = self.vlm.model, self.vlm.tokenizer
        super().__init__(StarMemory(star, seed=seed))

    def features(self, frames: np.ndarray) -> torch.Tensor:
        return self.vlm.encoder(frames)

    @torch.no_grad()
    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vlm.project(tokens)

    def describe(self) -> AdapterInfo:
        cfg = self.model.config
        return AdapterInfo(self.name, self.memory.config.max_tokens, str(self.model.dtype), str(self.device),
                           cfg.max_position_embeddings, cfg.hidden_size)
