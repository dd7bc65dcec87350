"""Chat-UniVi (Jin et al., CVPR 2024): CLIP ViT-L/14 → DPC-KNN token merging → linear projector → Vicuna.

The pipeline of one clip, as ChatUniVi/model/arch.py runs it: frames sampled at 1 fps (at most 64),
CLIP patch features of layer -2 without the CLS token, merged into 112 tokens per event (video) or
per frame (one or two frames), then `mm_projector`; the LLM is a plain `LlamaForCausalLM` fed with
`inputs_embeds`, so the core's cache drives it like any other.

Prompts follow Chat-UniVi's "v1" conversation (ChatUniVi/conversation.py, `conv_v1`, the default
of their video evaluation scripts): the Vicuna system prompt, turns "USER: …" and "ASSISTANT: …"
separated by " " after user turns and "</s>" after answers, and the video placeholder first in its
user message followed by "\n" (`DEFAULT_IMAGE_TOKEN * frames + '\n' + question`). Here each clip is
a user message of its own and the question another, so turns can be appended as the stream goes
(ARCHITECTURE.md, "Where the streaming prompt departs from the originals"; the one-shot form is
`models.llava_prompt`). The system turn is BOS as an id, then the system text, as their
`tokenizer_image_token` gives it under every `legacy` setting. Later turns start without a space: a
Llama tokenizer adds the word-start marker itself, as " USER:" has inside one prompt.

Merging is Chat-UniVi's by default, its 1e-6 tie noise drawn from a generator seeded per clip (so a
clip's tokens are reproducible); `ties="index"`, `merge_eps=0` give our deterministic variant.
tests/test_originals_parity.py checks the whole pipeline against outputs recorded from their code.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..base import AdapterInfo, VideoAdapter
from . import merging
from .checkpoint import load_checkpoint
from .vision import MAX_FRAMES, sample_frames

SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def cluster_settings(config: dict, frame_tokens: int):
    """(use_cluster, spatial steps, temporal rate) from the checkpoint's `config` entry (model_config.py's keys)."""
    cfg = config.get("config") or {}
    rates = [cfg.get(f"spatial_cluster_rate{i}", c) for i, (c, _) in enumerate(merging.SPATIAL_STEPS)]
    steps, n = [], frame_tokens
    for rate, (_, k) in zip(rates, merging.SPATIAL_STEPS, strict=True):
        n = merging.cluster_count(rate, n)  # a fraction applies to the previous step's tokens, as in CTM
        steps.append((n, k))
    return bool(cfg.get("use_cluster", True)), tuple(steps), cfg.get("temporal_cluster_rate", merging.TEMPORAL_RATE)


def unclustered(features: torch.Tensor) -> torch.Tensor:
    """Chat-UniVi without clustering: a video is its time-averaged patches plus one mean token per frame."""
    if features.shape[0] < merging.VIDEO_MIN_FRAMES:
        return features.flatten(0, 1)
    return torch.cat([features.mean(dim=0), features.mean(dim=1)])


class ChatUniVi(VideoAdapter):
    name = "chat-univi"

    def __init__(self, path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_frames: int = MAX_FRAMES, ties: str = "noise", merge_eps: float = merging.MERGE_EPS,
                 seed: int = 0):
        """`ties` and `merge_eps` as `merging.Options` (defaults: Chat-UniVi's); with ties="noise" every clip
        draws its tie-breaking noise from a generator seeded with `seed`, so a clip's tokens are reproducible
        and equal to the original's run after `torch.manual_seed(seed)`."""
        loaded = load_checkpoint(path, device, dtype)
        self.model, self.tokenizer, self.config = loaded.model, loaded.tokenizer, loaded.config
        self.projector, self.tower = loaded.projector, loaded.tower
        self.max_frames = max_frames
        self.use_cluster, self.steps, self.temporal_rate = cluster_settings(self.config, self.tower.patches)
        self.ties, self.merge_eps, self.seed = ties, merge_eps, seed
        if ties not in merging.TIES:
            raise ValueError(f"ties must be one of {merging.TIES}, got {ties!r}")

    def merge_options(self) -> merging.Options:
        return merging.Options(self.ties, self.merge_eps, torch.Generator().manual_seed(self.seed))

    # --- VideoAdapter -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> torch.Tensor:
        """Merging runs on CLIP features, before the projector, as in Chat-UniVi's `project`."""
        kept = sample_frames(timestamps, len(frames), max_frames=self.max_frames)
        return self.visual_tokens(self.features(np.asarray(frames)[kept]))

    def features(self, frames: np.ndarray) -> torch.Tensor:
        """(T, P, D) CLIP features in the tower's dtype, as Chat-UniVi's `encode_images` hands them on."""
        return self.tower(frames).to(next(self.tower.model.parameters()).dtype)

    @torch.no_grad()
    def visual_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """Merged (or pooled) features → projected visual embeddings: Chat-UniVi's `project`."""
        return self.projector(self.merged(features).to(self.projector.weight.dtype))

    def merged(self, features: torch.Tensor) -> torch.Tensor:
        if not self.use_cluster:
            return unclustered(features)
        return merging.clip_tokens(features, self.steps, self.temporal_rate, options=self.merge_options())

    def system_text(self) -> str:
        return SYSTEM

    def system_ids(self) -> torch.Tensor:
        return self.bos_then(SYSTEM)

    def clip_text(self, index: int, start_s: float = 0.0) -> tuple[str, str]:
        return "USER: ", f"\nClip {index}, from {start_s:.0f} s."

    def question_text(self, question: str) -> str:
        return f"USER: {question.strip()} ASSISTANT:"

    def describe(self) -> AdapterInfo:
        cfg = self.model.config
        per_event = merging.tokens_per_event(self.steps, self.tower.patches)
        return AdapterInfo(self.name, per_event, str(self.model.dtype), str(self.device),
                           cfg.max_position_embeddings, cfg.hidden_size)
