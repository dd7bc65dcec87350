"""Tiny random checkpoints of each supported family, saved as a real checkpoint folder (no download).

They carry SmolLM2's tokenizer with the family's special tokens, the processor settings and chat
template transformers' own processors save (recorded in `tests/fixtures/hf/`), and random weights:
enough to prove that streaming equals the model's own forward, never to answer anything.
`python -m models.hf.tiny FAMILY DIR` writes one.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaNextVideoConfig,
    LlavaNextVideoForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLTextConfig,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

from inf_mllm.loader import resolve

SIDE = 32  # frame side in pixels: 4×4 patches of 8
# the released checkpoints' own chat templates (llava-hf's LLaVA-OneVision, SmolVLM2's, Qwen2-VL-Instruct's), so that
# the tiny checkpoints meet what a real one brings; SmolVLM's processor renders a conversation with a video by a
# template of its own instead (models/hf/families.py)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3-VL-Instruct's template for system, user and assistant messages (its tool-call and reasoning branches left
# out): no default system message, a video as a vision block the processor expands frame by frame
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# a Vicuna-style template with a video branch, the form of llava-hf's LLaVA-NeXT-Video templates: roles in capitals,
# no end token written after an answer
LLAVA_NEXT_VIDEO_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL = {"llava_onevision": ["<image>", "<video>"],
           "smolvlm": ["<image>", "<video>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
           "qwen2_vl": QWEN_SPECIAL, "qwen2_5_vl": QWEN_SPECIAL, "qwen3_vl": QWEN_SPECIAL,
           "llava_next_video": ["<image>", "<video>"]}
TEMPLATES = {"llava_onevision": LLAVA_TEMPLATE, "smolvlm": SMOLVLM_TEMPLATE, "qwen2_vl": QWEN_TEMPLATE,
             "qwen2_5_vl": QWEN_TEMPLATE, "qwen3_vl": QWEN3_TEMPLATE, "llava_next_video": LLAVA_NEXT_VIDEO_TEMPLATE}
_VIDEO = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
          "rescale_factor": 1 / 255}
PROCESSORS = {
    "llava_onevision": {"video_processor": _VIDEO | {"size": {"height": SIDE, "width": SIDE}, "resample": 3,
                                                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                                     "image_std": [0.26862954, 0.26130258, 0.27577711]},
                        "num_image_tokens": (SIDE // 8) ** 2, "vision_feature_select_strategy": "full"},
    "smolvlm": {"video_processor": _VIDEO | {"size": {"longest_edge": 2 * SIDE},
                                             "max_image_size": {"longest_edge": SIDE}, "resample": 1,
                                             "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
                "image_seq_len": (SIDE // 8) ** 2 // 4},
    # 8-px patches merged 2 × 2, at most 1,536 pixels a frame: bikes.mp4's 160 × 90 frames become 48 × 16 (1 × 3
    # merged patches), so a 4-frame clip is 2 temporal patches × 3 = 6 video tokens
    **{kind: {"video_processor": _VIDEO | {"size": {"shortest_edge": 1024, "longest_edge": 1536}, "resample": 3,
                                           "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                           "image_std": [0.26862954, 0.26130258, 0.27577711],
                                           "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2}}
       for kind in ("qwen2_vl", "qwen2_5_vl")},
    # Qwen3-VL bounds the pixels of the whole clip (frames × area): 4 frames of bikes.mp4 become 16 × 48 each, 1 × 3
    # merged patches per temporal patch (each temporal patch a vision block of 3 tokens after its time)
    "qwen3_vl": {"video_processor": _VIDEO | {"size": {"shortest_edge": 1024, "longest_edge": 4 * 1536}, "resample": 3,
                                              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 8,
                                              "temporal_patch_size": 2, "merge_size": 2,
                                              "cap_pixels_per_frame": False}},
    # CLIP's 32-px frames (shortest edge, then the centre), 4 × 4 patches pooled 2 × 2: 4 tokens a frame
    "llava_next_video": {"video_processor": _VIDEO | {"size": {"shortest_edge": SIDE}, "crop_size": {"height": SIDE,
                                                                                           "width": SIDE},
                                                      "do_center_crop": True, "resample": 3,
                                                      "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                                      "image_std": [0.26862954, 0.26130258, 0.27577711]},
                         "patch_size": 8, "vision_feature_select_strategy": "default"},
}
FAMILY_NAMES = tuple(SPECIAL)


def tokenizer(family: str):
    tok = AutoTokenizer.from_pretrained(resolve("smollm2"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[family]})
    return tok


def text_config(cls, vocab: int, layers: int = 8, **extra):
    return cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, **extra).to_dict()


def build(family: str, seed: int = 0, layers: int = 8):
    """(model, tokenizer) of a tiny random `family` checkpoint, its language model `layers` deep."""
    tok = tokenizer(family)
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
                  patch_size=8)
    if family == "llava_onevision":
        config = LlavaOnevisionConfig(
            text_config=text_config(Qwen2Config, len(tok), layers),
            vision_config=SiglipVisionConfig(**vision).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            video_token_index=tok.convert_tokens_to_ids("<video>"),
            vision_feature_layer=-1, vision_feature_select_strategy="full")
        model = LlavaOnevisionForConditionalGeneration(config)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
    elif family == "smolvlm":
        config = SmolVLMConfig(text_config=text_config(LlamaConfig, len(tok), layers),
                               vision_config=SmolVLMVisionConfig(**vision).to_dict(),
                               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
        model = SmolVLMForConditionalGeneration(config)
        eos = tok.convert_tokens_to_ids("<end_of_utterance>")
    elif family == "llava_next_video":
        config = LlavaNextVideoConfig(
            text_config=text_config(LlamaConfig, len(tok), layers), vision_config=CLIPVisionConfig(**vision).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            video_token_index=tok.convert_tokens_to_ids("<video>"),
            vision_feature_layer=-1, vision_feature_select_strategy="default", spatial_pool_stride=2)
        model = LlavaNextVideoForConditionalGeneration(config)
        eos = tok.eos_token_id
    elif family.startswith("qwen"):
        model, eos = _qwen(family, tok, layers)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_NAMES)}")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    return model.eval(), tok


def _qwen(family: str, tok, layers: int):
    """(model, eos) of a tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL (multimodal RoPE)."""
    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in names.items()}
    if family in ("qwen2_vl", "qwen2_5_vl"):
        # head_dim 16: 8 rotary frequencies split 2 / 3 / 3 over the time, height and width axes
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text = text_config(Qwen2Config, len(tok), layers, rope_parameters=rope)
        shared = dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
        if family == "qwen2_vl":
            vision = dict(embed_dim=32, hidden_size=64, mlp_ratio=2, **shared)
            config, cls = Qwen2VLConfig(text_config=text, vision_config=vision, **ids), Qwen2VLForConditionalGeneration
        else:
            vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, tokens_per_second=2,
                          window_size=16, fullatt_block_indexes=[1], **shared)
            config, cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids), \
                Qwen2_5_VLForConditionalGeneration
        model = cls(config)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
    elif family == "qwen3_vl":
        # interleaved multimodal RoPE over 8 rotary frequencies; DeepStack: the vision tower's layers 0 and 1 feed
        # features into the language model's first two layers
        text = text_config(Qwen3VLTextConfig, len(tok), layers, head_dim=16,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                            "mrope_interleaved": True})
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision, **ids))
        eos = tok.convert_tokens_to_ids("<|im_end|>")
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_NAMES)}")
    return model, eos


def save(family: str, folder: str | Path, seed: int = 0, layers: int = 8) -> Path:
    """A checkpoint folder as transformers saves one: weights, tokenizer, processor settings, chat template."""
    folder = Path(folder)
    model, tok = build(family, seed, layers)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(PROCESSORS[family], indent=2))
    (folder / "chat_template.jinja").write_text(TEMPLATES[family])
    return folder


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(f"usage: python -m models.hf.tiny {{{','.join(FAMILY_NAMES)}}} DIR [LAYERS]")
    print(save(sys.argv[1], sys.argv[2], layers=int(sys.argv[3]) if len(sys.argv) == 4 else 8))
