"""Flash-VStream-7B: CLIP ViT-L/14 → STAR memory → mlp2x_gelu projector → Vicuna-7B v1.5.

The pipeline of `flash_vstream/model/vstream_arch.py`: each frame's patch features (second-to-last
CLIP layer, no CLS) update the STAR memory; at a question, the memory's read-out (abstract,
temporal, retrieved, spatial; 681 tokens once full) goes through `mm_projector` into the LLM as
`inputs_embeds`. The LLM is a plain `LlamaForCausalLM` driven by the core's bounded cache. Turns
follow their `vicuna_v1` conversation template (`flash_vstream/conversation.py`); how the read-out
maps onto turns is described in `adapter.py`.
"""

from pathlib import Path

import numpy as np
import torch

from inf_mllm.loader import cache_dir

from ..base import AdapterInfo
from .adapter import MemoryAdapter
from .checkpoint import load_flash_vstream
from .star_memory import StarMemory

SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def default_path() -> Path:
    """Where a downloaded IVGSZ/Flash-VStream-7b is looked for when no path is given."""
    return cache_dir() / "Flash-VStream-7b"


class FlashVStream(MemoryAdapter):
    name = "flash-vstream"

    def __init__(self, path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
                 vision_tower: str | Path | None = None, seed: int = 0):
        parts = load_flash_vstream(path or default_path(), device=device, dtype=dtype, vision_tower=vision_tower)
        self.config = parts.config
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.tower, self.projector, self.attention = parts.tower, parts.projector, parts.attention
        super().__init__(StarMemory(parts.star, attention=self.attention.weights, seed=seed))

    def features(self, frames: np.ndarray) -> torch.Tensor:
        return self.tower(frames)

    @torch.no_grad()
    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.projector(tokens.to(self.device, self.projector_dtype))

    @property
    def projector_dtype(self) -> torch.dtype:
        return next(self.projector.parameters()).dtype

    # --- vicuna_v1 turns ----------------------------------------------------------------------
    # Their prompt, fresh for every question, is BOS (an id) + "{SYSTEM} USER: <image>\n{question} ASSISTANT:",
    # split only at <image> (models.llava_prompt). Here the system text is a turn of its own, sent once per
    # stream (BOS as an id, as theirs), and each question one turn "USER: " + read-out + "\n{question}
    # ASSISTANT:"; each turn is tokenized on its own, so LLaMA's sentencepiece prefix space stands in for the
    # " " separator before "USER:". An answer ends with </s>, which the session carries into the next turn:
    # "...</s>USER: ...", vicuna_v1's multi-turn form (their CLI starts a new conversation instead).

    def system_text(self) -> str:
        return SYSTEM

    def system_ids(self) -> torch.Tensor:
        return self.bos_then(SYSTEM)

    def clip_text(self, index: int, start_s: float = 0.0) -> tuple[str, str]:
        return "USER: ", ""

    def question_text(self, question: str) -> str:
        return f"\n{question.strip()} ASSISTANT:"

    def describe(self) -> AdapterInfo:
        cfg = self.model.config
        return AdapterInfo(self.name, self.memory.config.max_tokens, str(self.model.dtype), str(self.device),
                           cfg.max_position_embeddings, cfg.hidden_size)
