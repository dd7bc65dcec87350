"""The change gate (issue 70) on real footage: a still camera's clips merge into one span of the clip log and cost no KV
turn, a figure walking in is seen at once, moving footage never passes, and "when" answers keep their times."""

import json
import subprocess
import sys

import numpy as np

from benchmarks.gate import _frames_1fps, figure, filmed, photo, still_video, walk_in
from models.tiny_vlm.scenes import _video_path
from streaming.gate import ChangeGate, changed, shrunk

STREAM_QA = [sys.executable, "-m", "streaming.cli"]


def test_a_still_photo_filmed_with_noise_drift_and_compression_passes_and_moving_footage_does_not():
    rng, image = np.random.default_rng(1), photo("coffee")
    still = [filmed(image, i, 60, rng, noise=8.0) for i in range(60)]  # every frame its own noise and JPEG
    assert not any(np.array_equal(still[0], f) for f in still[1:])  # no frame copied
    assert not any(changed(shrunk(f), shrunk(still[0])) for f in still[1:])
    for name in ("bikes.mp4", "carphone_pristine.mp4", "bigbuckbunny.mp4"):
        frames = _frames_1fps(_video_path(name))
        assert all(changed(shrunk(b), shrunk(a)) for a, b in zip(frames, frames[1:], strict=False)), name
    person = figure(image.shape[0] // 12)  # small: a twelfth of the frame's height (33 px), half of it in view
    assert changed(shrunk(walk_in(still[1], person, person.shape[1] // 2)), shrunk(still[0]))
    assert not changed(shrunk(walk_in(still[1], person, 4)), shrunk(still[0]))  # 4 px of it: under the gate's grain
    dark = (still[1] * 0.5).astype(np.uint8)  # the lights halved: a change, though every edge stays
    assert changed(shrunk(dark), shrunk(still[0]))


def test_the_gate_compares_with_the_last_clip_perception_saw_so_a_slow_drift_is_seen_once_it_adds_up():
    image, rng = photo("rocket").astype(np.float32), np.random.default_rng(2)
    gate = ChangeGate()
    assert not gate.unchanged(image[None].astype(np.uint8))  # nothing perceived yet: the first clip is seen
    gate.perceived(image[None].astype(np.uint8))
    passed = []
    for step in range(1, 40):  # brighter by 1% a clip, with noise: each clip alike its last, not its reference
        frame = np.clip(image * (1 + 0.01 * step) + rng.normal(0, 3, image.shape), 0, 255).astype(np.uint8)
        passed.append(gate.unchanged(frame[None]))
        if not passed[-1]:
            gate.perceived(frame[None])
    assert passed[:10] == [True] * 10 and not all(passed)  # merged while small; perceived again as it adds up


def _stream_qa(video, *extra):
    out = subprocess.run([*STREAM_QA, str(video), "--fast", "--clip-seconds", "4", "--json", "--clips",
                          "--ask", "when did the person appear? @40s", "--ask", "what did you see at 0:20? @40s",
                          *extra], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "clip" in r and "answer" not in r], [r for r in rows if "answer" in r], out.stderr


def test_a_still_camera_merges_into_one_span_a_person_walking_in_does_not_and_when_answers_keep_their_times(
        tmp_path):
    video = still_video(tmp_path / "still.mp4", seconds=40, enter_at=28)  # a cat photo filmed; a figure at 28 s
    clips, answers, stderr = _stream_qa(video)
    off_clips, off_answers, _ = _stream_qa(video, "--no-gate")
    assert len(off_clips) == 10 and not any(c.get("merged") for c in off_clips)
    merged = [c for c in clips if c.get("merged")]
    assert [c["clip"] for c in clips] == list(range(1, 11))  # every clip still printed
    assert merged and merged[0] == {**merged[0], "clip": 2, "into": 1, "since": 0.0, "start": 4.0, "end": 8.0}
    entering = next(c for c in off_clips if c["start"] <= 28 < c["end"])
    assert not next(c for c in clips if c["clip"] == entering["clip"]).get("merged")  # the figure is seen at once
    assert "person" in next(c for c in clips if c["clip"] == entering["clip"])["seen"]
    assert [a["answer"] for a in answers][0] == [a["answer"] for a in off_answers][0]  # "when": the same time
    assert "clip 1 (0:00-0:28)" in answers[1]["looked_up"]  # 0:20 is in the first clip's grown span
    assert "gated 4 frames (1 clips merged) | unchanged since 0.0s (clip 1)" in stderr
    assert answers[0]["kv_tokens"] < off_answers[0]["kv_tokens"]  # fewer turns in the cache
