"""transformers' own image-text-to-text models (LLaVA-OneVision, SmolVLM2, Qwen2-VL, Qwen2.5-VL) on the
bounded cache.

No port: the library's classes are the reference. `HFVideo` loads a local checkpoint folder, turns a
clip's frames into the model's own pixel values (`pixels.py`, equal to transformers' torchvision-based
video processors without importing them) and visual features, lays the clip out as a user turn of
the model's own chat template (`families.py`), and runs the language model on `StreamingCache`.
Qwen-VL's multimodal RoPE positions are kept unit by unit (inf_mllm/positions.py); Qwen3-VL, whose vision
features also enter inside the decoder layers, is refused in one line.
"""
