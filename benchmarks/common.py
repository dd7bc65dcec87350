"""The benchmark harness: one record format, the compared policies, run plans, round timing, one
`tokens_per_s`, table, JSON and plots, shared by every benchmark.

Records are {"benchmark", "policy", "budget", "metric", "value", "x"}; `x` is the streamed
position, token distance bucket, round or a label. Every policy runs through `policy_configs`, so
all benchmarks compare the same configurations, and the list of policies comes from the registry
(`inf_mllm.policies.POLICIES`) plus the named combinations below.
"""

import json
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil

METRICS = ("ppl", "accuracy", "decode_ms_per_token", "ttft_s", "evict_share", "kv_tokens", "kv_mb", "rss_mb",
           "tokens_per_s", "oom_round", "ingest_speed", "rss_slope_mb_per_round", "recall_at_k", "store_mb_per_hour",
           "link_ms", "reencode_ms", "round_ms", "of_full", "questions", "rate", "ms_per_frame")

# Non-default options of the registered policies; a policy not named here runs with its dataclass defaults.
# inf_mllm is the paper's algorithm as written.
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


def registered() -> list[str]:
    """Every registered policy, then the named combinations (scorer + allocator + reducer, as `stream-qa
    --policy` takes them), in registry order."""
    from inf_mllm.policies import COMBINATIONS, POLICIES

    return list(dict.fromkeys([*POLICIES, *COMBINATIONS]))


def policy_names(names=None, recall: bool = False) -> list[str]:
    """The policies a benchmark runs: the registry's (with `recall`, also RECALL_POLICIES), or the subset
    `names`; a name outside that list (any policy string `StreamSession` takes) is run too, after them."""
    every = registered() + (list(RECALL_POLICIES) if recall else [])
    if names is None:
        return every
    return [p for p in every if p in names] + [p for p in dict.fromkeys(names) if p not in every]


def base_name(policy: str) -> str:
    """The scorer part of a policy string: 'inf_mllm+recall' → 'inf_mllm'."""
    return policy.partition("+")[0]


def config_for(policy: str, budget: int | None = None) -> dict:
    """Options for one policy string: its own entry in POLICY_CONFIGS, else its scorer's (combinations
    and recall variants run with the scorer's options); a window never larger than a quarter of the budget."""
    cfg = dict(POLICY_CONFIGS.get(policy, POLICY_CONFIGS.get(base_name(policy), {})))
    if "window" in cfg and budget is not None:
        cfg["window"] = min(cfg["window"], budget // 4)
    return cfg


def policy_configs(names=None, budget: int | None = None, recall: bool = False) -> dict[str, dict]:
    """{policy: options} for the compared policies (see `policy_names` and `config_for`)."""
    return {p: config_for(p, budget) for p in policy_names(names, recall)}


# --- plans ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One run of a benchmark: a policy at a budget (None: the full cache) over `length` streamed units."""

    policy: str
    budget: int | None
    cfg: dict = field(default_factory=dict, hash=False, compare=False)
    length: int | None = None

    @property
    def key(self) -> tuple[str, int | None]:
        return self.policy, self.budget


def clip_to_context(length: int, context: int | None, reserve: int = 0) -> int:
    """How far the full cache can stream: `length`, or the model's `context` less `reserve` tokens
    (what a round adds after the point measured), whichever is smaller."""
    return length if context is None else min(length, context - reserve)


def plans(names, budgets, length: int | None = None, context: int | None = None, recall: bool = False,
          full: bool = True) -> list[Plan]:
    """The full cache once, first (no budget; its stream clipped at `context`), then every other policy
    at each budget in turn. `full=False`, or a `names` without "full", leaves the full cache out."""
    chosen = policy_names(names, recall)
    out = []
    if full and "full" in chosen:
        out.append(Plan("full", None, {}, None if length is None else clip_to_context(length, context)))
    for budget in budgets:
        out += [Plan(p, budget, config_for(p, budget), length) for p in chosen if p != "full"]
    return out


# --- timing -----------------------------------------------------------------------------------------


def evict_share(evict_s: float, score_s: float, round_s: float) -> float:
    """The share of a round spent keeping the cache bounded: eviction plus what scoring adds beyond plain
    attention, over the round's time."""
    return (evict_s + score_s) / round_s if round_s > 0 else float("nan")


def tokens_per_s(decoded: int, decode_s: float) -> float:
    """Decode speed of one answer, as `inf_mllm.session.TurnStats.tokens_per_s` defines it."""
    from inf_mllm.session import TurnStats

    return TurnStats(decode_s=decode_s, decoded=decoded).tokens_per_s


class RoundTimer:
    """The wall time of one round (turns and decode steps) of a session, with the score-cost probe's
    plain-SDPA runs (`cache.measure_overhead`) taken out: they are measurement, not work.

    Call `turn()` after each appended turn (it counts the turn's eviction), `lap()` for the seconds so
    far (the probe time of that lap alone is `lap_probe_s`), `share()` for the eviction share."""

    def __init__(self, session):
        self.session = session
        session.cache.pop_score_time()  # what came before the round is not its cost
        self.evict_s = self.score_s = self.probe_s = self.lap_probe_s = 0.0
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        score, self.lap_probe_s = self.session.cache.pop_score_time()
        self.score_s += score
        self.probe_s += self.lap_probe_s
        return time.perf_counter() - self.t0 - self.probe_s

    def turn(self) -> float:
        self.evict_s += self.session.last.evict_s
        return self.lap()

    def share(self, round_s: float) -> float:
        return evict_share(self.evict_s, self.score_s, round_s)


# --- records ----------------------------------------------------------------------------------------


def record(benchmark, policy, budget, metric, value, x):
    assert metric in METRICS, metric
    return {"benchmark": benchmark, "policy": policy, "budget": budget, "metric": metric,
            "value": float(value), "x": x}


def fraction_of_full(value: float, full: float, lower_is_better: bool = False) -> float:
    """A policy's quality as a fraction of the full cache's: value / full (accuracy), or full / value for
    a lower-is-better metric (perplexity), so 1.0 is the full cache and less is worse either way."""
    if lower_is_better:
        return full / value if value > 0 else float("nan")
    return value / full if full > 0 else float("nan")


def rss_mb() -> float:
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def median(values):
    return statistics.median(values) if values else float("nan")


def write(out_dir, name: str, records: list[dict], plot_metrics: list[str], log_x: bool = False,
          x_label: str = "streamed tokens") -> Path:
    """`name`.json in `out_dir` (written to a temporary file first, so an interrupted write leaves the
    previous one), and with `plot_metrics`, `name`.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)
    if plot_metrics:
        plot(out / f"{name}.png", name, records, plot_metrics, log_x, x_label)
    return path


# --- plots and tables -------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path, name, records, metrics, log_x=False, x_label="streamed tokens", vlines=None):
    """One panel per (metric, budget); the full cache is drawn in every budget's panel. Summary records
    (string x next to numeric x) are left out of the curves. `vlines` {metric: label}: that metric's
    records are drawn as labelled vertical lines (at x = value) in the first metric's panels."""
    plt = _pyplot()
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


def bar_plot(path, panels: list[tuple[str, list[dict], float | None]]):
    """Grouped bars, one panel per (title, records, reference): policies along x, one bar per budget (the
    full cache's alone); a `reference` that is not None is drawn as a dashed line (a goal)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.9 * _count_policies(panels) + 3), 3.4 * len(panels)),
                             squeeze=False)
    for ax, (title, records, reference) in zip(axes[:, 0], panels, strict=True):
        policies = list(dict.fromkeys(r["policy"] for r in records))
        budgets = sorted({r["budget"] for r in records}, key=lambda b: -1 if b is None else b)
        width = 0.8 / max(1, len(budgets))
        for k, budget in enumerate(budgets):
            at = {r["policy"]: r["value"] for r in records if r["budget"] == budget}
            xs = [i + (k - (len(budgets) - 1) / 2) * width for i, p in enumerate(policies) if p in at]
            ys = [at[p] for p in policies if p in at]
            bars = ax.bar(xs, ys, width, label="full cache" if budget is None else f"budget {budget}")
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        if reference is not None:
            ax.axhline(reference, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(policies)), policies, rotation=25, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _count_policies(panels) -> int:
    return max((len({r["policy"] for r in panel[1]}) for panel in panels), default=1)


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
