"""A TensorFlow.js graph model (`model.json` and its weight shards) run by torch: one small function per op type.

No TensorFlow: each op the CenterNet graph uses (`models/centernet.py`) is a few lines of torch, run in the graph's
order, NHWC as TensorFlow holds it, in fp32, with float16-quantised weights widened. A graph holding an op without a
function here is refused when it loads, and an attribute these functions do not read (another data format, a fused
activation or slice mask CenterNet does not use) when it runs (`AssetError`, one line each). Proven against tfjs
4.22 through CenterNet in `tests/test_centernet.py`.
"""

import base64
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from inf_mllm import AssetError


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
                raise AssetError(f"tfjs graph: weight {w['name']} is stored as {kind}, which this reader lacks")
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
        raise AssetError(f"tfjs graph: a {attr['data_format']} convolution; this reader runs NHWC ones only")
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
            raise AssetError(f"tfjs graph: a convolution fused with {op}, which this reader lacks")
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
        raise AssetError("tfjs graph: a StridedSlice with new, shrunk or elided axes, which this reader lacks")
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
            raise AssetError(f"tfjs graph {path.name}: ops {sorted(missing)} have no torch function here")
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
                raise ValueError(f"tfjs graph: input {name} not fed")
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
