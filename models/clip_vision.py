"""The CLIP ViT-L/14 tower as both 7B ports use it: CLIP's image preprocessing and patch features.

Chat-UniVi and Flash-VStream both run `CLIPVisionModel` and take hidden state
`mm_vision_select_layer` (-2 in their released configs) without the CLS token ("patch"). Their
frames go through the tower's `CLIPImageProcessor` (transformers 4.31): PIL bicubic resize of the
shortest edge to 224 with the long edge *truncated* (`int(224 * long / short)`: 240×320 → 224×298),
centre crop with the offsets floored, x/255 then (x - mean) / std in float32.

`Preprocess` does exactly those steps with PIL and numpy (method "pil", the default), so the pixels
equal the original's bit for bit (tests/test_originals_parity.py). Per frame on one CPU core (the
ingest thread): 5.3 ms at 240×320, 12.0 ms at 480×640, 21.5 ms at 720×1280; transformers 5's own
`CLIPImageProcessorPil` gives the same pixels in 5.3 / 12.9 / 29.0 ms, and its default
`CLIPImageProcessor` needs torchvision, which this project does not install. The older torch path
(method "torch": one batched antialiased bicubic `interpolate`) stays as an option for a GPU ingest
thread; on the CPU it is slower (6.1 / 10.8 / 76.2 ms) and its filter is not PIL's (pixels differ
by up to 0.03 after normalisation), which is why it is not the default.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Preprocess:
    """CLIPImageProcessor's settings for one tower."""

    size: int = 224  # shortest edge after resizing
    crop: int = 224
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    method: str = "pil"  # "pil": CLIPImageProcessor's own steps; "torch": batched torch resize (not bit-equal)

    @classmethod
    def from_folder(cls, folder: Path, image_size: int) -> "Preprocess":
        """preprocessor_config.json's values, or CLIP's defaults at the tower's input size."""
        file = folder / "preprocessor_config.json"
        cfg = json.loads(file.read_text()) if file.exists() else {}
        size, crop = cfg.get("size", image_size), cfg.get("crop_size", image_size)
        size = size.get("shortest_edge", size.get("height", image_size)) if isinstance(size, dict) else size
        crop = crop.get("height", image_size) if isinstance(crop, dict) else crop
        return cls(int(size), int(crop), tuple(cfg.get("image_mean", CLIP_MEAN)), tuple(cfg.get("image_std", CLIP_STD)))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """CLIPImageProcessor's output size: the short edge becomes `size`, the long edge truncated."""
        short, long = sorted((height, width))
        new_long = int(self.size * long / short)
        return (self.size, new_long) if height <= width else (new_long, self.size)

    def __call__(self, frames: np.ndarray) -> torch.Tensor:
        """(T, H, W, 3) uint8 → (T, 3, crop, crop) float32 pixel values."""
        if self.method == "torch":
            return self.torch_resize(frames)
        if self.method != "pil":
            raise ValueError(f"unknown preprocessing method {self.method!r}: 'pil' or 'torch'")
        return torch.from_numpy(np.stack([self.pil_frame(frame) for frame in frames]))

    def pil_frame(self, frame: np.ndarray) -> np.ndarray:
        """One frame as CLIPImageProcessor.preprocess makes it: (3, crop, crop) float32."""
        from PIL import Image

        h, w = self.resized(*frame.shape[:2])
        image = np.asarray(Image.fromarray(np.ascontiguousarray(frame)).resize((w, h), resample=Image.BICUBIC))
        top, left = (h - self.crop) // 2, (w - self.crop) // 2
        image = image[top:top + self.crop, left:left + self.crop]
        image = (image * (1 / 255)).astype(np.float32)
        image = (image - np.array(self.mean, dtype=np.float32)) / np.array(self.std, dtype=np.float32)
        return image.transpose(2, 0, 1)

    def torch_resize(self, frames: np.ndarray) -> torch.Tensor:
        """The batched variant: torch's antialiased bicubic at CLIPImageProcessor's sizes and crop."""
        x = torch.as_tensor(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255
        new = self.resized(*x.shape[-2:])
        x = F.interpolate(x, size=new, mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
        top, left = (new[0] - self.crop) // 2, (new[1] - self.crop) // 2
        x = x[..., top:top + self.crop, left:left + self.crop]
        mean, std = torch.tensor(self.mean).view(1, 3, 1, 1), torch.tensor(self.std).view(1, 3, 1, 1)
        return (x - mean) / std


class ClipTower:
    """A frozen `CLIPVisionModel`: uint8 frames → (T, patches, width) features of the selected layer."""

    def __init__(self, model, preprocess: Preprocess, select_layer: int = -2, select_feature: str = "patch"):
        if select_feature not in ("patch", "cls_patch"):
            raise ValueError(f"mm_vision_select_feature must be 'patch' or 'cls_patch', got {select_feature!r}")
        self.model = model.eval().requires_grad_(False)
        self.preprocess = preprocess
        self.select_layer = select_layer
        self.select_feature = select_feature

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @property
    def patches(self) -> int:
        cfg = self.model.config
        return (cfg.image_size // cfg.patch_size) ** 2 + (self.select_feature == "cls_patch")

    @torch.no_grad()
    def __call__(self, frames: np.ndarray, batch: int = 16) -> torch.Tensor:
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.shape} {frames.dtype}")
        param = next(self.model.parameters())
        out = []
        for start in range(0, len(frames), batch):
            pixels = self.preprocess(frames[start:start + batch]).to(param.device, param.dtype)
            hidden = self.model(pixel_values=pixels, output_hidden_states=True).hidden_states[self.select_layer]
            out.append((hidden[:, 1:] if self.select_feature == "patch" else hidden).float())
        return torch.cat(out)
