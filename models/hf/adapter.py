"""`HFVideo`: a transformers image-text-to-text checkpoint as a streaming video adapter.

A clip is `frames` frames spread over it, turned into pixel values and visual features by the model's
own vision tower, and laid out as one user message of the checkpoint's own chat template with the
video tag expanded as the family's processor expands it. Its token ids are embedded and the visual
features written over the placeholder tokens, which is what the model's forward does with pixel
values, so the language model sees the same numbers it would see on the whole conversation.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from inf_mllm.attention import ATTN_IMPLEMENTATION
from inf_mllm.loader import AssetError

from ..base import AdapterInfo, VideoAdapter, visual_of
from . import pixels
from .families import clock, family_for


class HFVideo(VideoAdapter):
    """`path`: a local checkpoint folder (config, safetensors, tokenizer, processor files). `frames`: frames
    per clip (1 fps over a 4-s clip by default). `model`: the folder's model already in memory (the
    benchmarks' randomly initialised 7B-sized one, whose weights are never written to disk)."""

    name = "hf"

    def __init__(self, path: str | Path | None = None, device: str = "cpu", frames: int = 4,
                 dtype: torch.dtype | None = None, model=None):
        if path is None:
            raise AssetError("--model hf needs a checkpoint folder or a hub id: --model hf PATH_OR_ID")
        folder = checkpoint_folder(str(path))
        if not (folder / "config.json").exists():
            raise AssetError(f"{folder} is not a transformers checkpoint folder (no config.json)")
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as err:
            why = f"cannot read {folder / 'config.json'} ({type(err).__name__}): check the model files"
            raise AssetError(why) from err
        self.family = family_for(config, folder)  # refuses what the cache cannot position
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            if model is None:
                model = AutoModelForImageTextToText.from_pretrained(
                    folder, dtype=dtype or "auto", attn_implementation=ATTN_IMPLEMENTATION)
            self.model = model.to(device).eval()
        except (OSError, ValueError, RuntimeError) as err:
            why = f"cannot load the model at {folder} ({type(err).__name__}): check the model files"
            raise AssetError(why) from err
        self.template = chat_template(folder, self.tokenizer)
        self.frames = frames
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.family.placeholder)
        self.name = f"hf:{self.family.name}"
        self.opening = self._opening()
        self.sep = self._separator()

    # --- the chat template ------------------------------------------------------------------------

    def render(self, messages: list[dict], prompt: bool = False) -> str:
        # transformers' own renderer (apply_chat_template refuses the empty conversation that gives the opening)
        rendered, _ = render_jinja_template([messages], chat_template=self.template, add_generation_prompt=prompt,
                                            **self.tokenizer.special_tokens_map)
        return rendered[0]

    def _opening(self) -> str:
        """What the template writes before the first message: the empty conversation's text, or, for a template
        that adds a default system message to any conversation (Qwen-VL's), that message."""
        alone = self._after_first(_USER)
        whole = self.render([_USER])
        return whole[: -len(alone)] if alone and whole.endswith(alone) else self.render([])

    def _after_first(self, message: dict, prompt: bool = False) -> str:
        """`message` as the template writes it after a first one: without what opens a conversation."""
        return self.render([_FIRST, message], prompt)[len(self.render([_FIRST])):]

    def _separator(self) -> str:
        """What the template writes after an answer's end token, so that each turn can start with it (the end
        token itself is the held-back last token of the answer)."""
        end = self.tokenizer.convert_ids_to_tokens(self.end_token_id())
        user = {"role": "user", "content": [{"type": "text", "text": "q"}]}
        text = self.render([user, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}])
        return text[text.rindex(end) + len(end):] if end in text else ""

    def end_token_id(self) -> int:
        eos = self.model.generation_config.eos_token_id
        if eos is None:  # a checkpoint without a generation config: the tokenizer's
            eos = self.tokenizer.eos_token_id
        return int(eos[0] if isinstance(eos, list) else eos)

    def message(self, content: list[dict], prompt: bool = False) -> str:
        """One message as a turn: the separator, then the message as the template writes it alone."""
        text = self._after_first({"role": "user", "content": content}, prompt)
        if not prompt and self.sep and text.endswith(self.sep):
            text = text[: -len(self.sep)]
        return self.sep + text

    # --- VideoAdapter -------------------------------------------------------------------------------

    def system_text(self) -> str:
        return self.opening

    def system_ids(self) -> torch.Tensor:
        return self.text_ids(self.opening or self.sep or " ")  # a template that opens with nothing: a separator

    def clip_text(self, index: int, start_s: float = 0.0) -> tuple[str, str]:
        text = self.clip_message(index, start_s, [start_s + k for k in range(self.frames)], self.frames)
        at = text.index(self.family.placeholder)
        last = text.rindex(self.family.placeholder) + len(self.family.placeholder)
        return text[:at], text[last:]

    def clip_message(self, index: int, start_s: float, times: list[float], duration: float) -> str:
        caption = f"Clip {index} at {clock(start_s, pad=False)}."
        text = self.message([{"type": "video"}, {"type": "text", "text": caption}])
        return text.replace(self.family.video_tag, self.family.expand(len(times), times, duration), 1)

    def question_text(self, question: str) -> str:
        return self.message([{"type": "text", "text": question.strip()}], prompt=True)

    @torch.inference_mode()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float]) -> torch.Tensor:
        frames = pixels.pick_frames(np.asarray(frames), self.frames)
        if len(frames) < self.frames:  # a short last clip: repeat its last frame so every clip has one shape
            frames = np.concatenate([frames, np.repeat(frames[-1:], self.frames - len(frames), axis=0)])
        values = self.family.pixels(frames).to(self.device)
        return self.family.features(self.model, values).to(self.model.get_input_embeddings().weight.dtype)

    def frame_step(self, start_s: float, end_s: float | None) -> tuple[float, float]:
        """(the clip's end, the seconds between its frames): 1 fps over a clip of `frames` s by default."""
        end = start_s + self.frames if end_s is None else max(end_s, start_s)
        return end, (end - start_s) / self.frames

    def clip_ids(self, index: int, start_s: float, end_s: float | None = None) -> torch.Tensor:
        end, step = self.frame_step(start_s, end_s)
        times = [start_s + k * step for k in range(self.frames)]
        return self.text_ids(self.clip_message(index, start_s, times, round(end - start_s)))

    def clip_turn(self, visual, index: int, start_s: float = 0.0, end_s: float | None = None):
        return self.embed_clip(self.clip_ids(index, start_s, end_s), visual)

    def embed_clip(self, ids: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
        """(1, L, hidden): the clip turn's ids embedded, the visual features over its placeholder tokens."""
        embeds = self.model.get_input_embeddings()(ids)
        visual = visual_of(visual)
        slots = ids[0] == self.placeholder_id
        if int(slots.sum()) != visual.shape[0]:
            raise ValueError(f"clip turn has {int(slots.sum())} visual slots for {visual.shape[0]} features")
        embeds[0, slots] = visual.to(embeds.dtype)
        return embeds

    def append_clip(self, session, visual, index, start_s=0.0, end_s=None) -> dict:
        meta = self.clip_meta(visual, index, start_s, end_s)
        ids = self.clip_ids(index, start_s, end_s)
        where = (ids[0] == self.placeholder_id).nonzero()[:, 0]
        session.append(inputs_embeds=self.embed_clip(ids, visual), meta=meta,
                       vision=(int(where[0]), int(where[-1]) + 1), positions=self.clip_positions(ids, start_s, end_s))
        return meta

    def clip_positions(self, ids: torch.Tensor, start_s: float, end_s: float | None = None):
        """The clip turn's own position ids where the family's are not one per token (Qwen-VL), else None: what
        `session.append(positions=)` needs beside the turn's embeddings."""
        return self.family.positions(self.model, ids, self.frame_step(start_s, end_s)[1] or 1.0)

    def turn_tokens(self) -> int:
        return self.clip_ids(1, 0.0).shape[1]

    def describe(self) -> AdapterInfo:
        text = self.model.config.get_text_config(decoder=True)
        return AdapterInfo(self.name, self.family.visual_tokens(self.frames), str(self.model.dtype), str(self.device),
                           getattr(text, "max_position_embeddings", 0), text.hidden_size)


_FIRST = {"role": "user", "content": [{"type": "text", "text": "first"}]}
_USER = {"role": "user", "content": [{"type": "text", "text": "q"}]}


def checkpoint_folder(path: str) -> Path:
    """A local folder as given; an "owner/name" that is no folder here is a hub id, downloaded (or taken from
    the hub's cache) by huggingface_hub, which needs a machine that reaches the hub."""
    folder = Path(path).expanduser()
    if folder.exists() or path.count("/") != 1 or path.startswith((".", "/", "~")):
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as err:  # no network, unknown id, gated model: all one line for the user
        raise AssetError(f"{path} is no folder here and the hub cannot give it ({type(err).__name__}): download "
                         "the checkpoint where the hub is reachable and pass its folder") from err


def chat_template(folder: Path, tokenizer) -> str:
    """The checkpoint's chat template: the processor's file, its JSON form, or the tokenizer's."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    as_json = folder / "chat_template.json"
    if as_json.exists():
        import json

        return json.loads(as_json.read_text())["chat_template"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise AssetError(f"{folder} has no chat template (chat_template.jinja, chat_template.json or the tokenizer's)")
