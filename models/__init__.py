"""Model adapters: a video LLM seen as frames → visual embeddings → chat turns for the core's session.

Depends on `inf_mllm` only. `ADAPTERS` maps each name to a loader `load(path=None, device="cpu")`;
`load_adapter` is the one entry point the streaming layer uses.
"""

from importlib import import_module

from .base import AdapterInfo, VideoAdapter

# name → ("module:Class", one-line description); modules are imported on use (they pull in torch models)
ADAPTERS = {
    "tiny-vlm": ("models.tiny_vlm.model:TinyVLM", "EfficientNet-Lite0 + SmolLM2-135M, trained here on easy-VQA"),
    "chat-univi": ("models.chat_univi.model:ChatUniVi",
                   "Chat-UniVi-7B: CLIP ViT-L/14, DPC-KNN merging into events, Vicuna (local checkpoint)"),
    "chat-univi-tiny": ("models.chat_univi.tiny:ChatUniViTiny", "Chat-UniVi's DPC-KNN merging on tiny-vlm"),
    "flash-vstream": ("models.flash_vstream.model:FlashVStream",
                      "Flash-VStream-7B: CLIP ViT-L/14, STAR memory read out per question, Vicuna (local checkpoint)"),
    "flash-vstream-tiny": ("models.flash_vstream.tiny:FlashVStreamTiny", "Flash-VStream's STAR memory on tiny-vlm"),
    "hf": ("models.hf.adapter:HFVideo",
           "a transformers checkpoint folder: LLaVA-OneVision, SmolVLM2, Qwen2-VL, Qwen2.5-VL"),
}


def load_adapter(name: str, path=None, device: str = "cpu") -> VideoAdapter:
    if name not in ADAPTERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(ADAPTERS)}")
    module, cls = ADAPTERS[name][0].split(":")
    factory = getattr(import_module(module), cls)
    return factory(device=device) if path is None else factory(path, device=device)


__all__ = ["ADAPTERS", "AdapterInfo", "VideoAdapter", "load_adapter"]
