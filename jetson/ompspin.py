"""`python -m jetson ompspin`: time to first token while the ingest thread runs and after it ends,
with libgomp's default waiting, with purely passive waiting, and with what `streaming` sets (passive
after a short spin), beside `--busy` processes that keep cores busy.

The fault: torch's OpenMP workers spin after each parallel region, throttled only while the teams
hold more threads than there are cores. During a stream the ingest thread has its own team, so the
spinning is throttled; once it ends, the model thread's workers spin at full length, and on a
machine whose cores are busy with other work each answer waits for spinning workers to be scheduled.
Purely passive waiting fixes that but puts the workers to sleep between the matrix products of a
prefill; a short spin keeps them awake across those gaps. Each variant runs `stream-qa` as a user
would (its own process), on the bundled clip looped three times with a question every 2 s of video;
the last answers come after ingest has ended.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from streaming import OPENMP_WAITING
from streaming.questions import SAMPLE_QUESTION
from streaming.records import print_table, pyplot, record, write
from streaming.sources import bundled_clip

# the environment each variant adds; an empty value is invalid to libgomp, which then keeps its default
VARIANTS = {
    "libgomp default": {"OMP_WAIT_POLICY": ""},
    "passive, no spin": {"OMP_WAIT_POLICY": "PASSIVE"},  # what `streaming` set until stop 45
    "short spin, then passive (stream-qa)": {},  # unset: `streaming` sets both before torch loads
}
BUSY = "while True: pass"


def one_run(variant: dict, clip: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITING} | variant
    argv = [sys.executable, "-m", "streaming.cli", clip, "--fast", "--json", "--loop", "3", "--clip-seconds", "2",
            "--every", "2s", "--question", SAMPLE_QUESTION, "--max-new-tokens", "4"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return [json.loads(line)["ttft_s"] for line in out.stdout.splitlines()]


def run(args) -> int:
    clip = str(bundled_clip())
    records = []
    for busy in args.busy:
        during, after = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
        hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
        try:
            for rep in range(args.reps):
                for name, variant in VARIANTS.items():  # interleaved, so load on the machine hits all alike
                    ttft = one_run(variant, clip)
                    during[name] += ttft[: len(ttft) // 2]
                    after[name] += ttft[-5:]  # answered after the last clip was encoded
                    half = statistics.median(ttft[: len(ttft) // 2])
                    print(f"{busy} busy, run {rep + 1}, {name}: during ingest median {half:.2f} s, after "
                          f"{statistics.median(ttft[-5:]):.2f} s", flush=True)
        finally:
            for proc in hogs:
                proc.kill()
        for name in VARIANTS:
            for phase, ttft in (("during ingest", during[name]), ("after ingest", after[name])):
                records.append(record("ompspin", name, 512, "ttft_s", statistics.median(ttft), f"{phase}, {busy} busy"))
    print_table(records, ["ttft_s"])
    path = write(Path(args.out), "ompspin", records, [])
    plot(records, path.with_suffix(".png"))
    print(f"ompspin: {path} (median time to first token, {args.reps} runs per variant and load)", file=sys.stderr)
    return 0


def plot(records: list[dict], path: Path) -> None:
    """Grouped bars: one group per phase and load, one bar per OpenMP waiting."""
    plt = pyplot()
    groups = list(dict.fromkeys(r["x"] for r in records))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(VARIANTS)
    for i, name in enumerate(VARIANTS):
        values = {r["x"]: r["value"] for r in records if r["policy"] == name}
        xs = [g + (i - (len(VARIANTS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, 0.0) for g in groups], width, label=name)
    ax.set_xticks(range(len(groups)), [g.replace(", ", "\n") for g in groups])
    ax.set_ylabel("time to first token, median (s)")
    ax.set_title("OpenMP waiting: stream-qa on the bundled clip, 2 cores")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
