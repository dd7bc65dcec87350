"""The benchmark harness: one record format, the compared policies, run plans, round timing, one
`tokens_per_s`, table, JSON and plots, shared by every benchmark.

The record format ({"benchmark", "policy", "budget", "metric", "value", "x"}), its JSON file, plot
and table are `streaming/records.py`, which product commands write too; they are re-exported here,
so a benchmark imports its whole harness from one module. Every policy runs through `policy_configs`, so
all benchmarks compare the same configurations, and the list of policies comes from the registry
(`inf_mllm.policies.POLICIES`) plus the named combinations below.
"""

import os
import statistics
import time
from dataclasses import dataclass, field

import psutil

from inf_mllm.spec import COMBINATIONS, SCORERS, PolicySpec
from streaming.records import (  # noqa: F401 (re-exported)
    METRICS,
    fmt,
    machine,
    plot,
    print_table,
    pyplot,
    read,
    record,
    write,
)

# Options that differ from a policy's dataclass defaults, by policy string or by scorer. None do today:
# every policy runs as its class defines it (inf_mllm is the paper's algorithm as written), so a new
# registered policy is compared as it is without an entry here.
POLICY_CONFIGS: dict[str, dict] = {}

# inf_mllm with recall of evicted turns (inf_mllm/recall.py), beside its references: similarity only,
# the oracle (exactly the right turn) and k random turns. Run by the benchmarks whose questions look back.
RECALL_POLICIES = ("inf_mllm+recall", "inf_mllm+recall_keys", "inf_mllm+recall_oracle", "inf_mllm+recall_random")


def registered() -> list[str]:
    """Every registered policy, then the named combinations (scorer + allocator + reducer, as `stream-qa
    --policy` takes them), in registry order."""
    return list(dict.fromkeys([*SCORERS, *COMBINATIONS]))


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
    and recall variants run with the scorer's options), else none. Any policy with a retrieval window
    gets one no larger than a quarter of the budget: the window's queries are always kept, and a
    window near the budget would leave nothing to choose."""
    from inf_mllm.policies import window_cap  # torch: `benchmarks.report` reads this module without it

    cfg = dict(POLICY_CONFIGS.get(policy, POLICY_CONFIGS.get(base_name(policy), {})))
    try:
        return cfg | window_cap(PolicySpec.parse(policy, **cfg), budget)
    except ValueError:  # not a cache policy of the core (a model's label, `full_capped`): no window
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
    from inf_mllm.session import TurnStats  # torch: `benchmarks.report` reads this module without it

    return TurnStats(decode_s=decode_s, decoded=decoded).tokens_per_s


class RoundTimer:
    """The wall time of one round (turns and decode steps) of a session, with the score-cost probe's
    plain-SDPA runs (`cache.timing.measure`) taken out: they are measurement, not work.

    Call `turn()` after each appended turn (it counts the turn's eviction), `lap()` for the seconds so
    far (the probe time of that lap alone is `lap_probe_s`), `share()` for the eviction share. `clock`
    is there for tests, which step it rather than time a busy machine."""

    def __init__(self, session, clock=time.perf_counter):
        self.session, self.clock = session, clock
        session.cache.timing.pop()  # what came before the round is not its cost
        self.evict_s = self.score_s = self.probe_s = self.lap_probe_s = 0.0
        self.t0 = clock()

    def lap(self) -> float:
        score, self.lap_probe_s = self.session.cache.timing.pop()
        self.score_s += score
        self.probe_s += self.lap_probe_s
        return self.clock() - self.t0 - self.probe_s

    def turn(self) -> float:
        self.evict_s += self.session.last.evict_s
        return self.lap()

    def share(self, round_s: float) -> float:
        return evict_share(self.evict_s, self.score_s, round_s)


# --- results ---------------------------------------------------------------------------------------


def fraction_of_full(value: float, full: float, lower_is_better: bool = False) -> float:
    """A policy's quality as a fraction of the full cache's: value / full (accuracy), or full / value for
    a lower-is-better metric (perplexity), so 1.0 is the full cache and less is worse either way."""
    if lower_is_better:
        return full / value if value > 0 else float("nan")
    return value / full if full > 0 else float("nan")


def parts(args, benchmark: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """The parts of a benchmark's run that `--policies` names (all where it names none); a part it lacks ends the run
    with one line."""
    chosen = tuple(args.policies or choices)
    if set(chosen) - set(choices):
        raise SystemExit(f"{benchmark}: --policies takes parts of the run: {', '.join(choices)}")
    return chosen


def rss_mb() -> float:
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def median(values):
    return statistics.median(values) if values else float("nan")


# --- plots -----------------------------------------------------------------------------------------


def bar_plot(path, panels: list[tuple[str, list[dict], float | None]]):
    """Grouped bars, one panel per (title, records, reference): policies along x, one bar per budget (the
    full cache's alone); a `reference` that is not None is drawn as a dashed line (a goal)."""
    plt = pyplot()
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

