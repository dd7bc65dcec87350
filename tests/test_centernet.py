"""CenterNet (issue 60's COCO detector) against its own runtime: the torch interpreter's heatmap, `wh` and detections
on three real images within float rounding of tfjs 4.22's (`fixtures/detector/centernet_tfjs.json`), and what it finds
there: a person and a bicycle in a frame of bikes.mp4, a person in the astronaut photo."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import centernet as cn
from models import tfjs_graph as tfjs
from tests.fixtures.detector.centernet_inputs import images

FIXTURE = Path(__file__).parent / "fixtures" / "detector" / "centernet_tfjs.json"


@pytest.fixture(scope="module")
def net():
    if not all((cn.assets() / name).exists() for name in cn.FILES) and shutil.which("npm") is None:
        pytest.skip("CenterNet's files are not cached and npm is not installed to fetch them")
    cn.fetch_centernet()
    return cn.CenterNet()


@pytest.fixture(scope="module")
def shots():
    return images()


@pytest.fixture(scope="module")
def recorded():
    return json.loads(FIXTURE.read_text())["images"]


def test_words_are_the_vocabulary_of_tiny_vlm():
    from models.tiny_vlm.labels import OBJECTS

    assert len(cn.COCO) == 80 and cn.WORDS[0] == "person"
    assert set(cn.WORDS[1:]) <= set(OBJECTS)


def test_a_graph_attribute_the_reader_lacks_is_refused_in_one_line():
    x = torch.zeros(1, 4, 4, 3)
    with pytest.raises(cn.AssetError, match="a NCHW convolution; this reader runs NHWC ones only"):
        tfjs.conv2d({"data_format": "NCHW", "strides": [1, 1, 1, 1], "padding": "SAME"}, x, torch.zeros(1, 1, 3, 2))
    with pytest.raises(cn.AssetError, match="fused with Tanh"):
        tfjs._fused(x, {"fused_ops": ["Tanh"]}, [])
    with pytest.raises(cn.AssetError, match="StridedSlice with new, shrunk or elided axes"):
        tfjs.strided_slice({"shrink_axis_mask": 1}, x, torch.zeros(4, dtype=torch.int32), None, None)


def test_same_padding_puts_the_odd_row_after():
    assert tfjs._same(512, 3, 2) == (0, 1)  # what a symmetric torch padding gets wrong
    assert tfjs._same(128, 5, 1) == (2, 2)
    assert tfjs._same(32, 3, 2) == (0, 1)


def test_resize_matches_torch_where_their_grids_agree():
    x = torch.rand(1, 7, 9, 3)
    size = torch.tensor([12, 5])
    for corners, half in ((False, True), (True, False)):
        mine = tfjs.resize_bilinear({"align_corners": corners, "half_pixel_centers": half}, x, size)
        theirs = F.interpolate(x.permute(0, 3, 1, 2), size=(12, 5), mode="bilinear", align_corners=corners)
        assert torch.allclose(mine, theirs.permute(0, 2, 3, 1), atol=1e-6)


def test_inputs_are_the_recorded_ones(shots, recorded):
    for name, image in shots.items():
        digest = hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()
        assert digest == recorded[name]["sha256"], f"{name} is not the image recorded (another OpenCV's decoder?)"
        x = cn.preprocess(image)
        assert abs(float(x.mean()) - recorded[name]["resized_mean"]) < 1e-3
        assert np.allclose(x[0, 100, 200].numpy(), recorded[name]["resized_corner"], atol=1e-4)


def test_graph_matches_tfjs(net, shots, recorded):
    for name, image in shots.items():
        rec = recorded[name]
        out = net.raw(image, (cn.KEYPOINTS, cn.WH, cn.DETECTIONS))
        heat, wh = out[cn.KEYPOINTS], out[cn.WH]
        assert np.abs(heat.reshape(-1, 80).max(axis=0) - rec["class_max"]).max() < 1e-4, name
        for p in rec["peaks"]:
            assert abs(heat[p["y"], p["x"], p["class"]] - p["score"]) < 1e-4, (name, p)
            assert np.allclose(wh[p["y"], p["x"]], p["wh"], atol=2e-3), (name, p)  # input pixels (of 512)
        theirs = np.asarray(rec["detections"])
        for graph in (out[cn.DETECTIONS][: len(theirs)], cn.peaks(heat, wh, 0.05)):  # the graph's decoding, then ours
            assert graph.shape == theirs.shape and (graph[:, 5] == theirs[:, 5]).all(), name
            assert np.abs(graph[:, 4] - theirs[:, 4]).max() < 1e-4, name
            assert np.abs(graph[:, :4] - theirs[:, :4]).max() / 512 < 1e-4, name


def test_finds_the_cyclist_and_the_astronaut(net, shots):
    street = net.frame(shots["bikes_4.8s"])
    assert {"person", "bicycle"} <= {b.word for b in street}
    person = next(b for b in street if b.word == "person")
    assert 0.5 < (person.box[0] + person.box[2]) / 2 < 0.8  # the cyclist right of centre, not the van
    astronaut = net.frame(shots["astronaut"])
    assert astronaut[0].word == "person" and astronaut[0].score > 0.5
    assert all(0.0 <= v <= 1.0 for b in street + astronaut for v in b.box)


def test_fetch_without_npm_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setattr("models.detector.shutil.which", lambda name: None)  # where npm is looked for
    with pytest.raises(cn.AssetError, match="npm"):
        cn.fetch_centernet(tmp_path)
    with pytest.raises(cn.AssetError, match="models.centernet fetch"):
        cn.CenterNet(tmp_path)
