"""How a STAR-memory model meets a streaming session: frames update the memory, questions read it.

Flash-VStream's serving loop (`serve/cli_video_stream.py`) feeds frames one by one into the memory
in a separate process and, for every question, builds a fresh prompt whose single `<image>` slot
holds the memory's current read-out (`prepare_inputs_labels_for_multimodal_streaming`). The same
mapping here: a clip only updates the memory (nothing enters the KV cache), and `ask` appends
one turn — the clip text with the read-out in place, then the question — so the read-out the LLM
sees is always the memory at question time. Unlike their loop, earlier turns (older read-outs,
questions, answers) stay in the bounded cache, where the eviction policy decides what survives.

In the engine, `encode` (ingest thread) only extracts frame features; the memory is updated in
`append_clip` on the model thread, in video order, so a question reads exactly the clips before it
(updating on the ingest thread raced with `ask` and ran up to a queue's length ahead).
"""

import copy
from abc import abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from inf_mllm import StreamSession

from ..base import EncodedClip, VideoAdapter, visual_of
from .star_memory import StarMemory


class MemoryAdapter(VideoAdapter):
    memory: StarMemory

    def __init__(self, memory: StarMemory):
        self.memory = memory
        self.clips, self.clip_start = 0, 0.0

    @abstractmethod
    def features(self, frames: np.ndarray) -> torch.Tensor:
        """(T, H, W, 3) uint8 → (T, P, D) patch features on a square grid."""

    @abstractmethod
    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, D) memory tokens → (N, hidden) LLM input embeddings."""

    def observe(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> None:
        """Feed a clip's frames into the memory one by one, in order."""
        self.remember(self.encode(frames, timestamps).visual, float(timestamps[0]) if len(timestamps) else None)

    def remember(self, features: torch.Tensor, start_s: float | None = None) -> None:
        """(T, P, D) frame features into the memory: the stateful step, model thread only."""
        self.memory.update_clip(features)
        self.clips += 1
        self.clip_start = self.clip_start if start_s is None else start_s

    def fork(self) -> "MemoryAdapter":
        """Same weights, an empty memory of its own: one per concurrent stream."""
        other = copy.copy(self)
        other.memory = StarMemory(self.memory.config, self.memory.attention, seed=self.memory.seed)
        other.clips, other.clip_start = 0, 0.0
        return other

    @torch.no_grad()
    def readout(self) -> torch.Tensor:
        """The memory's tokens, projected: (N, hidden), N = 0 before any frame."""
        tokens = self.memory.readout()
        if tokens.numel() == 0:
            hidden = self.model.get_input_embeddings().weight
            return hidden.new_zeros(0, hidden.shape[1])
        return self.project(tokens)

    # --- VideoAdapter -------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> EncodedClip:
        """Frame features only (pure); `append_clip` puts them into the memory."""
        return EncodedClip(self.features(frames))

    @torch.no_grad()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> torch.Tensor:
        """Update the memory with the clip, then return its whole read-out (not just this clip's)."""
        self.observe(frames, timestamps)
        return self.readout()

    def new_session(self, policy: str = "inf_mllm", budget=None, **policy_kwargs) -> StreamSession:
        """A new conversation is a new stream: the memory starts empty."""
        self.memory.reset()
        self.clips, self.clip_start = 0, 0.0
        return super().new_session(policy, budget, **policy_kwargs)

    def add_clip(self, session: StreamSession, frames: np.ndarray, timestamps: Sequence[float], index: int) -> None:
        self.observe(frames, timestamps)

    def question_embeds(self, question: str) -> torch.Tensor:
        """(1, L, hidden): the read-out wrapped as the latest clip's turn, followed by the question."""
        visual = self.clip_turn(self.readout(), max(self.clips, 1), self.clip_start)
        return torch.cat([visual, self.embed_text(self.question_text(question))[None]], dim=1)

    @torch.no_grad()
    def append_clip(self, session: StreamSession, clip: EncodedClip | torch.Tensor, index: int, start_s: float = 0.0,
                    end_s: float | None = None) -> dict:
        """`encode`'s features go into the memory; nothing enters the cache until a question reads it out."""
        self.remember(visual_of(clip), start_s)
        return self.clip_meta(clip, index, start_s, end_s)

    def ask(self, session: StreamSession, question: str, max_new_tokens: int = 32, **kwargs) -> Iterator[str]:
        """Append read-out + question as one turn (no eviction between them) and stream the answer."""
        kwargs.pop("oracle", None), kwargs.pop("named", None), kwargs.pop("keep", None)  # its read-out is its recall
        session.append(inputs_embeds=self.question_embeds(question), store=False)
        return self.stream_answer(session, max_new_tokens, **kwargs)
