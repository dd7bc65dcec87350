"""The arena: every registered policy and combination on streaming perplexity, line retrieval and
multi-round video QA, at the same budgets, in one run (`python -m benchmarks arena [--quick]`).

Each benchmark is sized so that its full cache ends near the same context C (`Scale.context`), and the
budgets are fractions of C (1/8 and 1/4 by default), so "budget 1/8" means the same number of tokens
in every benchmark; the full context each benchmark really used is recorded (`kv_tokens`, x
"context"). Per benchmark and (policy, budget): quality (stream_ppl: perplexity over the whole stream;
retrieval: accuracy on the questions whose line lies within the budget, and on all; video_qa:
accuracy), its fraction of the full cache's on the same questions (`of_full`; for perplexity
full / policy), the median time per round (`round_ms`; probe time taken out), the peak KV MB and the
median eviction share of a round. A round is a 64-token chunk (stream_ppl), five lines and a
question (retrieval), or a clip and a question with its answer (video_qa).

Records go to `arena.json` after every finished (benchmark, policy, budget), with the settings in
`arena.settings.json`; `--resume` continues a stopped run, and Ctrl-C keeps what was finished.
`python -m benchmarks.report arena` prints the table (see `report.arena_section`).
"""

import json
import random
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model
from models import load_adapter
from models.tiny_vlm.data import image_paths, load_image

from .arena_scores import BENCHMARKS, GOAL, QUALITY, fractions
from .common import bar_plot, config_for, machine, median, policy_names, print_table, read, record, write
from .corpus import token_stream
from .report import arena_section
from .retrieval import key_words, trial
from .stream_ppl import CHUNK, stream
from .video_qa import encode_video, make_video, plan, qa_rounds

NAME = "arena"
# the policy strings the arena runs beyond the registry: recall of evicted turns (its references are not
# configurations, so they stay out)
EXTRA = ("inf_mllm+recall",)


@dataclass(frozen=True)
class Scale:
    """How much each benchmark streams. `context` is the full cache's length the sizes aim at (about 42
    tokens per retrieval round and 50 per video QA round with tiny-vlm); budgets are context // fraction."""

    context: int
    fractions: tuple[int, ...]
    ppl_tokens: int
    retrieval_rounds: int
    retrieval_seeds: int
    video_rounds: int
    videos: int

    def __post_init__(self):
        if self.ppl_tokens % 64:
            raise ValueError(f"ppl_tokens must be a multiple of stream_ppl's 64-token chunk, got {self.ppl_tokens}")

    @property
    def budgets(self) -> list[int]:
        return [self.context // f for f in self.fractions]


SCALES = {
    "quick": Scale(context=384, fractions=(8,), ppl_tokens=384, retrieval_rounds=9, retrieval_seeds=1,
                   video_rounds=7, videos=1),
    "full": Scale(context=1024, fractions=(8, 4), ppl_tokens=1024, retrieval_rounds=24, retrieval_seeds=2,
                  video_rounds=20, videos=2),
}


def arena_policies(names=None) -> list[str]:
    """The registry's policies and combinations plus EXTRA (or the subset `names`)."""
    every = policy_names() + [p for p in EXTRA if p not in policy_names()]
    if names is None:
        return every
    return [p for p in every if p in names] + [p for p in dict.fromkeys(names) if p not in every]


# --- one unit of work per benchmark: (policy, budget) → records ----------------------------------------


def summary(benchmark, policy, budget, rows) -> list[dict]:
    """Time per round, peak KV MB and median eviction share of a unit's rounds (dicts with round_s,
    kv_mb and evict_share)."""
    return [record(benchmark, policy, budget, "round_ms", median([r["round_s"] for r in rows]) * 1e3, "median"),
            record(benchmark, policy, budget, "kv_mb", max(r["kv_mb"] for r in rows), "peak"),
            record(benchmark, policy, budget, "evict_share", median([r["evict_share"] for r in rows]), "median")]


def context_record(benchmark, rows) -> dict:
    return record(benchmark, "full", None, "kv_tokens", max(r["kv_tokens"] for r in rows), "context")


def run_stream_ppl(ctx, policy, budget, cfg, bar) -> list[dict]:
    rows = []

    def on_round(session, round_s, share):
        rows.append({"round_s": round_s, "evict_share": share, "kv_mb": session.kv_bytes / 2**20,
                     "kv_tokens": session.kv_tokens})
        bar.update()

    with tqdm(disable=True) as tokens:  # stream() counts tokens; the arena's bar counts rounds
        (_, ppl, _, _, _), = stream(ctx.model, ctx.tok, ctx.ids, policy, budget, cfg, ctx.ids.numel(), tokens,
                                    on_round=on_round)
    out = [record("stream_ppl", policy, budget, "ppl", ppl, "stream"), *summary("stream_ppl", policy, budget, rows)]
    return out + ([context_record("stream_ppl", rows)] if budget is None else [])


def run_retrieval(ctx, policy, budget, cfg, bar) -> list[dict]:
    rows = [row for seed in range(ctx.scale.retrieval_seeds)
            for row in trial(ctx.model, ctx.tok, ctx.words, policy, budget, cfg, ctx.scale.retrieval_rounds, seed,
                             bar, timed=True)]
    out = [record("retrieval", policy, budget, "accuracy", np.mean([r["ok"] for r in rows]), "all"),
           record("retrieval", policy, budget, "questions", len(rows), "all")]
    # within the budget: the asked line is fewer tokens back than the budget holds; the full cache is
    # scored on each budget's set of questions
    for b, x in ([(b, f"within {b}") for b in ctx.budgets] if budget is None else [(budget, "within budget")]):
        near = [r["ok"] for r in rows if r["distance"] < b]
        if near:
            out += [record("retrieval", policy, budget, "accuracy", np.mean(near), x),
                    record("retrieval", policy, budget, "questions", len(near), x)]
    out += summary("retrieval", policy, budget, rows)
    return out + ([context_record("retrieval", rows)] if budget is None else [])


def run_video_qa(ctx, policy, budget, cfg, bar) -> list[dict]:
    rows = [row for clips, asks in ctx.videos
            for row in qa_rounds(ctx.vlm, clips, asks, policy, budget, cfg, timed=True, bar=bar)]
    out = [record("video_qa", policy, budget, "accuracy", np.mean([r["ok"] for r in rows]), "all"),
           record("video_qa", policy, budget, "questions", len(rows), "all")]
    earlier = [r["ok"] for r in rows if r["back"] > 0]
    if earlier:
        out.append(record("video_qa", policy, budget, "accuracy", np.mean(earlier), "earlier clip"))
    out += summary("video_qa", policy, budget, rows)
    return out + ([context_record("video_qa", rows)] if budget is None else [])


RUNNERS = {"stream_ppl": run_stream_ppl, "retrieval": run_retrieval, "video_qa": run_video_qa}


def rounds_per_unit(scale: Scale) -> dict[str, int]:
    return {"stream_ppl": scale.ppl_tokens // CHUNK, "retrieval": scale.retrieval_rounds * scale.retrieval_seeds,
            "video_qa": scale.video_rounds * scale.videos}


# --- the run ------------------------------------------------------------------------------------------


class Context:
    """What the units share: models, the token stream, retrieval's words, the encoded videos."""

    def __init__(self, scale: Scale, budgets, benchmarks, model=None, tok=None, vlm=None):
        self.scale, self.budgets = scale, list(budgets)
        if model is None and ("stream_ppl" in benchmarks or "retrieval" in benchmarks):
            model, tok = load_model()
        self.model, self.tok = model, tok
        if "stream_ppl" in benchmarks:
            self.ids = token_stream(tok, scale.ppl_tokens)
        if "retrieval" in benchmarks:
            self.words = key_words(tok)
        if "video_qa" in benchmarks:
            if vlm is None:
                vlm = load_adapter("tiny-vlm")
            self.vlm = vlm
            self.videos = videos(vlm, scale)


def videos(vlm, scale: Scale) -> list[tuple[list, list]]:
    """(encoded clips, asks) per video: the videos `video_qa` makes for this many rounds."""
    folder = Path(".cache/video_qa")  # regenerated deterministically: not committed
    folder.mkdir(parents=True, exist_ok=True)
    paths = image_paths("test")
    out = []
    for v in range(scale.videos):
        images, asks = plan(random.Random(scale.video_rounds * 1000 + v), scale.video_rounds)
        path = make_video(folder / f"easyvqa_{scale.video_rounds}_rounds_{v}.mp4",
                          [load_image(paths[i]) for i in images])
        out.append((encode_video(vlm, path), asks))
    return out


def usable(ctx, policy: str, budgets) -> str | None:
    """Why `policy` cannot run at one of `budgets` (its options refused when the session is built), or None."""
    model = ctx.model if ctx.model is not None else ctx.vlm.model
    for budget in budgets:
        try:
            StreamSession(model, ctx.tok, policy, budget=budget, **config_for(policy, budget))
        except (ValueError, TypeError) as err:
            return f"{type(err).__name__}: {err}"
    return None


def arena(out, scale: Scale, names=None, budgets=None, benchmarks=BENCHMARKS, resume=False, model=None, tok=None,
          vlm=None, plot=True) -> list[dict]:
    """Run the arena into `out` (arena.json, arena.settings.json, arena.png); returns the records."""
    out = Path(out)
    budgets = list(budgets or scale.budgets)
    settings = {"scale": asdict(scale), "budgets": budgets, "benchmarks": list(benchmarks)}
    records, done = [], set()
    settings_path = out / f"{NAME}.settings.json"
    if resume and (out / f"{NAME}.json").exists() and settings_path.exists():
        before = json.loads(settings_path.read_text())
        if {k: before.get(k) for k in settings} != json.loads(json.dumps(settings)):
            raise SystemExit(f"{settings_path} is from another run: {before}; not resuming")
        records = read(out / f"{NAME}.json")  # save() recomputes the of_full records
        done = {(r["benchmark"], r["policy"], r["budget"]) for r in records if r["metric"] == "round_ms"}
        print(f"resuming: {len(done)} runs already done", file=sys.stderr)
    ctx = Context(scale, budgets, benchmarks, model, tok, vlm)
    policies = arena_policies(names)
    skipped = {p: why for p in policies if p != "full" and (why := usable(ctx, p, budgets))}
    for p, why in skipped.items():
        print(f"arena: {p} left out: {why}", file=sys.stderr)
    settings |= {"policies": [p for p in policies if p not in skipped], "skipped": skipped, "failed": {}}
    units = [(b, "full", None) for b in benchmarks if "full" in policies]
    units += [(b, p, budget) for b in benchmarks for budget in budgets for p in policies
              if p != "full" and p not in skipped]
    per_unit = rounds_per_unit(scale)
    try:
        with tqdm(total=sum(per_unit[b] for b, _, _ in units), desc="arena", unit="round") as bar:
            for benchmark, policy, budget in units:
                if (benchmark, policy, budget) in done:
                    bar.update(per_unit[benchmark])
                    continue
                bar.set_postfix_str(f"{benchmark} {policy}@{budget or 'full'}")
                start = bar.n
                try:
                    with torch.inference_mode():
                        records += RUNNERS[benchmark](ctx, policy, budget, config_for(policy, budget), bar)
                except Exception as err:  # a broken policy costs its own runs, not the others'
                    traceback.print_exc()
                    settings["failed"][f"{benchmark} {policy}@{budget}"] = f"{type(err).__name__}: {err}"
                    bar.update(per_unit[benchmark] - (bar.n - start))
                save(out, records, settings, plot=False)
    finally:  # also on Ctrl-C: what was finished is kept
        records = save(out, records, settings, plot=plot)
        if records:
            print_table([r for r in records if r["metric"] in ("of_full", "round_ms", "kv_mb")],
                        ["of_full", "round_ms", "kv_mb"])
        for unit, why in settings["failed"].items():
            print(f"arena: {unit} failed: {why}", file=sys.stderr)
    return records


def save(out: Path, records, settings, plot=True) -> list[dict]:
    """arena.json (the records with their `of_full` fractions) and the settings; with `plot`, arena.png."""
    records = [r for r in records if r["metric"] != "of_full"]
    records = records + fractions(records)
    write(out, NAME, records, [])
    (out / f"{NAME}.settings.json").write_text(json.dumps({"machine": machine()} | settings, indent=1) + "\n")
    if plot and records:
        plot_arena(out / f"{NAME}.png", records, settings)
    return records


def plot_arena(path, records, settings):
    panels = []
    for benchmark in settings["benchmarks"]:
        metric, x, _ = QUALITY[benchmark]
        rows = [r for r in records if r["benchmark"] == benchmark and r["metric"] == "of_full" and r["x"] == x]
        if rows:
            panels.append((f"{benchmark}: {metric} ({x}) ÷ full cache", rows, GOAL))
    for benchmark in settings["benchmarks"]:
        rows = [r for r in records if r["benchmark"] == benchmark and r["metric"] == "round_ms"]
        if rows:
            panels.append((f"{benchmark}: median ms per round", rows, None))
    if panels:
        bar_plot(path, panels)


def run(args):
    scale = SCALES["quick" if args.quick else "full"]
    out = Path(args.out)
    arena(out, scale, names=args.policies, budgets=args.budgets, resume=getattr(args, "resume", False))
    print(arena_section(out / f"{NAME}.json"))
