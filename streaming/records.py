"""The one record format of every measurement the project writes: benchmark records, their JSON file,
the plot beside it and the printed table.

It lives in `streaming`, not in `benchmarks`, because product commands write these records too
(`python -m jetson soak` and `ompspin`) and no product package may import `benchmarks`; the
benchmark harness (`benchmarks/common.py`) re-exports it. Records are {"benchmark", "policy",
"budget", "metric", "value", "x"}; `x` is the streamed position, token distance bucket, round or a
label. A file holds {"machine": where it ran, "records": [...]} (`machine()`: device, CPU and its flags, GPU,
versions, commit, date), so a figure always says where it came from; `read` also takes the plain lists written
before that header. matplotlib loads only when a plot is drawn.
"""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "neon", "asimd")  # what changes CPU speed

METRICS = ("ppl", "accuracy", "decode_ms_per_token", "ttft_s", "evict_share", "kv_tokens", "kv_mb", "rss_mb",
           "tokens_per_s", "oom_round", "ingest_speed", "rss_slope_mb_per_round", "recall_at_k", "store_mb_per_hour",
           "link_ms", "reencode_ms", "round_ms", "of_full", "questions", "rate", "ms_per_frame", "prefill_ms", "ratio",
           "encode_ms", "kv_kb_per_clip", "clip_ttft_s", "floor_ms_per_token", "decode_vs_floor", "gpu_mb",
           "first_answer_s", "decode_vs_streaming_llm", "ttft_p95_s", "bound_mb", "read_gb_s", "clips", "dropped",
           "answers", "video_s", "wall_s", "answer_s", "answer_p95_s", "overhead_ms", "questions_per_s", "requests",
           "refused", "errors", "max_logit_diff", "same_greedy", "kl", "alerts", "events", "precision", "recall",
           "latency_clips", "false_per_hour", "false_per_quiet_hour", "repeats_per_hour", "alert_wall_s", "judge_us",
           "turn_s", "perception_s", "clips_same_kv", "max_kv_tokens", "answers_same", "cell_min", "cell_max",
           "gain_min", "gain_max", "passed", "pairs", "cpu_s_per_hour", "ingest_s_per_hour", "kv_turns_per_hour",
           "gated_frames", "merged_clips", "max_feature_diff", "streams")


def record(benchmark, policy, budget, metric, value, x):
    assert metric in METRICS, metric
    return {"benchmark": benchmark, "policy": policy, "budget": budget, "metric": metric,
            "value": float(value), "x": x}


def machine(tree: str | Path | None = None) -> dict:
    """Where a measurement runs: device (cuda when torch is loaded and sees a GPU, else cpu), the CPU's model,
    cores and the flags that change its speed, the GPU's name, Python, torch and transformers versions, the
    commit of the checkout `tree` (default: this one; "+dirty" with uncommitted changes) and the date."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu in ("", platform.machine(), platform.processor()):
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    gpu = None
    torch = sys.modules.get("torch")  # never loaded for this: a command without torch says cpu
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    return {"device": "cuda" if gpu else "cpu", "cpu": cpu, "cores": os.cpu_count(),
            "cpu_flags": sorted(flags & set(FLAGS)), "gpu": gpu, "python": platform.python_version(),
            "torch": _version("torch"), "transformers": _version("transformers"), "commit": commit(tree),
            "date": datetime.date.today().isoformat()}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def commit(tree: str | Path | None = None) -> str | None:
    """The checkout's commit (short), with "+dirty" when tracked files differ from it; None outside git."""
    where = str(tree or Path(__file__).resolve().parent.parent)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def read(path) -> list[dict]:
    """The records of a results file (with its machine header, or a plain list from before it)."""
    data = json.loads(Path(path).read_text())
    return data["records"] if isinstance(data, dict) else data


def write(out_dir, name: str, records: list[dict], plot_metrics: list[str], log_x: bool = False,
          x_label: str = "streamed tokens") -> Path:
    """`name`.json in `out_dir`, headed by where it ran (`machine()`; written to a temporary file first, so an
    interrupted write leaves the previous one), and with `plot_metrics`, `name`.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
    tmp.replace(path)
    if plot_metrics:
        plot(out / f"{name}.png", name, records, plot_metrics, log_x, x_label)
    return path


# --- plots and tables -------------------------------------------------------------------------------


def pyplot():
    """matplotlib with the headless backend, chosen before pyplot loads (so here, not at the top: a
    command that writes no plot never pays for matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path, name, records, metrics, log_x=False, x_label="streamed tokens", vlines=None):
    """One panel per (metric, budget); the full cache is drawn in every budget's panel. Summary records
    (string x next to numeric x) are left out of the curves. `vlines` {metric: label}: that metric's
    records are drawn as labelled vertical lines (at x = value) in the first metric's panels."""
    plt = pyplot()
    numeric = any(not isinstance(r["x"], str) for r in records if r["metric"] in metrics)
    marks = [r for r in records if vlines and r["metric"] in vlines]
    records = [r for r in records if r["metric"] in metrics and (not numeric or not isinstance(r["x"], str))]
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None}) or [None]
    fig, axes = plt.subplots(len(metrics), len(budgets), figsize=(5.5 * len(budgets), 3.6 * len(metrics)),
                             squeeze=False)
    for i, metric in enumerate(metrics):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            series = defaultdict(list)
            for r in records:
                if r["metric"] == metric and (r["budget"] == budget or r["budget"] is None):
                    series[r["policy"]].append((r["x"], r["value"]))
            for policy, points in series.items():
                xs, ys = [p[0] for p in points], [p[1] for p in points]
                positions = xs if numeric else range(len(xs))
                ax.plot(positions, ys, marker="o" if len(points) < 40 else None, markersize=3, linewidth=1,
                        label=policy)
                if not numeric:
                    ax.set_xticks(range(len(xs)), xs)
            if i == 0:
                for r in marks:
                    if r["budget"] in (budget, None):
                        ax.axvline(r["value"], color="k", linestyle="--", linewidth=1)
                        ax.annotate(f"{r['policy']}: {vlines[r['metric']]}", (r["value"], ax.get_ylim()[1] * 0.9),
                                    fontsize=8)
            ax.set_title(f"{name}: {metric}" + (f" (budget {budget})" if budget is not None else ""))
            ax.set_xlabel(x_label if numeric else "x")
            if log_x and numeric:
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fmt(value, spec=".4g") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(records, metrics, x_filter=None):
    """One row per (policy, budget, x), one column per metric."""
    rows = defaultdict(dict)
    for r in records:
        if r["metric"] in metrics and (x_filter is None or x_filter(r["x"])):
            rows[(r["policy"], r["budget"], r["x"])][r["metric"]] = r["value"]
    header = ["policy", "budget", "x", *metrics]
    print(" | ".join(f"{h:>14}" for h in header))
    for (policy, budget, x), vals in rows.items():
        cells = [policy, str(budget), str(x)] + [fmt(vals.get(m)) for m in metrics]
        print(" | ".join(f"{c:>14}" for c in cells))
