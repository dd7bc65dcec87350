"""The benchmark contract: one record format, one table, one plot, one JSON file per benchmark.

Records are {"benchmark", "policy", "budget", "metric", "value", "x"}; `x` is the streamed
position, token distance bucket or round. Every policy runs through `policy_configs` so all
benchmarks compare the same configurations.
"""

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

import psutil

METRICS = ("ppl", "accuracy", "decode_ms_per_token", "ttft_s", "evict_share", "kv_tokens", "kv_mb", "rss_mb",
           "tokens_per_s", "oom_round", "ingest_speed", "rss_slope_mb_per_round", "recall_at_k", "store_mb_per_hour",
           "link_ms", "reencode_ms")

# The configurations every benchmark compares; inf_mllm is the paper's algorithm as written.
POLICY_CONFIGS = {
    "full": {},
    "window": {},
    "streaming_llm": {"sinks": 4},
    "h2o": {"recent_ratio": 0.5},
    "inf_mllm": {"window": 64, "bias": 0.01},
    "inf_mllm_plus": {"window": 64, "bias": 1.0},
}


# inf_mllm with recall of evicted turns (inf_mllm/recall.py), beside its references: similarity only,
# the oracle (exactly the right turn) and k random turns. Run by the benchmarks whose questions look back.
RECALL_POLICIES = ("inf_mllm+recall", "inf_mllm+recall_keys", "inf_mllm+recall_oracle", "inf_mllm+recall_random")


def policy_configs(names=None, budget: int | None = None, recall: bool = False) -> dict[str, dict]:
    """The compared configurations (with `recall`, also the RECALL_POLICIES, configured as inf_mllm)."""
    configs = {**POLICY_CONFIGS, **({p: POLICY_CONFIGS["inf_mllm"] for p in RECALL_POLICIES} if recall else {})}
    chosen = {k: dict(v) for k, v in configs.items() if names is None or k in names}
    for cfg in chosen.values():  # a window never larger than the budget
        if "window" in cfg and budget is not None:
            cfg["window"] = min(cfg["window"], budget // 4)
    return chosen


def record(benchmark, policy, budget, metric, value, x):
    assert metric in METRICS, metric
    return {"benchmark": benchmark, "policy": policy, "budget": budget, "metric": metric,
            "value": float(value), "x": x}


def rss_mb() -> float:
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def median(values):
    return statistics.median(values) if values else float("nan")


def write(out_dir, name: str, records: list[dict], plot_metrics: list[str], log_x: bool = False,
          x_label: str = "streamed tokens") -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(records, indent=1))
    if plot_metrics:
        plot(out / f"{name}.png", name, records, plot_metrics, log_x, x_label)
    return path


def plot(path, name, records, metrics, log_x=False, x_label="streamed tokens"):
    """One panel per (metric, budget); the full cache is drawn in every budget's panel. Summary records
    (string x next to numeric x) are left out of the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = any(not isinstance(r["x"], str) for r in records)
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
                ax.plot(positions, ys, marker="o" if len(points) < 40 else None, markersize=3, label=policy)
                if not numeric:
                    ax.set_xticks(range(len(xs)), xs)
            ax.set_title(f"{name}: {metric}" + (f" (budget {budget})" if budget is not None else ""))
            ax.set_xlabel(x_label if numeric else "x")
            if log_x and numeric:
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def print_table(records, metrics, x_filter=None):
    """One row per (policy, budget, x), one column per metric."""
    rows = defaultdict(dict)
    for r in records:
        if r["metric"] in metrics and (x_filter is None or x_filter(r["x"])):
            rows[(r["policy"], r["budget"], r["x"])][r["metric"]] = r["value"]
    header = ["policy", "budget", "x", *metrics]
    print(" | ".join(f"{h:>14}" for h in header))
    for (policy, budget, x), vals in rows.items():
        cells = [policy, str(budget), str(x)] + [f"{vals[m]:.4g}" if m in vals else "-" for m in metrics]
        print(" | ".join(f"{c:>14}" for c in cells))
