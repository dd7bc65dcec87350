"""`HFVideo`: a transformers image-text-to-text checkpoint as a streaming video adapter.

A clip is `frames` frames spread over it, turned into pixel values and visual features by the model's
own vision tower, and laid out as one user message of the checkpoint's own chat template with the
video tag expanded as the family's processor expands it. Its token ids are embedded and the visual
features written over the placeholder tokens, which is what the model's forward does with pixel
values, so the language model sees the same numbers it would see on the whole conversation.
"""

import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from inf_mllm.attention import ATTN_IMPLEMENTATION
from inf_mllm.loader import AssetError

from ..base import AdapterInfo, EncodedClip, VideoAdapter, visual_of
from . import pixels
from .families import clock, family_for


class HFVideo(VideoAdapter):
    """`path`: a local checkpoint folder (config, safetensors, tokenizer, processor files). `frames`: frames
    per clip (1 fps over a 4-s clip by default). `model`: the folder's model already in memory (the
    benchmarks' randomly initialised 7B-sized one, whose weights are never written to disk)."""

    name = "hf"

    def __init__(self, path: str | Path | None = None, device: str = "cpu", frames: int = 4,
                 dtype: torch.dtype | None = None, model=None, caption: bool = False):
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
        # the template the family's processor renders a conversation with a video by (SmolVLM's own), else the
        # checkpoint's
        self.template = self.family.video_template or chat_template(folder, self.tokenizer)
        self.frames = frames
        self.caption = caption  # "Clip N at M:SS." in each clip turn: ours, not the processor's; off by default
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.family.placeholder)
        self.name = f"hf:{self.family.name}"
        self.opening = self._opening()
        self.sep = self._separator()
        self._asked = self.render([_FIRST, _USER], prompt=True)  # a question's prompt, for given answers
        self._carry = weakref.WeakKeyDictionary()  # session → the spaces its last turn left for the next

    # --- the chat template ------------------------------------------------------------------------
    # A turn is one message as the template writes it after others (what it writes before a first message is the
    # opening). An answer ends with its end token, held back by the session; what the template writes after that
    # token (Qwen's and SmolVLM's "\n") opens the turn that follows an answer.

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
        """What the template writes after an answer's end token (the end token itself is the held-back last token
        of the answer)."""
        end = self.tokenizer.convert_ids_to_tokens(self.end_token_id())
        user = {"role": "user", "content": [{"type": "text", "text": "q"}]}
        text = self.render([user, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}])
        return text[text.rindex(end) + len(end):] if end in text else ""

    def end_token_id(self) -> int:
        eos = self.model.generation_config.eos_token_id
        if eos is None:  # a checkpoint without a generation config: the tokenizer's
            eos = self.tokenizer.eos_token_id
        return int(eos[0] if isinstance(eos, list) else eos)

    def lead(self, session) -> str:
        """What the next turn of `session` starts with: the separator after an answer, and the spaces the last
        turn ended with (a tokenizer joins a space to the word after it, so a turn leaves its trailing spaces to
        the next, as one text of the whole conversation would have them: Vicuna-style templates end messages so)."""
        if session is None:
            return ""
        return (self.sep if session.after_answer else "") + self._carry.get(session, "")

    def turn(self, session, text: str) -> str:
        """`text` as the next turn of `session`: after its lead, without the trailing spaces it leaves the next."""
        whole = self.lead(session) + text
        body = whole.rstrip(" ") or whole
        if session is not None:
            self._carry[session] = whole[len(body):]
        return body

    def message(self, content: list[dict], prompt: bool = False, role: str = "user") -> str:
        """One message as the template writes it after others; `prompt`: then the generation prompt."""
        return self._after_first({"role": role, "content": content}, prompt)

    def append_message(self, session, role: str, text: str) -> torch.Tensor:
        """Append a given message, as the template writes it (no generation prompt): a transcript's question or
        answer replayed, a teacher-forced answer. Returns the ids appended."""
        ids = self.text_ids(self.turn(session, self.message([{"type": "text", "text": text}], role=role)))
        session.append(ids, store=False)
        return ids

    def answer_text(self, text: str) -> str:
        """`text` as the answer after a question's generation prompt, as the template writes that answer (with its
        end token and what follows). Where the template writes a past answer otherwise than after its generation
        prompt (LLaVA-OneVision's "assistant \\n"), the answer as a generated one would stand."""
        asked = self._asked
        whole = self.render([_FIRST, _USER, {"role": "assistant", "content": [{"type": "text", "text": text}]}])
        end = self.tokenizer.convert_ids_to_tokens(self.end_token_id())
        return whole[len(asked):] if whole.startswith(asked) else f"{text}{end}{self.sep}"

    def continue_answer(self, session, text: str) -> torch.Tensor:
        """Append `text` as the answer to the question just asked (a teacher-forced answer; see `answer_text`).
        Returns the ids appended."""
        ids = self.text_ids(self.turn(session, self.answer_text(text)))
        session.append(ids, store=False)
        return ids

    # --- VideoAdapter -------------------------------------------------------------------------------

    def system_text(self) -> str:
        return self.opening

    def system_ids(self) -> torch.Tensor:
        """The opening's ids (may be none: the template writes nothing before a first message), after the BOS a
        tokenizer that adds one puts in front of the processor's whole conversation (Llama's)."""
        ids = self.text_ids(self.opening)
        bos = self.tokenizer.bos_token_id
        adds = self.tokenizer("", add_special_tokens=True).input_ids
        if bos is not None and adds[:1] == [bos] and ids[0, :1].tolist() != [bos]:
            ids = torch.cat([ids.new_tensor([[bos]]), ids], dim=1)
        return ids

    def clip_text(self, index: int, start_s: float = 0.0) -> tuple[str, str]:
        text = self.clip_message(index, start_s, [start_s + k for k in range(self.frames)], self.frames)
        at = text.index(self.family.placeholder)
        last = text.rindex(self.family.placeholder) + len(self.family.placeholder)
        return text[:at], text[last:]

    def clip_message(self, index: int, start_s: float, times: list[float], duration: float) -> str:
        """The clip's user message, its video tag expanded for frames at `times` over `duration` seconds."""
        content = [{"type": "video"}]
        if self.caption:
            content.append({"type": "text", "text": f"Clip {index} at {clock(start_s, pad=False)}."})
        text = self.message(content)
        return text.replace(self.family.video_tag, self.family.expand(len(times), times, duration), 1)

    def question_text(self, question: str) -> str:
        return self.message([{"type": "text", "text": question.strip()}], prompt=True)

    def question_turn(self, question: str, session=None) -> torch.Tensor:
        """The question's ids; with `session`, as its next turn (see `turn`)."""
        return self.text_ids(self.turn(session, self.question_text(question)))

    def question_tokens(self, question: str) -> int:
        return len(self.text_ids(self.sep + self.question_text(question))[0])  # the longest: after an answer

    @torch.inference_mode()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float]) -> torch.Tensor:
        return self.encode(frames, timestamps).visual

    @torch.inference_mode()
    def encode(self, frames: np.ndarray, timestamps: Sequence[float]) -> EncodedClip:
        frames = np.asarray(frames)
        at = pixels.pick_indices(len(frames), self.frames)
        if len(at) < self.frames:  # a short last clip: repeat its last frame so every clip has one shape
            at = at + [at[-1]] * (self.frames - len(at))
        values = self.family.pixels(frames[at]).to(self.device)
        visual, inject = self.family.encode(self.model, values)
        times = [float(timestamps[i]) for i in at] if len(timestamps) == len(frames) else None
        return EncodedClip(visual.to(self.model.get_input_embeddings().weight.dtype), times=times, inject=inject)

    def frame_times(self, start_s: float, end_s: float | None, times: list[float] | None = None):
        """(frame times, the clip's length in seconds): the frames' own times, else `frames` spread evenly over
        the clip (1 fps over `frames` seconds when its end is not known)."""
        end = start_s + self.frames if end_s is None else max(end_s, start_s)
        if times is None:
            step = (end - start_s) / self.frames
            times = [start_s + k * step for k in range(self.frames)]
        return times, end - start_s

    def clip_ids(self, index: int, start_s: float, end_s: float | None = None, times=None, session=None) \
            -> torch.Tensor:
        """The clip turn's ids; with `session`, as its next turn (see `turn`)."""
        times, duration = self.frame_times(start_s, end_s, times)
        return self.text_ids(self.turn(session, self.clip_message(index, start_s, times, duration)))

    def clip_turn(self, visual, index: int, start_s: float = 0.0, end_s: float | None = None):
        return self.embed_clip(self.clip_ids(index, start_s, end_s, getattr(visual, "times", None)), visual)

    def embed_clip(self, ids: torch.Tensor, visual, scatter: bool = True) -> torch.Tensor:
        """(1, L, hidden): the clip turn's ids embedded, the visual features over its placeholder tokens (as the
        first decoder layer sees them; scatter=False: left for the model's forward to write)."""
        embeds = self.model.get_input_embeddings()(ids)
        features = visual_of(visual)
        slots = ids[0] == self.placeholder_id
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(f"clip turn has {int(slots.sum())} visual slots for {features.shape[0]} features")
        if scatter:
            embeds[0, slots] = features.to(embeds.dtype)
        return embeds

    def append_clip(self, session, visual, index, start_s=0.0, end_s=None) -> dict:
        meta = self.clip_meta(visual, index, start_s, end_s)
        ids = self.clip_ids(index, start_s, end_s, getattr(visual, "times", None), session)
        where = (ids[0] == self.placeholder_id).nonzero()[:, 0]
        extra = self.family.forward_inputs(visual_of(visual), getattr(visual, "inject", None))
        session.append(inputs_embeds=self.embed_clip(ids, visual, scatter=extra is None), meta=meta,
                       vision=(int(where[0]), int(where[-1]) + 1), positions=self.clip_positions(ids, start_s, end_s),
                       forward_inputs=extra)
        return meta

    def clip_positions(self, ids: torch.Tensor, start_s: float, end_s: float | None = None):
        """The clip turn's own position ids where the family's are not one per token (Qwen-VL), else None: what
        `session.append(positions=)` needs beside the turn's embeddings. Qwen2.5-VL's time ids follow the clip's
        frame rate, frames over seconds, as its processor's `second_per_grid_ts` does."""
        _, duration = self.frame_times(start_s, end_s)
        return self.family.positions(self.model, ids, duration / self.frames or 1.0)

    def expect_frames(self, height: int, width: int) -> None:
        self.family.expect_frames(height, width, self.frames)

    def turn_tokens(self) -> int:
        times, duration = self.frame_times(0.0, None)
        return self.text_ids(self.sep + self.clip_message(1, 0.0, times, duration)).shape[1]  # after an answer

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
