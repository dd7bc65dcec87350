"""Frames → pixel values exactly as transformers' video processors make them, without torchvision.

transformers' video processors (LLaVA-OneVision's, SmolVLM's) import torchvision, and this machine's
CPU torch has no torchvision build that imports. Their work is a resize, a rescale and a normalise;
torchvision's tensor resize is torch's own antialiased interpolation, so the same calls give the same
numbers (`tests/test_hf_models.py` checks them against outputs recorded from the processors themselves).
"""

import math
import platform

import numpy as np
import torch
import torch.nn.functional as F

# PIL resample codes (what processor configs store) → torch's interpolation modes
_MODES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}


def resize(video: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """(T, 3, H, W) uint8 → (T, 3, height, width) uint8, as torchvision resizes a uint8 video on a CPU: torch's
    own antialiased uint8 kernels (bicubic, Lanczos; bilinear where the CPU has AVX2 or is ARM), else in
    float32, clamped and rounded."""
    if tuple(video.shape[-2:]) == (height, width):
        return video
    mode = _MODES.get(int(resample), "bicubic")
    if mode == "nearest":
        return F.interpolate(video, size=(height, width), mode=mode)
    native = mode != "bilinear" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
        or platform.machine() in ("aarch64", "arm64")
    image = video if native else video.float()
    out = F.interpolate(image, size=(height, width), mode=mode, align_corners=False, antialias=True)
    return out if native else out.clamp_(0, 255).round_().to(torch.uint8)


def normalise(video: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Rescale and normalise in float32 as transformers does: fused into one normalise by mean / factor and
    std / factor when it does both."""
    factor = float(cfg.get("rescale_factor", 1 / 255))
    rescale, norm = cfg.get("do_rescale", True), cfg.get("do_normalize", True)
    out = video.to(torch.float32)
    if norm:
        mean = torch.tensor(cfg["image_mean"]) * (1.0 / factor if rescale else 1.0)
        std = torch.tensor(cfg["image_std"]) * (1.0 / factor if rescale else 1.0)
        return out.sub_(mean[:, None, None]).div_(std[:, None, None])
    return out * factor if rescale else out


def as_video(frames: np.ndarray) -> torch.Tensor:
    """(T, H, W, 3) uint8 RGB frames → (T, 3, H, W) uint8."""
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()


def fixed_size(frames: np.ndarray, cfg: dict) -> torch.Tensor:
    """LLaVA-OneVision's video processor: every frame to size (height, width)."""
    size = cfg["size"]
    video = resize(as_video(frames), size["height"], size["width"], cfg.get("resample", 3))
    return normalise(video, cfg)


def shortest_edge_then_centre(frames: np.ndarray, cfg: dict) -> torch.Tensor:
    """LLaVA-NeXT-Video's video processor (CLIP's): the shortest edge to `size.shortest_edge` (the other in
    proportion, cut to whole pixels), then the centre `crop_size` (offsets rounded as torchvision's centre crop)."""
    video = as_video(frames)
    height, width = video.shape[-2:]
    short = cfg["size"]["shortest_edge"]
    if height <= width:
        size = (short, int(short * width / height))
    else:
        size = (int(short * height / width), short)
    video = resize(video, *size, cfg.get("resample", 3))
    crop_h, crop_w = cfg["crop_size"]["height"], cfg["crop_size"]["width"]
    top, left = int(round((size[0] - crop_h) / 2.0)), int(round((size[1] - crop_w) / 2.0))
    return normalise(video[..., top:top + crop_h, left:left + crop_w], cfg)


def longest_edge_then_square(frames: np.ndarray, cfg: dict) -> torch.Tensor:
    """SmolVLM's video processor: longest edge to `size.longest_edge` (even sides), then the square of
    `max_image_size.longest_edge` (what its image processor gives a frame it does not split)."""
    video = as_video(frames)
    height, width = video.shape[-2:]
    longest = min(cfg["size"]["longest_edge"], 4096)  # transformers' MAX_IMAGE_SIZE
    ratio = width / height
    if width >= height:
        width = longest
        height = int(width / ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    resample = cfg.get("resample", 1)
    video = resize(video, height, width, resample)
    side = cfg["max_image_size"]["longest_edge"]
    return normalise(resize(video, side, side, resample), cfg)


def pick_indices(total: int, count: int) -> list[int]:
    """Which of a clip's `total` frames to keep: `count` spread evenly over it (all of them when it has fewer)."""
    if total <= count:
        return list(range(total))
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def qwen_size(height: int, width: int, cfg: dict) -> tuple[int, int]:
    """Qwen-VL's frame size: each side a multiple of one merged patch (patch × merge), the aspect ratio
    nearly kept, the area brought within [shortest_edge, longest_edge] pixels (what transformers'
    `smart_resize` computes)."""
    unit = cfg["patch_size"] * cfg["merge_size"]
    least, most = cfg["size"]["shortest_edge"], cfg["size"]["longest_edge"]
    h, w = round(height / unit) * unit, round(width / unit) * unit
    if h * w > most:
        scale = math.sqrt(height * width / most)
        h = max(unit, math.floor(height / scale / unit) * unit)
        w = max(unit, math.floor(width / scale / unit) * unit)
    elif h * w < least:
        scale = math.sqrt(least / (height * width))
        h, w = math.ceil(height * scale / unit) * unit, math.ceil(width * scale / unit) * unit
    return h, w


def qwen3_size(count: int, height: int, width: int, cfg: dict) -> tuple[int, int]:
    """Qwen3-VL's frame size for a clip of `count` frames: Qwen-VL's rounding, the area bound applied to the whole
    clip (frames rounded to temporal patches × area), as transformers' Qwen3-VL `smart_resize` computes it
    (without its per-frame cap, `cap_pixels_per_frame`)."""
    unit, tps = cfg["patch_size"] * cfg["merge_size"], cfg["temporal_patch_size"]
    if cfg.get("cap_pixels_per_frame"):
        raise ValueError("Qwen3-VL's cap_pixels_per_frame is not supported here: save the processor with it off")
    least, most = cfg["size"]["shortest_edge"], cfg["size"]["longest_edge"]
    if height < unit or width < unit:
        scale = max(unit / height, unit / width)
        height, width = int(height * scale), int(width * scale)
    frames = max(round(count / tps), 1) * tps
    h, w = round(height / unit) * unit, round(width / unit) * unit
    if frames * h * w > most:
        beta = math.sqrt(count * height * width / most)
        h = max(unit, math.floor(height / beta / unit) * unit)
        w = max(unit, math.floor(width / beta / unit) * unit)
    elif frames * h * w < least:
        beta = math.sqrt(least / (count * height * width))
        h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h, w


def qwen_patches(frames: np.ndarray, cfg: dict, size: tuple[int, int]) -> torch.Tensor:
    """Qwen-VL's video processor: frames resized to `size` (bicubic), rescaled and normalised, the last frame
    repeated to fill a temporal patch, then cut into patches flattened in the order the vision tower reads
    them (each merge window's patches together): (t·h·w patches, channels·time·y·x)."""
    video = normalise(resize(as_video(frames), *size, cfg.get("resample", 3)), cfg)
    tps, ps, merge = cfg["temporal_patch_size"], cfg["patch_size"], cfg["merge_size"]
    if pad := -len(video) % tps:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    t, h, w = len(video) // tps, size[0] // ps, size[1] // ps
    channels = video.shape[1]
    grid = video.reshape(t, tps, channels, h // merge, merge, ps, w // merge, merge, ps)
    # (t, rows of windows, columns of windows, row in window, column in window) × (channel, time, y, x)
    patches = grid.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, channels * tps * ps * ps)
    return patches
