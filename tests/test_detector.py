"""The object detector on real images (issue 60): its runtime's raw outputs against the recorded fixture, what it finds
in a frame of bikes.mp4 and in a photo of a cat, the clip vote, and the clip log for a model that carries no words."""

import json
from pathlib import Path

import numpy as np
import pytest

from models.detector import Box, Detector, anchors, decode, fetch, vote
from tests.fixtures.detector.images import images

FIXTURE = Path(__file__).parent / "fixtures" / "detector" / "objectron_tflite.json"


@pytest.fixture(scope="module")
def detector():
    fetch()  # cached by `make setup`; packs the npm package where it is not
    return Detector()


def test_anchors_are_ssd_mobilenet_grids():
    a = anchors()
    assert a.shape == (1917, 4)  # 19²·3 + (10² + 5² + 3² + 2² + 1²)·6
    assert np.allclose(a[0], [0.5 / 19, 0.5 / 19, 0.1, 0.1])
    assert np.allclose(a[-1, :2], [0.5, 0.5])


def test_raw_outputs_match_the_recorded_runtime(detector):
    recorded = json.loads(FIXTURE.read_text())["images"]
    for name, image in images().items():
        regress, logits = detector.raw(image)
        for top in recorded[name]["top"]:
            a = top["anchor"]
            assert detector.labels[int(np.argmax(logits[a, 1:])) + 1] == top["label"]
            assert abs(logits[a, 1:].max() - top["logit"]) < 2e-3, (name, a)
            assert np.allclose(regress[a], top["regression"], atol=2e-3)
            assert np.allclose(decode(regress)[a], top["box"], atol=1e-3)


def test_finds_the_cat_and_the_cyclist(detector):
    shots = images()
    cat = detector.frame(shots["chelsea"])
    assert [b.word for b in cat] == ["cat"] and cat[0].score > 0.8
    x0, y0, x1, y1 = cat[0].box
    assert x1 - x0 > 0.8 and y1 - y0 > 0.8  # the cat fills the photo
    street = {b.word for b in Detector(min_score=0.45).frame(shots["bikes_4.8s"])}
    assert {"person", "bicycle"} <= street


def test_clip_vote_counts_by_median_and_drops_single_frames():
    person = Box("person", 0.6, (0.1, 0.1, 0.3, 0.9))
    dog = Box("dog", 0.5, (0.5, 0.5, 0.9, 0.9))
    frames = [[person, person], [person, person, dog], [person], [person, person]]
    objects = vote(frames)
    assert objects.counts == {"person": 2}  # the dog was in one frame of four, at a score short of `SURE`
    assert vote(frames, sure=0.45).counts == {"person": 2, "dog": 1}  # once, but sure enough
    assert objects.words() == ["2 persons"]
    assert objects.meta()["boxes"][0]["word"] == "person"
    assert "counted_at" not in objects.meta()  # no frame times given
    # the frame a count can be read in: the last that shows it (a sure dog found once: that frame)
    assert vote(frames, sure=0.45).meta([4.0, 5.0, 6.0, 7.0])["counted_at"] == {"person": 7.0, "dog": 5.0}
    assert vote([[person], [person, person], [person, person, person]]).meta([0.0, 1.0, 2.0])["counted_at"] == \
        {"person": 1.0}  # the median, 2, seen at 1 s
    assert vote([[dog]]).counts == {"dog": 1}  # a one-frame clip needs one vote


def test_a_model_without_words_gets_the_detections_in_its_clip_log():
    """chat-univi-tiny's turns carry no words: `see` adds the detector's, so the clip log answers "did you see …?"
    and "how many …?" for it as for tiny-vlm."""
    from models import load_adapter
    from tests.fixtures.detector.images import bikes_frame

    adapter = load_adapter("chat-univi-tiny")
    frames = np.stack([bikes_frame(t) for t in (4.3, 4.8, 5.3, 5.8)])
    session = adapter.new_session("inf_mllm+recall", budget=256)
    encoded = adapter.see(frames, [4.0, 5.0, 6.0, 7.0])
    assert "person" in encoded.meta["objects"] and "person" in encoded.meta["seen"]
    adapter.append_clip(session, encoded, 1, 4.0, 8.0)
    reading = adapter.read_question("did you see a person?", session.store.clips(), 8.0)
    assert reading.direct == "yes, last seen in clip 1 (0:04-0:08)"
    counting = adapter.read_question("how many people are there?", session.store.clips(), 8.0)
    assert counting.direct.endswith(("person", "people"))
    at = encoded.meta["counted_at"]["person"]  # the provenance names the frame the count was read in
    assert at in (4.0, 5.0, 6.0, 7.0)
    assert counting.resolution.why.endswith(f"{counting.direct} in the frame at 0:0{at:.0f}")
    adapter.detect = False
    assert "objects" not in adapter.see(frames, [4.0, 5.0, 6.0, 7.0]).meta  # --no-detect


def test_a_session_folder_keeps_every_clips_detections(tmp_path, capsys):
    """stream-qa --session: clips.jsonl holds each clip's log entry (words, counts, boxes); --json --clips prints it."""
    from streaming.cli import main

    folder = tmp_path / "s"
    code = main(["--fast", "--session", str(folder), "--json", "--clips", "--clip-seconds", "5", "--max-new-tokens",
                 "2", "--ask", "how many bicycles are there? @10s"])
    assert code == 0
    saved = [json.loads(line) for line in (folder / "clips.jsonl").read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [c["clip"] for c in saved] == [1, 2] and all("objects" in c and "boxes" in c for c in saved)
    assert saved == [r for r in printed if "question" not in r]
    assert "bicycle" in saved[1]["objects"]
    answer = next(r for r in printed if "question" in r)
    assert answer["source"] == "clip log" and answer["answer"].endswith(("bicycle", "bicycles"))
