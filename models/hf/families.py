"""What differs between families: pixels, visual features, and how a clip's placeholder expands.

A family reads its settings from the checkpoint's processor files (what transformers' processors
save), so a real checkpoint and the tests' tiny ones go through the same code. 1-D RoPE language models
and the multimodal RoPE of Qwen2-VL, Qwen2.5-VL and Qwen3-VL are accepted (inf_mllm/positions.py says how a
bounded cache places the latter); Qwen3-VL's DeepStack features go in through the model's own forward.
"""

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inf_mllm.loader import AssetError
from inf_mllm.positions import TurnPositions

from . import pixels

# model_type → why it is refused; one line, shown as is
UNSUPPORTED = {
    "qwen3_vl_moe": ("qwen3_vl_moe (Qwen3-VL's mixture of experts) has not been tried on the bounded cache; not "
                     "supported (the dense Qwen3-VL is)"),
} | {
    kind: (f"{kind} places vision tokens with its own multimodal RoPE variant, which the bounded cache has not "
           "been proven to re-assign; not supported (Qwen2-VL and Qwen2.5-VL are)")
    for kind in ("qwen2_5_omni", "glm4v")
}
_NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
            "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """0..99 in words, as num2words writes them (SmolVLM's video intro counts frames this way)."""
    if n < 20:
        return _NUMBERS[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens - 2] + (f"-{_NUMBERS[ones]}" if ones else "")


def video_settings(folder: Path) -> dict:
    """A checkpoint's video processor settings, wherever transformers saved them: `processor_config.json`'s
    `video_processor`, else `video_preprocessor_config.json`, else the image processor's file."""
    combined = folder / "processor_config.json"
    if combined.exists():
        data = json.loads(combined.read_text())
        if "video_processor" in data:
            return data["video_processor"] | {k: v for k, v in data.items() if not isinstance(v, dict)}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).exists():
            return json.loads((folder / name).read_text())
    return {}


def clock(seconds: float, pad: bool = True) -> str:
    """Minutes and seconds: "01:32" (SmolVLM's frame times), or "1:32" with pad=False."""
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes:02d}:{s:02d}" if pad else f"{minutes}:{s:02d}"


@dataclass
class Family(ABC):
    name: str
    placeholder: str  # the token whose positions the visual features fill
    video_tag: str  # what the chat template writes for a video
    video_template: str | None = None  # the template the processor renders a conversation with a video by, if its own

    @abstractmethod
    def pixels(self, frames) -> torch.Tensor:
        """(T, H, W, 3) uint8 frames → the pixel values the model's vision path takes."""

    @abstractmethod
    def features(self, model, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, hidden) visual features, one per placeholder token of the clip."""

    def expect_frames(self, height: int, width: int, count: int) -> None:
        """Frames of this size will come, `count` to a clip (a family whose token count depends on it fixes it)."""
        return None

    def encode(self, model, pixel_values: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """(features, what the model adds inside its first decoder layers at the same tokens, or None)."""
        return self.features(model, pixel_values), None

    def forward_inputs(self, visual: torch.Tensor, inject: list[torch.Tensor] | None) -> dict | None:
        """What a clip turn's forward takes besides its embeddings, for a family whose features enter inside the
        decoder (None: the embeddings carry everything, the features written over the placeholders)."""
        return None

    @abstractmethod
    def visual_tokens(self, count: int) -> int:
        """Placeholder tokens of a clip of `count` frames."""

    @abstractmethod
    def expand(self, count: int, times: list[float], duration: float) -> str:
        """The text that replaces the template's video tag for `count` frames at `times` (stream seconds) of a
        clip `duration` seconds long."""

    def positions(self, model, ids: torch.Tensor, frame_step: float) -> TurnPositions | None:
        """A clip turn's own position ids, where the model's positions are not one per token (None: they are);
        `frame_step` is the seconds between its frames."""
        return None


class Llava(Family):
    """LLaVA's video path: the vision tower's chosen layer per frame, pooled and projected by the model's own
    `get_video_features`, one block of `<video>` tokens for the clip."""

    kind = ""
    defaults: dict = {}  # the video processor's settings where the checkpoint's files say nothing

    def __init__(self, config, folder: Path):
        super().__init__(self.kind, "<video>", "<video>")
        self.config = config
        self.settings = dict(self.defaults) | video_settings(folder)

    def features(self, model, pixel_values):
        cfg = self.config
        out = model.model.get_video_features(pixel_values, vision_feature_layer=cfg.vision_feature_layer,
                                             vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return out.pooler_output[0]

    def expand(self, count, times, duration):
        return self.placeholder * self.visual_tokens(count)


_CLIP_NORM = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
              "rescale_factor": 1 / 255, "resample": 3}


class LlavaOneVision(Llava):
    """SigLIP features of each frame, projected, 2×2 bilinear pooling, one newline embedding per video."""

    kind = "llava_onevision"
    defaults = {"size": {"height": 384, "width": 384}} | _CLIP_NORM

    def pixels(self, frames) -> torch.Tensor:
        return pixels.fixed_size(frames, self.settings)[None]

    def visual_tokens(self, count):
        side = math.ceil(self.config.vision_config.image_size // self.config.vision_config.patch_size / 2)
        return count * side * side + 1  # the pooled patches of every frame, then one newline embedding


class LlavaNextVideo(Llava):
    """CLIP features of each frame (CLS dropped with the "default" strategy), 2×2 average pooling, projected."""

    kind = "llava_next_video"
    defaults = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}} | _CLIP_NORM

    def pixels(self, frames):
        return pixels.shortest_edge_then_centre(frames, self.settings)[None]

    def visual_tokens(self, count):
        vision = self.config.vision_config
        return count * (vision.image_size // vision.patch_size) ** 2 // self.config.spatial_pool_stride ** 2


class SmolVLM(Family):
    """Each frame one image of `image_seq_len` tokens (pixel shuffle), introduced by its time, as SmolVLM2's
    processor lays out a video."""

    def __init__(self, config, folder: Path):
        from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

        # whatever the checkpoint's template, SmolVLM's processor renders any conversation with a video by this one
        super().__init__("smolvlm", "<image>", "<video>", DEFAULT_CHAT_TEMPLATE)
        self.config = config
        self.settings = {"size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364}, "resample": 1,
                         "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
        self.settings |= video_settings(folder)
        sampling = self.settings.get("video_sampling") or {}
        if "video_size" in sampling:
            self.settings["size"] = sampling["video_size"]

    def pixels(self, frames):
        return pixels.longest_edge_then_square(frames, self.settings)[None]

    def features(self, model, pixel_values):
        return model.model.get_image_features(pixel_values.to(model.dtype)).pooler_output[0]

    def per_frame(self) -> int:
        vision = self.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // self.config.scale_factor ** 2

    def visual_tokens(self, count):
        return count * self.per_frame()

    def expand(self, count, times, duration):
        hours, rest = divmod(int(round(duration, 6)), 3600)  # whole seconds, cut as the processor cuts them
        text = (f"You are provided the following series of {number_words(count) if count < 100 else count} frames "
                f"from a {hours}:{rest // 60:02d}:{rest % 60:02d} [H:MM:SS] video.\n")
        image = "<fake_token_around_image><global-img>" + self.placeholder * self.per_frame() \
            + "<fake_token_around_image>"
        for t in times:
            text += f"\nFrame from {clock(t)}:{image}"
        return text + "\n\n"


class QwenVL(Family):
    """Qwen2-VL and Qwen2.5-VL: frames in pairs (a temporal patch), cut into patches the vision tower merges
    2×2, one block of video tokens between vision start and end markers; multimodal RoPE positions from
    the model's own `get_rope_index`. Every frame is resized as the first clip's were, so every clip turn has
    one grid: the size a source announces (`expect_frames`), else the first clip's (640×360 assumed until then)."""

    def __init__(self, config, folder: Path):
        super().__init__(config.model_type, "<|video_pad|>", "<|video_pad|>")
        self.config = config
        vision = config.vision_config
        self.settings = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}, "resample": 3,
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 1 / 255,
                         "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                         "merge_size": vision.spatial_merge_size}
        self.settings |= video_settings(folder)
        self.size: tuple[int, int] | None = None  # every frame's (height, width), fixed by the first clip

    def frame_size(self, height: int = 360, width: int = 640, count: int = 4) -> tuple[int, int]:
        return self.size or pixels.qwen_size(height, width, self.settings)

    def expect_frames(self, height, width, count):
        if self.size is None:  # what the first clip's frames will be resized to
            self.size = self.frame_size(height, width, count)

    def grid(self, count: int) -> tuple[int, int, int]:
        """(t, h, w) patches of a clip of `count` frames."""
        ps, tps = self.settings["patch_size"], self.settings["temporal_patch_size"]
        height, width = self.frame_size(count=count)
        return -(-count // tps), height // ps, width // ps

    def pixels(self, frames):
        if self.size is None:
            self.size = self.frame_size(*np.asarray(frames).shape[1:3], count=len(frames))
        return pixels.qwen_patches(np.asarray(frames), self.settings, self.size)

    def _grid_of(self, patches: int, device=None) -> torch.Tensor:
        """video_grid_thw (1, 3) of a clip of `patches` patches at this stream's frame size."""
        _, h, w = self.grid(1)
        return torch.tensor([[patches // (h * w), h, w]], device=device)

    def features(self, model, pixel_values):
        grid = self._grid_of(len(pixel_values), pixel_values.device)
        return model.model.get_video_features(pixel_values, video_grid_thw=grid).pooler_output[0]

    def visual_tokens(self, count):
        t, h, w = self.grid(count)
        return t * h * w // self.settings["merge_size"] ** 2

    def expand(self, count, times, duration):
        return self.placeholder * self.visual_tokens(count)

    def positions(self, model, ids, frame_step):
        video = ids == self.config.video_token_id
        grid = self._grid_of(int(video.sum()) * self.settings["merge_size"] ** 2)
        extra = {}
        if self.config.model_type == "qwen2_5_vl":  # time ids advance with the seconds a temporal patch spans
            extra["second_per_grid_ts"] = torch.tensor([frame_step * self.settings["temporal_patch_size"]])
        found, _ = model.model.get_rope_index(ids.cpu(), mm_token_type_ids=(2 * video).int().cpu(),
                                              video_grid_thw=grid, **extra)
        found = found[:, 0]
        if bool(video[0, -1]):
            raise ValueError("a clip turn must end with text: its extent is where its last token sits")
        base = found[0].clone()
        where = video[0].cpu().nonzero()[:, 0]
        # each vision block (a run of video tokens: the clip's for Qwen2-VL, each temporal patch's for Qwen3-VL) is
        # one unit, its height axis starting at its base
        for block in torch.tensor_split(where, (torch.diff(where) > 1).nonzero()[:, 0] + 1) if len(where) else []:
            base[block] = int(found[1, block].min())
        return TurnPositions(found, base, int(found[0, -1]) + 1)


class Qwen3VL(QwenVL):
    """Qwen3-VL: Qwen2-VL's patches (16 px), the pixels of the whole clip bounded together, each temporal patch its
    own vision block after its time in words ("<2.5 seconds>", the mean of its two frames' times) inside the
    template's video block; interleaved multimodal RoPE (a shift still rotates every frequency alike); and
    DeepStack: features of early vision layers added to the hidden states of the first decoder layers at the
    video tokens, given to the model's own forward as its precomputed encoder outputs."""

    def frame_size(self, height: int = 360, width: int = 640, count: int = 4) -> tuple[int, int]:
        return self.size or pixels.qwen3_size(count, height, width, self.settings)

    def encode(self, model, pixel_values):
        grid = self._grid_of(len(pixel_values), pixel_values.device)
        out = model.model.get_video_features(pixel_values, video_grid_thw=grid)
        return out.pooler_output[0], [layer[0] for layer in out.deepstack_features]

    def features(self, model, pixel_values):
        return self.encode(model, pixel_values)[0]

    def forward_inputs(self, visual, inject):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        if inject is None:
            raise ValueError("a Qwen3-VL clip needs its DeepStack features: encode it with this adapter")
        video = BaseModelOutputWithDeepstackFeatures(pooler_output=(visual,), deepstack_features=[(f,) for f in inject])
        return {"mm_encoder_outputs": {"video": video}}

    def expand(self, count, times, duration):
        tps = self.settings["temporal_patch_size"]
        times = list(times) + [times[-1]] * (-len(times) % tps)  # the last frame repeated, as its pixels are
        per_block = self.visual_tokens(tps)
        return "".join(f"<{(times[i] + times[i + tps - 1]) / 2:.1f} seconds><|vision_start|>"
                       + self.placeholder * per_block + "<|vision_end|>" for i in range(0, len(times), tps))


FAMILIES = {"llava_onevision": LlavaOneVision, "smolvlm": SmolVLM, "qwen2_vl": QwenVL, "qwen2_5_vl": QwenVL,
            "qwen3_vl": Qwen3VL, "llava_next_video": LlavaNextVideo}


def family_for(config, folder: Path) -> Family:
    kind = config.model_type
    if kind in UNSUPPORTED:
        raise AssetError(UNSUPPORTED[kind])
    if kind not in FAMILIES:
        raise AssetError(f"model type {kind!r} is not a supported video LLM family ({', '.join(FAMILIES)})")
    return FAMILIES[kind](config, folder)
