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
    GenerationConfig,
    LlamaConfig,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

from inf_mllm.loader import resolve

SIDE = 32  # frame side in pixels: 4×4 patches of 8
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SPECIAL = {"llava_onevision": ["<image>", "<video>"],
           "smolvlm": ["<image>", "<video>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]}
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
}
FAMILY_NAMES = tuple(SPECIAL)


def tokenizer(family: str):
    tok = AutoTokenizer.from_pretrained(resolve("smollm2"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[family]})
    return tok


def text_config(cls, vocab: int, **extra):
    """8 layers: recall scores in layers 5 and 7 by default."""
    return cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=8192, **extra).to_dict()


def build(family: str, seed: int = 0):
    """(model, tokenizer) of a tiny random `family` checkpoint."""
    tok = tokenizer(family)
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
                  patch_size=8)
    if family == "llava_onevision":
        config = LlavaOnevisionConfig(
            text_config=text_config(Qwen2Config, len(tok)), vision_config=SiglipVisionConfig(**vision).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            video_token_index=tok.convert_tokens_to_ids("<video>"),
            vision_feature_layer=-1, vision_feature_select_strategy="full")
        model = LlavaOnevisionForConditionalGeneration(config)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
    elif family == "smolvlm":
        config = SmolVLMConfig(text_config=text_config(LlamaConfig, len(tok)),
                               vision_config=SmolVLMVisionConfig(**vision).to_dict(),
                               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
        model = SmolVLMForConditionalGeneration(config)
        eos = tok.convert_tokens_to_ids("<end_of_utterance>")
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_NAMES)}")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    return model.eval(), tok


def save(family: str, folder: str | Path, seed: int = 0) -> Path:
    """A checkpoint folder as transformers saves one: weights, tokenizer, processor settings, chat template."""
    folder = Path(folder)
    model, tok = build(family, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(PROCESSORS[family], indent=2))
    (folder / "chat_template.jinja").write_text(LLAVA_TEMPLATE if family == "llava_onevision" else SMOLVLM_TEMPLATE)
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: python -m models.hf.tiny {{{','.join(FAMILY_NAMES)}}} DIR")
    print(save(sys.argv[1], sys.argv[2]))
