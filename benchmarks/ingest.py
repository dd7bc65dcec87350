"""What ingest costs with the default perception (object detector included): `python -m benchmarks ingest`.

`stream-qa` plays the bundled clip in real time at 1 fps, 1 and 4 streams on one pool, each asked "what is on
screen?" every 10 s of video; each clip line on stderr says the stream's ingest speed (video seconds encoded per
second of ingest work, waits for the video left out: ≥ 1 keeps up with real time). Reported per stream: the
median of its clip lines after the first clip (the first includes loading the detector), and the answers given.
Issue 60's goals on a 2-core CPU: one stream ≥ 3× real time; 4 streams ≥ 1.0× each.
"""

import re
import statistics
import subprocess
import sys

from streaming.sources import bundled_clip

from .common import print_table, record, write

SPEED = re.compile(r"(?:\[stream (\d+) [^\]]*\] )?\[\s*[\d.]+s\] clip\s+(\d+) .*ingest ([\d.]+)x real time")


def run_streams(n: int, loops: int) -> dict[int, dict]:
    video = str(bundled_clip("bikes.mp4"))
    args = [sys.executable, "-m", "streaming.cli", *[video] * n, "--loop", str(loops), "--every", "10s",
            "--question", "what is on screen?", "--json", "--budget", "512"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    speeds: dict[int, list[float]] = {}
    for line in done.stderr.splitlines():
        m = SPEED.search(line)
        if m and int(m.group(2)) > 1:
            speeds.setdefault(int(m.group(1) or 1), []).append(float(m.group(3)))
    answers = sum(1 for line in done.stdout.splitlines() if '"answer"' in line)
    return {s: {"median": statistics.median(v), "min": min(v), "clips": len(v) + 1, "answers": answers}
            for s, v in speeds.items()}


def run(args):
    loops = 2 if args.quick else 6
    recs, preset = [], "detect+tiles@0.2+person"
    for n in (1, 4):
        for stream, got in run_streams(n, loops).items():
            x = f"{n} stream(s), stream {stream}"
            recs.append(record("ingest", preset, None, "ingest_speed", got["median"], f"{x}, median"))
            recs.append(record("ingest", preset, None, "ingest_speed", got["min"], f"{x}, least"))
            recs.append(record("ingest", preset, None, "answers", got["answers"], x))
    write(args.out, "ingest", recs, [])
    print_table(recs, ["ingest_speed", "answers"])
