"""How `natural.py` judges an answer and sums up a run: accuracy per question type and age, the false-link,
hallucination, not-in-the-target's-words and contradiction rates, and the share of "what" answers that are a faithful
copy of their target clip's words (`faithful`). Apart from the stream and the questions (`natural.py`) so each reads on
its own."""

import re
import statistics
from pathlib import Path

from models.intent import sees
from models.tiny_vlm.labels import mentioned, words_of
from models.words import items

from .common import record

AGES = ((0, "on screen"), (60, "<1 min"), (300, "1-5 min"), (1200, "5-20 min"), (float("inf"), "20-60 min"))
PRESENT = ("now_is", "now_what")


def unsupported(ask, answer: str, seen: list[str]) -> bool:
    """An answer that names a thing, or says yes to one, that the given clips' words do not hold: with
    the target clips' words, a wrong clip's or an invented thing; with every clip's so far, a
    hallucination (a thing never recognised at all)."""
    a = answer.strip().lower()
    if ask.kind in ("when", "count"):
        return False
    words = {"seen": " ".join(seen).lower()}
    if ask.expected in ("yes", "no"):
        return a.startswith("yes") and not sees(words, ask.thing)
    named = {w for i in mentioned(a, more=True) for w in words_of(i, more=True) if re.search(rf"\b{w}\b", a)}
    return any(not sees(words, w) for w in named)


def age_bucket(seconds: float) -> str:
    return next(label for limit, label in AGES if seconds <= limit)


def contradicts(answer: str, looked_up: str) -> bool:
    """A "no" beside a provenance line that found the thing asked about ("last cat: clip 12 (0:44-0:48)")."""
    found = re.match(r"(?:first|last) [\w-]+: clip \d+", looked_up)
    return answer.strip().lower().startswith("no") and found is not None


def faithful(expected: str, answer: str, seen: list[str]) -> bool | None:
    """For a "what" question (expected "thing"), whether the answer is a faithful copy of its target clips' words:
    it names at least one thing, and every comma-separated item it names is one of the items those clips' `seen`
    words list, spelled exactly as they hold it ("tabby cat" is, "tab Bycat", "albatross (bird" and another clip's
    "hen-of-the-woods" are not); None for other questions."""
    if expected != "thing":
        return None
    held = {item for words in seen for item in items(words)}
    named = [part.strip() for part in answer.split(",") if part.strip()]
    return bool(named) and all(item in held for item in named)


def summarize(rows: list[dict], budget: int) -> list[dict]:
    recs = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]

        def acc(group, x, policy=policy):
            if group:
                recs.append(record("natural", policy, budget, "accuracy", statistics.mean(r["ok"] for r in group), x))
                recs.append(record("natural", policy, budget, "questions", len(group), x))

        for kind in dict.fromkeys(r["kind"] for r in mine):
            acc([r for r in mine if r["kind"] == kind], kind)
        model = [r for r in mine if r["source"] == "model"]
        for _, label in AGES:
            acc([r for r in model if r["age_s"] is not None and age_bucket(r["age_s"]) == label], f"age {label}")
            acc([r for r in model if r["recognised"] and r["age_s"] is not None and age_bucket(r["age_s"]) == label],
                f"recognised, age {label}")
        acc([r for r in model if r["kind"] not in PRESENT and r["age_s"] and r["age_s"] > 45], "evicted (>45 s)")
        acc([r for r in model if r["kind"] in PRESENT], "present")
        acc([r for r in model if r["recognised"] and r["kind"] not in PRESENT and r["age_s"] and r["age_s"] > 45],
            "recognised, evicted (>45 s)")
        acc([r for r in model if r["recognised"] and r["kind"] in PRESENT], "recognised, present")
        acc(mine, "all")
        present = [r for r in mine if r["kind"] in PRESENT]
        recs.append(record("natural", policy, budget, "rate", statistics.mean(bool(r["linked"]) for r in present),
                           "false links (present)"))
        recs.append(record("natural", policy, budget, "rate", statistics.mean(r["hallucinates"] for r in mine),
                           "hallucination"))
        recs.append(record("natural", policy, budget, "rate", statistics.mean(r["unsupported"] for r in mine),
                           "not in the target's words"))
        recs.append(record("natural", policy, budget, "rate", statistics.mean(r["contradicts"] for r in mine),
                           "contradicts its provenance"))
        for key, x in (("faithful", "faithful copy (what)"), ("faithful_about", "faithful to the clip it is about")):
            what = [r[key] for r in mine if r.get(key) is not None]
            if what:
                recs.append(record("natural", policy, budget, "rate", statistics.mean(what), x))
        for kind in ("model", "clip log"):
            times = [r["ttft_s"] for r in mine if r["source"] == kind]
            if times:
                recs.append(record("natural", policy, budget, "ttft_s", statistics.median(times), f"median, {kind}"))
        times = [r["ttft_s"] for r in model if r["linked"]]  # what a recall mode's recompute costs
        if times:
            recs.append(record("natural", policy, budget, "ttft_s", statistics.median(times), "median, linking"))
            recs.append(record("natural", policy, budget, "questions", len(times), "linking"))
    return recs


def plot(path: Path, recs: list[dict], budget: int) -> None:
    from streaming.records import pyplot

    plt = pyplot()
    policies = list(dict.fromkeys(r["policy"] for r in recs))
    groups = [("question type", [x for x in dict.fromkeys(r["x"] for r in recs if r["metric"] == "accuracy")
                                 if not x.startswith(("age", "recognised", "evicted", "present", "all"))]),
              ("age of the clip asked about (recognised)", [f"recognised, age {label}" for _, label in AGES])]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for ax, (title, xs) in zip(axes, groups, strict=True):
        width = 0.8 / len(policies)
        for p, policy in enumerate(policies):
            vals = {r["x"]: r["value"] for r in recs if r["policy"] == policy and r["metric"] == "accuracy"}
            ax.bar([i + p * width for i in range(len(xs))], [vals.get(x, 0) for x in xs], width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))])
        ax.set_xticklabels([x.replace("recognised, age ", "") for x in xs], rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.set_ylabel("accuracy")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"plain-words questions over {len(recs) and 'an hour of'} real footage, budget {budget}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
