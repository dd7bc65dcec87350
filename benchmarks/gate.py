"""The change gate on real footage: `python -m benchmarks gate [--quick]`.

Two parts. What the gate measures (`streaming/gate.py`'s largest cell difference and its fitted gain), per kind of
frame pair: consecutive 1-fps frames of the natural hour's real clips (bikes, carphone, Big Buck Bunny: things move,
nothing may pass), real photos shown as a still camera would film them (every frame encoded on its own, with sensor
noise, a slow lighting drift and JPEG compression: all must pass), and a figure (a crop of scikit-image's astronaut)
sliding in over a still photo (must not pass once a few pixels are in). Then the stream: tiny-vlm on a still camera's
video (`still_video`, a photo filmed for M minutes, then the figure walking in) with the gate on and off, in one run:
ingest CPU per hour of video, KV turns per hour, frames gated, clips merged, and the answers to "what is on screen?"
and "when did the person appear?"; and bikes.mp4, where no frame may pass (its answers and KV equal with and without).
Writes `gate.json` and `gate_answers.json` (every answer and the clip log of each run). `--quick`: a 2-minute still
camera instead of 10.
"""

import json
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
from skimage import data

from models import load_adapter
from models.tiny_vlm.scenes import _video_path
from streaming.engine import TurnEngine
from streaming.gate import CELL_LEVELS, GAIN, difference, shrunk
from streaming.questions import Question, Schedule
from streaming.sources import FileSource

from .common import machine, print_table, record, write

MOVING = ("bikes.mp4", "carphone_pristine.mp4", "bigbuckbunny.mp4")
STILLS = ("chelsea", "coffee", "rocket", "astronaut", "camera")
NOISES = (2.0, 5.0, 8.0)  # the sensor noise's σ, in levels of 255
DRIFT = 0.08  # the lighting's gain swings ±8% over a still stretch
QUALITY = 60  # JPEG quality of each frame


def photo(name: str) -> np.ndarray:
    image = getattr(data, name)()
    return np.stack([image] * 3, axis=-1) if image.ndim == 2 else image[..., :3]


def figure(height: int) -> np.ndarray:
    """The astronaut's head and shoulders, `height` pixels square."""
    return cv2.resize(data.astronaut()[30:330, 100:400], (height, height), interpolation=cv2.INTER_AREA)


def filmed(image: np.ndarray, i: int, n: int, rng, noise: float, drift: float = DRIFT) -> np.ndarray:
    """Frame i of n of a still camera on `image`: the lighting's gain drifting, sensor noise, JPEG compression."""
    gain = 1 + drift * np.sin(2 * np.pi * i / max(n, 1))
    raw = np.clip(image.astype(np.float32) * gain + rng.normal(0, noise, image.shape), 0, 255).astype(np.uint8)
    _, jpeg = cv2.imencode(".jpg", cv2.cvtColor(raw, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, QUALITY])
    return cv2.cvtColor(cv2.imdecode(jpeg, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def walk_in(frame: np.ndarray, person: np.ndarray, inside: int) -> np.ndarray:
    """`frame` with `person` slid in from the left edge, `inside` of its columns in view, half-way down."""
    out, (h, side) = frame.copy(), (frame.shape[0], person.shape[0])
    top, inside = h // 2 - side // 4, min(inside, side, frame.shape[1])
    out[top:top + side, :inside] = person[: h - top, side - inside:][:, :inside]
    return out


def still_video(path: Path, name: str = "chelsea", seconds: float = 60.0, fps: float = 1.0, noise: float = 5.0,
                enter_at: float | None = None, seed: int = 0) -> Path:
    """A still camera's video of a real photo (`filmed`: no frame copied), with the figure walking in from `enter_at`
    (a fifth of its width a frame, then standing in view) when given; mp4 at `fps`."""
    image, rng = photo(name), np.random.default_rng(seed)
    person = figure(image.shape[0] // 2)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, image.shape[1::-1])
    n = int(round(seconds * fps))
    for i in range(n):
        frame = filmed(image, i, n, rng, noise)
        if enter_at is not None and i / fps >= enter_at:
            frame = walk_in(frame, person, int((i / fps - enter_at + 1) * person.shape[1] / 5))
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def _frames_1fps(path: Path) -> list[np.ndarray]:
    cap, out, i = cv2.VideoCapture(str(path)), [], 0
    step = max(1, round(cap.get(cv2.CAP_PROP_FPS)))
    while True:
        ok, frame = cap.read()
        if not ok:
            return out
        if i % step == 0:
            out.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        i += 1


def measures() -> list[dict]:
    """The gate's measure per kind of frame pair (policy: the kind, x: the footage): the largest cell difference's
    range, the fitted gains' range, and how many pairs pass as unchanged."""
    recs, rng = [], np.random.default_rng(0)

    def add(kind, name, pairs):
        got = [difference(shrunk(a), shrunk(b)) for a, b in pairs]
        cells, gains = [c for _, c in got], [g for g, _ in got]
        values = {"pairs": len(pairs), "passed": sum(c < CELL_LEVELS and GAIN[0] <= g <= GAIN[1] for g, c in got),
                  "cell_min": min(cells), "cell_max": max(cells), "gain_min": min(gains), "gain_max": max(gains)}
        recs.extend(record("gate", kind, None, metric, value, name) for metric, value in values.items())

    for name in MOVING:  # must not pass
        frames = _frames_1fps(_video_path(name))
        add("moving, 1 fps", name, list(zip(frames[1:], frames[:-1], strict=True)))
    for name in STILLS:  # must all pass
        image = photo(name)
        for noise in NOISES:
            frames = [filmed(image, i, 120, rng, noise) for i in range(120)]
            add(f"still, noise {noise:g}", name, [(f, frames[0]) for f in frames[1:]])
    image = photo("chelsea")
    for part in (2, 4, 12):  # must not pass: the figure a half, a quarter, a twelfth of the frame's height
        person, base = figure(image.shape[0] // part), filmed(image, 0, 1, rng, 5.0, 0.0)
        step = max(1, person.shape[1] // 4)
        pairs = [(walk_in(filmed(image, 1, 1, rng, 5.0, 0.0), person, k), base)
                 for k in range(step, person.shape[1] + 1, step)]
        add(f"figure 1/{part} walks in", "chelsea", pairs)
    return recs


def stream_run(video: Path, gate: bool, questions: list[Question]) -> tuple[TurnEngine, list, float]:
    """tiny-vlm over `video` at its own speed (not paced), the gate on or off: the engine, its answers, the CPU
    seconds the run took."""
    vlm = load_adapter("tiny-vlm")
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=512), clip_seconds=4.0, gate=gate)
    started = time.process_time()
    answers = list(engine.run(FileSource(video), Schedule(list(questions))))
    return engine, answers, time.process_time() - started


def run(args) -> None:
    recs = measures()
    print_table(recs, ("pairs", "passed", "cell_min", "cell_max", "gain_min", "gain_max"))
    minutes = 2.0 if args.quick else 10.0
    still_s = minutes * 60
    said = []
    with tempfile.TemporaryDirectory() as tmp:
        still = still_video(Path(tmp) / "still.mp4", seconds=still_s, enter_at=still_s - 20)
        for footage, video, end in (("still camera", still, still_s), ("bikes.mp4", _video_path("bikes.mp4"), 10.0)):
            questions = [Question("when did the person appear?", end), Question("what is on screen?", end)]
            for gate in (True, False):
                engine, answers, cpu_s = stream_run(video, gate, questions)
                t, hour = engine.telemetry, 3600 / engine.telemetry.video_s
                values = {"video_s": t.video_s, "cpu_s_per_hour": cpu_s * hour, "ingest_s_per_hour": t.ingest_s * hour,
                          "kv_turns_per_hour": t.clips * hour, "gated_frames": t.gated, "merged_clips": t.merged,
                          "kv_tokens": engine.session.kv_tokens}
                name = "gate on" if gate else "gate off"
                recs.extend(record("gate", name, 512, metric, value, footage) for metric, value in values.items())
                said.append({"footage": footage, "gate": gate, "answers": [a.as_dict() for a in answers],
                             "clip_log": [{k: m[k] for k in ("clip", "start", "end", "seen") if k in m}
                                          for m in engine.clip_log()]})
                print(f"{footage}, {name}: " + "; ".join(f"{a.question} -> {a.answer}" for a in answers))
    print_table(recs, ("video_s", "cpu_s_per_hour", "ingest_s_per_hour", "kv_turns_per_hour", "gated_frames",
                       "merged_clips", "kv_tokens"), lambda x: x in ("still camera", "bikes.mp4"))
    write(args.out, "gate", recs, [])
    (Path(args.out) / "gate_answers.json").write_text(json.dumps({"machine": machine(), "runs": said}, indent=1))
