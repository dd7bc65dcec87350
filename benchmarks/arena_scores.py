"""How the arena's records are read: the benchmarks it runs, the quality each is ranked by, the goal,
each policy's fraction of the full cache and the best configuration at a budget.

Both the run (`arena.py`, which stores the fractions) and the report (`report.arena_section`, which
ranks them) read these, so they live apart from both: the report needs no torch, and neither module
imports the other's rules.
"""

from collections import defaultdict

from .common import fraction_of_full, record

BENCHMARKS = ("stream_ppl", "retrieval", "video_qa")
# the quality each benchmark is ranked by: (metric, x, lower is better)
QUALITY = {"stream_ppl": ("ppl", "stream", True), "retrieval": ("accuracy", "within budget", False),
           "video_qa": ("accuracy", "all", False)}
GOAL = 0.95  # of the full cache's quality at 1/8 of its context (issue 14)


def fractions(records) -> list[dict]:
    """`of_full` records: each bounded policy's quality (ppl, accuracy) over the full cache's on the same
    questions (x "within budget" is read against the full cache's x "within <budget>")."""
    full = {(r["benchmark"], r["metric"], r["x"]): r["value"] for r in records
            if r["policy"] == "full" and r["metric"] in ("ppl", "accuracy")}
    out = []
    for r in records:
        if r["policy"] == "full" or r["metric"] not in ("ppl", "accuracy"):
            continue
        x = f"within {r['budget']}" if r["x"] == "within budget" else r["x"]
        ref = full.get((r["benchmark"], r["metric"], x))
        if ref is not None:
            out.append(record(r["benchmark"], r["policy"], r["budget"], "of_full",
                              fraction_of_full(r["value"], ref, lower_is_better=r["metric"] == "ppl"), r["x"]))
    return out


def best_at(records, budget: int, goal_benchmarks=("retrieval", "video_qa")):
    """(policy, {benchmark: of_full}) of the configuration at `budget` whose worst fraction of the full
    cache over `goal_benchmarks` (their QUALITY) is highest; None when no policy has them all."""
    at = defaultdict(dict)
    for r in records:
        if r["metric"] == "of_full" and r["budget"] == budget and r["x"] == QUALITY[r["benchmark"]][1]:
            at[r["policy"]][r["benchmark"]] = r["value"]
    complete = {p: v for p, v in at.items() if all(b in v for b in goal_benchmarks)}
    if not complete:
        return None
    goals = {p: {b: v[b] for b in goal_benchmarks} for p, v in complete.items()}
    policy = max(goals, key=lambda p: (min(goals[p].values()), sum(goals[p].values())))
    return policy, goals[policy]
