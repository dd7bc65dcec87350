"""Model adapters: a video LLM seen as frames → visual embeddings → chat turns for the core's session.

Depends on `inf_mllm` only. `ADAPTERS` is the one list of models (`stream-qa --model`, the app's menu,
`python -m models list`): each name's class, a one-line description and whether it loads from a folder the user
gives. `load_adapter` is the one entry point the streaming layer uses. This module imports no torch (the command
line lists and checks models before anything heavy loads); `AdapterInfo` and `VideoAdapter` load on first use.
"""

import importlib
from typing import NamedTuple


class Adapter(NamedTuple):
    where: str  # "module:Class", imported on use (it pulls in torch models)
    about: str
    needs_path: bool = False  # a checkpoint folder the user gives (else bundled or built here)
    path_label: str = "PATH"  # what `--help` calls it
    # tokens of one clip turn and a typical question (`streaming.budgets.floor` of the loaded model, kept here so a
    # budget below it is refused before the model loads); 1 where only the checkpoint knows
    least_budget: int = 1


ADAPTERS = {
    "tiny-vlm": Adapter("models.tiny_vlm.model:TinyVLM", "EfficientNet-Lite0 + SmolLM2-135M, trained here on easy-VQA",
                        least_budget=60),
    "chat-univi": Adapter("models.chat_univi.model:ChatUniVi",
                          "Chat-UniVi-7B: CLIP ViT-L/14, DPC-KNN merging into events, Vicuna (local checkpoint)", True),
    "chat-univi-tiny": Adapter("models.chat_univi.tiny:ChatUniViTiny", "Chat-UniVi's DPC-KNN merging on tiny-vlm",
                               least_budget=35),
    "flash-vstream": Adapter("models.flash_vstream.model:FlashVStream",
                             "Flash-VStream-7B: CLIP ViT-L/14, STAR memory read out per question, Vicuna (local "
                             "checkpoint)", True),
    "flash-vstream-tiny": Adapter("models.flash_vstream.tiny:FlashVStreamTiny",
                                  "Flash-VStream's STAR memory on tiny-vlm", least_budget=217),
    "hf": Adapter("models.hf.adapter:HFVideo",
                  "a transformers checkpoint folder or hub id: LLaVA-OneVision, SmolVLM2, Qwen2(.5)-VL, Qwen3-VL, "
                  "LLaVA-NeXT-Video", True,
                  "PATH_OR_ID"),
}


def runs_here() -> list[str]:
    """The models that load with no folder given: what the app offers before any checkpoint is added."""
    return [name for name, entry in ADAPTERS.items() if not entry.needs_path]


def usage() -> str:
    """`--model`'s choices in words: "tiny-vlm | chat-univi PATH | …"."""
    return " | ".join(name + (f" {entry.path_label}" if entry.needs_path else "") for name, entry in ADAPTERS.items())


def load_adapter(name: str, path=None, device: str = "cpu"):
    if name not in ADAPTERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(ADAPTERS)}")
    module, cls = ADAPTERS[name].where.split(":")
    factory = getattr(importlib.import_module(module), cls)
    return factory(device=device) if path is None else factory(path, device=device)


def __getattr__(name: str):
    if name in ("AdapterInfo", "VideoAdapter", "EncodedClip"):
        return getattr(importlib.import_module(".base", __name__), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["ADAPTERS", "Adapter", "AdapterInfo", "EncodedClip", "VideoAdapter", "load_adapter", "runs_here", "usage"]
