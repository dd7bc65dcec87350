"""Loading a Flash-VStream checkpoint folder (e.g. IVGSZ/Flash-VStream-7b) offline.

The layout is LLaVA's (see `models.llava_checkpoint`), as `VStreamLlamaForCausalLM`
(`flash_vstream/model/language_model/vstream_llama.py`) saves it, with model_type "vstream", the
`compress_*` / `video_*` memory fields and two extra modules:

- `model.mm_projector.*`: the projector of `mm_projector_type` (`modules.build_projector`);
- `model.attention_model.*`: the abstract memory's attention (`modules.TuringAttention`).

Only the CLIP layout the STAR memory pools (patch tokens, no `mm_use_4_vision_tokens`) is accepted,
and the memory sizes must divide the tower's patch grid; both are checked here.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inf_mllm import AssetError

from ..clip_vision import ClipTower
from ..llava_checkpoint import LLAMA_REQUIRED, LlavaSpec, load_llava
from .modules import TuringAttention, build_projector
from .star_memory import StarConfig

PROJECTOR, ATTENTION = "model.mm_projector.", "model.attention_model."


def extras(config: dict) -> dict[str, nn.Module]:
    projector = build_projector(config.get("mm_projector_type", "linear"), config["mm_hidden_size"],
                                config["hidden_size"])
    return {PROJECTOR: projector,
            ATTENTION: TuringAttention(config["mm_hidden_size"], config.get("compress_Turing_hidden_dim", 32))}


def unsupported(config: dict) -> str | None:
    if config.get("mm_use_4_vision_tokens") or config.get("mm_vision_select_feature", "patch") != "patch":
        return ("mm_use_4_vision_tokens / mm_vision_select_feature other than 'patch' are not supported: the STAR "
                "memory pools a square patch grid; use a checkpoint configured like Flash-VStream-7B")
    return None


SPEC = LlavaSpec("Flash-VStream", "IVGSZ/Flash-VStream-7b", extras, check=unsupported,
                 required=(*LLAMA_REQUIRED, "intermediate_size", "num_attention_heads", "mm_vision_tower"))


@dataclass
class FlashVStreamParts:
    config: dict
    model: nn.Module  # LlamaForCausalLM
    tokenizer: object
    projector: nn.Module
    attention: TuringAttention
    tower: ClipTower
    star: StarConfig


def star_config(config: dict, tower: ClipTower, file: Path) -> StarConfig:
    """The memory's sizes, which must pool the tower's patch grid evenly."""
    try:
        star = StarConfig.from_config(config)
        side = round(tower.model.config.image_size / tower.model.config.patch_size)
        for size in (star.spatial_size, star.temporal_size, star.abstract_size):
            if side % size or star.spatial_size % size:
                raise ValueError(f"a {side}×{side} patch grid cannot be pooled to {size}×{size}")
    except (TypeError, ValueError) as err:
        raise AssetError(f"the memory sizes in {file} do not fit the CLIP tower ({err}): "
                         "restore compress_* / video_* fields of the original config") from err
    return star


def load_flash_vstream(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                       vision_tower: str | Path | None = None) -> FlashVStreamParts:
    """Every part of a Flash-VStream checkpoint, checked, on `device` (fp16 on CUDA as in their builder, else fp32);
    `vision_tower` overrides where the CLIP folder is looked for."""
    parts = load_llava(path, SPEC, device, dtype, vision_tower)
    star = star_config(parts.config, parts.tower, Path(path).expanduser() / "config.json")
    return FlashVStreamParts(parts.config, parts.model, parts.tokenizer, parts.extras[PROJECTOR],
                             parts.extras[ATTENTION], parts.tower, star)
