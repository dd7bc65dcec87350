"""`python -m jetson ompspin`: time to first token while the ingest thread runs and after it ends,
with libgomp's default waiting and with the passive waiting `streaming` now sets.

The fault: torch's OpenMP workers spin after each parallel region, throttled only while the teams
hold more threads than there are cores. During a stream the ingest thread has its own team, so the
spinning is throttled; once it ends, the model thread's workers spin at full length, and on a
machine whose cores are busy with other work each answer waits for spinning workers to be scheduled.
Each variant runs `stream-qa` as a user would (its own process), on the bundled clip looped three
times with a question every 2 s of video; the last answers come after ingest has ended.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from streaming.questions import SAMPLE_QUESTION
from streaming.records import print_table, record, write
from streaming.sources import bundled_clip

VARIANTS = {
    "libgomp default": "",  # an empty value is invalid to libgomp, which then keeps its default
    "passive (stream-qa)": None,  # unset: `streaming` sets OMP_WAIT_POLICY=PASSIVE before torch loads
}


def one_run(env_value: str | None, clip: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    argv = [sys.executable, "-m", "streaming.cli", clip, "--fast", "--json", "--loop", "3", "--clip-seconds", "2",
            "--every", "2s", "--question", SAMPLE_QUESTION, "--max-new-tokens", "4"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return [json.loads(line)["ttft_s"] for line in out.stdout.splitlines()]


def run(args) -> int:
    clip = str(bundled_clip())
    during, after = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for name, value in VARIANTS.items():  # interleaved, so load on the machine hits both alike
            ttft = one_run(value, clip)
            during[name] += ttft[: len(ttft) // 2]
            after[name] += ttft[-5:]  # answered after the last clip was encoded
            print(f"run {rep + 1} {name}: during ingest median {statistics.median(ttft[: len(ttft) // 2]):.2f} s, "
                  f"after {statistics.median(ttft[-5:]):.2f} s", flush=True)
    records = []
    for name in VARIANTS:
        records.append(record("ompspin", name, 512, "ttft_s", statistics.median(during[name]), "during ingest"))
        records.append(record("ompspin", name, 512, "ttft_s", statistics.median(after[name]), "after ingest"))
    print_table(records, ["ttft_s"])
    path = write(Path(args.out), "ompspin", records, ["ttft_s"], x_label="phase")
    print(f"ompspin: {path} (median time to first token, {args.reps} runs per variant)", file=sys.stderr)
    return 0
