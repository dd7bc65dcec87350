"""Models at the sizes the paper measures, randomly initialised: speed and memory only (issue 23).

No 7B checkpoint exists on this machine, and none is needed to time one: a forward costs the same
whatever the weights hold. `vicuna-7b` is the language model of Chat-UniVi-7B (Vicuna-7B v1.5, a
Llama-2 shape with a 4K context); `llama-2-7b-32k` is the same shape with RoPE positions interpolated
8x for a 32K context (linear scaling). The device's memory bandwidth gives the floor a decode step
cannot beat: every weight read once, plus the cached K/V.
"""

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig

from inf_mllm.attention import ATTN_IMPLEMENTATION
from inf_mllm.budget import KVShape

LLAMA_2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, rms_norm_eps=1e-5)
SHAPES = {
    "vicuna-7b": LLAMA_2_7B | {"max_position_embeddings": 4096},
    "llama-2-7b-32k": LLAMA_2_7B | {"max_position_embeddings": 32768,
                                    "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}},
    # a 2-layer Llama: a GPU script's dry run on a CPU, before device time is spent on it
    "llama-tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1000, rms_norm_eps=1e-5, max_position_embeddings=4096),
}


def build(shape: str, device: str = "cpu", dtype: torch.dtype = torch.float16):
    """A randomly initialised model of `shape`, made directly on `device` in `dtype` (no fp32 copy)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], attn_implementation=ATTN_IMPLEMENTATION)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def weight_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters())


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: all of them but the input embedding table, of which it
    reads one row (unless that table is also the output head)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return weight_bytes(model) - (0 if emb is head else emb.nbytes)  # tied: one Parameter


def bandwidth(device, size: int = 2**30, repeats: int = 10) -> float:
    """Bytes per second a large device-to-device copy moves (read + written), median of `repeats`."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return 2 * size / times[len(times) // 2]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def llava_onevision_7b(folder, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """LLaVA-OneVision-Qwen2-7B's shape (Qwen2-7B, SigLIP-so400m at 384 px: 196 pooled tokens a frame) as a
    checkpoint folder without weights (config, tokenizer, chat template) and its random model on `device`.
    The tokenizer is the tiny checkpoints' (SmolLM2's): ids stay below the 152,064-row table."""
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    from models.hf import tiny

    tok = tiny.tokenizer("llava_onevision")
    text = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                                image_size=384, patch_size=14)
    config = LlavaOnevisionConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  video_token_index=tok.convert_tokens_to_ids("<video>"), vision_feature_layer=-1,
                                  vision_feature_select_strategy="full", attn_implementation=ATTN_IMPLEMENTATION)
    torch.manual_seed(0)
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    (Path(folder) / "chat_template.jinja").write_text(tiny.LLAVA_TEMPLATE)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return folder, model.eval()


def kv_bytes_per_token(model) -> int:
    """K and V of one token in every layer (the cache's own `KVShape`)."""
    shape = KVShape.from_config(model.config, model.dtype.itemsize)
    return shape.bytes_per_token_layer * shape.num_layers
