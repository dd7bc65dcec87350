"""tiny-vlm: a small real vision-language model built here (EfficientNet-Lite0 → projector → SmolLM2-135M)."""
