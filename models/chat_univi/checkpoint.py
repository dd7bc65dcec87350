"""Loading a released Chat-UniVi checkpoint folder (e.g. Chat-UniVi/Chat-UniVi) without its code or the network.

The layout is LLaVA's (see `models.llava_checkpoint`), as ChatUniVi/model/language_model/llama.py
and arch.py save it. What Chat-UniVi adds: `model_type` "ChatUniVi"; `config`, the cluster settings
of ChatUniVi/config/model_config.py (read by `model.cluster_settings`); and one extra module, the
projector `model.mm_projector.{weight,bias}`, an `nn.Linear(mm_hidden_size, hidden_size)`
(`MetaModel.__init__`). The frozen CLIP copy under `model.vision_tower.vision_tower.*` is ignored, as
Chat-UniVi's own loader ignores it.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..clip_vision import ClipTower
from ..llava_checkpoint import LlavaSpec, load_llava

PROJECTOR = "model.mm_projector."
SPEC = LlavaSpec("Chat-UniVi", "Chat-UniVi/Chat-UniVi",
                 extras=lambda config: {PROJECTOR: nn.Linear(config["mm_hidden_size"], config["hidden_size"])})


@dataclass
class Loaded:
    model: nn.Module  # LlamaForCausalLM
    tokenizer: object
    projector: nn.Linear
    tower: ClipTower
    config: dict


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> Loaded:
    """Everything ChatUniVi needs, on `device` in `dtype` (default: float16 on CUDA, else float32)."""
    parts = load_llava(path, SPEC, device, dtype)
    return Loaded(parts.model, parts.tokenizer, parts.extras[PROJECTOR], parts.tower, parts.config)
