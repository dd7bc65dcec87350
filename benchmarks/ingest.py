"""What ingest costs with the default perception (object detector included): `python -m benchmarks ingest`.

`stream-qa` plays footage in real time at 1 fps, N streams on one pool in one process, each asked a question every
`--every` seconds of video; each clip line on stderr says the stream's ingest speed (video seconds encoded per second
of ingest work, waits for the video left out: ≥ 1 keeps up with real time) and the frames it dropped (a live source
drops a clip the model has no room for). Two parts:

- speed (`--quick` or not): the bundled clip, 1 and 4 streams, "what is on screen?" every 10 s; per stream the median
  and least of its clip lines after the first (the first includes loading the detector), and the answers given.
- cameras per box (issue 70; not with `--quick`): how many streams this CPU holds in real time with no frame dropped,
  a question every 30 s, for busy footage (bikes.mp4 looped: it moves throughout) and a still camera (a real photo
  filmed with sensor noise, drift and JPEG, `gate.still_video`), perception on ONNX Runtime (the default) and on torch
  (`INF_MLLM_PERCEPTION_RUNTIME=torch`: the eyes before issue 70), the change gate on and off. For each, N grows in
  steps until a stream drops a frame or its last clip comes more than `LAG_S` after its video time; the largest N that
  held is the figure.

`--policies speed busy still torch` picks the parts (all by default); the language model's products follow
`INF_MLLM_LINEAR` as `stream-qa` does (the streams inherit the environment).
"""

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streaming.sources import bundled_clip

from .common import parts, print_table, record, write

SPEED = re.compile(r"(?:\[stream (\d+) [^\]]*\] )?\[\s*([\d.]+)s\] clip\s+(\d+) .*ingest ([\d.]+)x real time"
                   r"(?: \| dropped (\d+))?")
LAG_S = 8.0  # a stream whose last clip is in later than this after its video time did not keep up
BUSY_STEPS = (2, 4, 6, 8, 10, 12, 16)
STILL_STEPS = (4, 8, 16, 24, 32, 48)


def run_streams(n: int, loops: int, video: str | None = None, every: str = "10s", env: dict | None = None,
                extra: tuple = ()) -> dict[int, dict]:
    """N streams of `video` (the bundled clip) in one `stream-qa`, in real time: per stream its clip lines' ingest
    speeds (after the first), frames dropped, answers, and how late its last clip came after its video time."""
    video = video or str(bundled_clip("bikes.mp4"))
    args = [sys.executable, "-m", "streaming.cli", *[video] * n, "--loop", str(loops), "--every", every,
            "--question", "what is on screen?", "--json", "--budget", "512", *extra]
    started = time.monotonic()
    answers_file = tempfile.TemporaryFile("w+")  # not a pipe: only stderr is read while it runs
    proc = subprocess.Popen(args, stdout=answers_file, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    speeds: dict[int, list[float]] = {}
    state: dict[int, dict] = {}
    said: list[str] = []
    for line in proc.stderr:  # read as it comes: a clip line's wall time is when it was printed
        said = (said + [line.rstrip()])[-12:]
        m = SPEED.search(line)
        if m:
            stream = int(m.group(1) or 1)
            s = state.setdefault(stream, {"first": None, "dropped": 0, "lag": 0.0})
            wall, video_t = time.monotonic() - started, float(m.group(2))
            s["first"] = s["first"] if s["first"] is not None else wall - video_t  # start-up: loading, the 1st clip
            s["lag"] = max(s["lag"], wall - s["first"] - video_t)
            s["dropped"] = int(m.group(5) or 0)
            if int(m.group(3)) > 1:
                speeds.setdefault(stream, []).append(float(m.group(4)))
    if proc.wait(timeout=600) or not state:
        raise RuntimeError(f"stream-qa exited {proc.returncode} with {len(state)} streams' clip lines; it said: "
                           + " / ".join(said))
    answers_file.seek(0)
    answers = sum(1 for line in answers_file if '"answer"' in line)
    return {s: {"median": statistics.median(v), "min": min(v), "clips": len(v) + 1, "answers": answers,
                "dropped": state[s]["dropped"], "lag_s": state[s]["lag"]} for s, v in speeds.items()}


def held(got: dict[int, dict], n: int) -> bool:
    return len(got) == n and all(s["dropped"] == 0 and s["lag_s"] <= LAG_S for s in got.values())


def cameras(footage: str, video: str, loops: int, steps, runtime: str, gate: bool) -> list[dict]:
    """Records of N streams for growing N, until one does not hold; the largest N that held last."""
    recs, best = [], 0
    policy = f"{footage}, {runtime}, gate {'on' if gate else 'off'}"
    for n in steps:
        try:
            got = run_streams(n, loops, video, "30s", {"INF_MLLM_PERCEPTION_RUNTIME": runtime},
                              () if gate else ("--no-gate",))
        except RuntimeError as err:  # said, then tried once more: one run's failure is no figure
            print(f"{policy}: {n} streams: {err}; again", flush=True)
            got = run_streams(n, loops, video, "30s", {"INF_MLLM_PERCEPTION_RUNTIME": runtime},
                              () if gate else ("--no-gate",))
        x = f"{n} streams"
        recs += [record("ingest", policy, None, "dropped", max((s["dropped"] for s in got.values()), default=0), x),
                 record("ingest", policy, None, "wall_s", max((s["lag_s"] for s in got.values()), default=0.0), x),
                 record("ingest", policy, None, "ingest_speed", min(s["min"] for s in got.values()), x)]
        print(f"{policy}: {n} streams: dropped {[s['dropped'] for s in got.values()]}, "
              f"lag {max(s['lag_s'] for s in got.values()):.1f} s", flush=True)
        if not held(got, n):
            break
        best = n
    return recs + [record("ingest", policy, None, "streams", best, "held in real time")]


PARTS = ("speed", "busy", "still", "torch")  # `--policies` picks some; "torch": the cameras on torch's perception too


def run(args):
    chosen = parts(args, "ingest", PARTS)
    loops = 2 if args.quick else 6
    recs, preset = [], "detect+tiles@0.2+person"
    for n in (1, 4) if "speed" in chosen else ():
        for stream, got in run_streams(n, loops).items():
            x = f"{n} stream(s), stream {stream}"
            recs.append(record("ingest", preset, None, "ingest_speed", got["median"], f"{x}, median"))
            recs.append(record("ingest", preset, None, "ingest_speed", got["min"], f"{x}, least"))
            recs.append(record("ingest", preset, None, "answers", got["answers"], x))
    if not args.quick:
        from .gate import still_video

        with tempfile.TemporaryDirectory() as tmp:
            still = str(still_video(Path(tmp) / "still.mp4", seconds=60.0))
            for runtime in ("onnx", "torch") if "torch" in chosen else ("onnx",):
                if "busy" in chosen:
                    recs += cameras("busy (bikes.mp4)", str(bundled_clip("bikes.mp4")), 6, BUSY_STEPS, runtime, True)
                for gate in (True, False) if "still" in chosen else ():
                    recs += cameras("still camera", still, 1, STILL_STEPS, runtime, gate)
    write(args.out, "ingest", recs, [])
    print_table(recs, ["ingest_speed", "answers", "dropped", "wall_s", "streams"])
