"""`python -m jetson soak`: a long run that proves memory stays flat.

A video loops through the real pipeline (file source → ingest thread → adapter → bounded cache), one
clip turn per round, a question every K rounds. Memory is sampled every N seconds into JSON lines,
each flushed as written, so a soak killed by the out-of-memory killer keeps its record. At the end
(or on Ctrl-C) the samples become benchmark records (`rss_mb`, `kv_mb` per sample, x = round; one
`rss_slope_mb_per_round`), a plot and a verdict: the steady-state RSS slope from a linear fit after
a warm-up, with its confidence interval, peak KV against the budget, swap, OOM events, and answers
produced against expected. `--compare-full` adds a full cache capped at a multiple of the budget's
memory, which climbs until the cap (an out-of-memory stand-in) and shows the difference in one plot.
"""

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from streaming.errors import ConfigError
from streaming.memory import MB, probe

from .tegrastats import Tegrastats

GOAL_SLOPE_MB_PER_ROUND = 0.01
QUESTION = "what is the color of the shape?"


class CapReached(Exception):
    """The capped full cache passed its memory cap (it would run out of memory here)."""


class EveryKRounds:
    """A schedule (the engine's `due`/`rest` interface) asking one question every `k` clips of video,
    generated as the video runs, so an open-ended soak holds no list of future questions."""

    def __init__(self, k: int, clip_seconds: float, text: str = QUESTION):
        from streaming.questions import Question

        self.step, self.next_t, self.released = k * clip_seconds, k * clip_seconds, 0
        self.question = lambda: Question(text, None)

    def due(self, video_t: float):
        out = []
        while self.next_t <= video_t + 1e-9:
            out.append(self.question())
            self.next_t += self.step
            self.released += 1
        return out

    def rest(self):
        return []


def oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat), None where unavailable."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def linear_fit(x, y) -> dict:
    """Least-squares slope with its standard error and 95% interval (Student t). Samples of a soak
    are autocorrelated, so the interval is a lower bound on the real uncertainty."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        return {"slope": float("nan"), "ci95": float("nan"), "n": n}
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    se = math.sqrt(float(resid @ resid) / (n - 2) / float(((x - x.mean()) ** 2).sum()))
    try:
        from scipy.stats import t as student_t

        q = float(student_t.ppf(0.975, n - 2))
    except ImportError:  # a Jetson without scipy: the normal quantile
        q = 1.96
    return {"slope": float(slope), "ci95": q * se, "n": n}


def soak_one(adapter, video, policy: str, budget, rounds: int | None, duration_s: float | None, args, log,
             cap_bytes: int | None = None) -> dict:
    """One soak; every sample goes to `log` (an open file, one JSON object per line) as it is taken."""
    from benchmarks.common import policy_configs
    from streaming.engine import TurnEngine
    from streaming.sources import FileSource

    cfg = policy_configs([policy], budget if isinstance(budget, int) else None).get(policy, {})
    session = adapter.new_session(policy, budget=budget, **cfg)
    source = FileSource(video, fps=args.fps, realtime=False, loops=1)
    per_loop = max(1, math.ceil(source.duration / args.clip_seconds))
    loops = math.ceil(rounds / per_loop) + 1 if rounds else 10**9
    source = FileSource(video, fps=args.fps, realtime=False, loops=loops)
    engine = TurnEngine(adapter, session, clip_seconds=args.clip_seconds, max_new_tokens=args.max_new_tokens)
    schedule = EveryKRounds(args.question_every, args.clip_seconds)
    label = policy if cap_bytes is None else f"{policy}_capped"
    state = {"round": 0, "answers": 0, "empty": 0, "peak_kv": 0, "last_sample": -1e9, "samples": []}
    start, oom_before = time.monotonic(), oom_kills()

    def sample(force=False):
        now = time.monotonic()
        if not force and now - state["last_sample"] < args.sample_s:
            return
        state["last_sample"] = now
        m = probe(args.device)
        row = {"policy": label, "round": state["round"], "t_s": round(now - start, 3), "video_t": engine.video_t,
               "kv_tokens": session.kv_tokens, "kv_mb": session.kv_bytes / MB, "peak_kv_tokens": state["peak_kv"],
               "answers": state["answers"], **m.as_dict()}
        if teg.latest:
            row["tegrastats"] = teg.latest
        state["samples"].append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()

    def on_clip(clip):
        state["round"] = clip.index
        state["peak_kv"] = max(state["peak_kv"], session.kv_tokens)
        sample(force=clip.index == 1)
        if cap_bytes is not None and session.kv_bytes > cap_bytes:
            raise CapReached(clip.index)
        if (rounds and clip.index >= rounds) or (duration_s and time.monotonic() - start >= duration_s):
            engine.stop.set()

    stopped, oom_event = None, None
    with Tegrastats(interval_ms=int(args.sample_s * 1000)) as teg:
        try:
            for answer in engine.run(source, schedule, on_clip=on_clip):
                state["answers"] += 1
                state["empty"] += not answer.answer
                state["peak_kv"] = max(state["peak_kv"], answer.kv_tokens)
        except CapReached as err:
            stopped = f"cap reached at round {err.args[0]}"
        except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if not isinstance(err, MemoryError) and "out of memory" not in str(err).lower():
                raise
            oom_event = f"{type(err).__name__} at round {state['round']}"
        except KeyboardInterrupt:
            stopped = "interrupted"
        sample(force=True)
    elapsed = time.monotonic() - start
    oom_after = oom_kills()
    n_rounds = state["round"]
    # a question at k·K clips is asked before clip k·K + 1 goes in, so R rounds owe floor((R-1)/K) answers
    expected = (n_rounds - 1) // args.question_every if n_rounds else 0
    budgets = session.cache.budgets
    return {"policy": label, "budget": min(budgets) if budgets else None, "rounds": n_rounds,
            "elapsed_s": elapsed, "s_per_round": elapsed / n_rounds if n_rounds else float("nan"),
            "answers": state["answers"], "empty_answers": state["empty"], "expected_answers": expected,
            "peak_kv_tokens": state["peak_kv"], "samples": state["samples"], "stopped": stopped,
            "oom_events": ([oom_event] if oom_event else [])
            + ([f"kernel oom_kill count +{oom_after - oom_before}"] if oom_before is not None
               and oom_after is not None and oom_after > oom_before else []),
            "turn_tokens": _turn_tokens(adapter), "question_tokens": len(adapter.text_ids(
                adapter.question_text(QUESTION))[0])}


def _turn_tokens(adapter) -> int:
    return adapter.describe().visual_tokens + len(adapter.text_ids("".join(adapter.clip_text(1, 0.0)))[0])


def verdict(run: dict, args) -> dict:
    """Steady-state slopes after the warm-up, peak KV against budget + one turn + one answer, swap,
    OOM events, answers."""
    samples = run["samples"]
    full = [s["round"] for s in samples if run["budget"] is not None and s["kv_tokens"] >= run["budget"]]
    warm = max(1, int(run["rounds"] * args.warmup), full[0] if full else 0)  # not before the cache is full
    steady = [s for s in samples if s["round"] >= warm]
    per_round = linear_fit([s["round"] for s in steady], [s["rss_mb"] for s in steady])
    per_second = linear_fit([s["t_s"] for s in steady], [s["rss_mb"] for s in steady])
    bound = None
    if run["budget"] is not None:
        bound = run["budget"] + run["turn_tokens"] + run["question_tokens"] + args.max_new_tokens
    swap = [s["swap_used_mb"] for s in samples]
    v = {
        "policy": run["policy"], "budget_tokens": run["budget"], "rounds": run["rounds"],
        "elapsed_s": round(run["elapsed_s"], 1), "s_per_round": round(run["s_per_round"], 4),
        "warmup_rounds": warm, "steady_samples": per_round["n"],
        "rss_slope_mb_per_round": per_round["slope"], "rss_slope_ci95_mb_per_round": per_round["ci95"],
        "rss_slope_mb_per_hour": per_second["slope"] * 3600, "rss_slope_ci95_mb_per_hour": per_second["ci95"] * 3600,
        "rss_peak_mb": max((s["rss_mb"] for s in samples), default=float("nan")),
        "rss_first_steady_mb": steady[0]["rss_mb"] if steady else float("nan"),
        "rss_last_mb": samples[-1]["rss_mb"] if samples else float("nan"),
        "kv_peak_tokens": run["peak_kv_tokens"], "kv_bound_tokens": bound,
        "kv_within_bound": bound is None or run["peak_kv_tokens"] <= bound,
        "kv_peak_mb": max((s["kv_mb"] for s in samples), default=0.0),
        "swap_used_mb_start": swap[0] if swap else None, "swap_used_mb_max": max(swap) if swap else None,
        "oom_events": run["oom_events"], "stopped": run["stopped"],
        "answers": run["answers"], "expected_answers": run["expected_answers"], "empty_answers": run["empty_answers"],
    }
    if run["policy"].endswith("_capped"):
        v["passed"] = None  # the comparison run: it is meant to climb
    else:
        v["passed"] = bool(abs(v["rss_slope_mb_per_round"]) <= GOAL_SLOPE_MB_PER_ROUND and v["kv_within_bound"]
                           and not v["oom_events"] and v["answers"] >= v["expected_answers"]
                           and not v["empty_answers"])
    return {k: (round(x, 6) if isinstance(x, float) else x) for k, x in v.items()}


def describe(v: dict) -> str:
    lines = [f"soak {v['policy']} (budget {v['budget_tokens']} tokens): {v['rounds']} rounds in "
             f"{v['elapsed_s']:.0f} s ({v['s_per_round']:.3f} s/round)" + (f", {v['stopped']}" if v["stopped"] else "")]
    lines.append(f"  RSS slope after {v['warmup_rounds']} warm-up rounds: {v['rss_slope_mb_per_round']:+.5f} "
                 f"± {v['rss_slope_ci95_mb_per_round']:.5f} MB/round, {v['rss_slope_mb_per_hour']:+.2f} ± "
                 f"{v['rss_slope_ci95_mb_per_hour']:.2f} MB/hour (95% CI, {v['steady_samples']} samples)")
    lines.append(f"  RSS {v['rss_first_steady_mb']:.1f} → {v['rss_last_mb']:.1f} MB, peak {v['rss_peak_mb']:.1f} MB; "
                 f"swap used {v['swap_used_mb_start']:.0f} → max {v['swap_used_mb_max']:.0f} MB; "
                 f"OOM events: {', '.join(v['oom_events']) or 'none'}")
    bound = f"bound {v['kv_bound_tokens']}" if v["kv_bound_tokens"] else "unbounded"
    lines.append(f"  KV peak {v['kv_peak_tokens']} tokens ({bound}), {v['kv_peak_mb']:.1f} MB; answers "
                 f"{v['answers']} of {v['expected_answers']} expected ({v['empty_answers']} empty)")
    if v["passed"] is not None:
        lines.append(f"  verdict: {'PASS' if v['passed'] else 'FAIL'} (goal: |slope| ≤ {GOAL_SLOPE_MB_PER_ROUND} "
                     "MB/round, KV within budget + one turn, no OOM, no answer lost)")
    return "\n".join(lines)


def records(run: dict, v: dict) -> list[dict]:
    from benchmarks.common import record

    policy, budget = run["policy"], run["budget"]
    out = []
    for s in run["samples"]:
        out.append(record("soak", policy, budget, "rss_mb", s["rss_mb"], s["round"]))
        out.append(record("soak", policy, budget, "kv_mb", s["kv_mb"], s["round"]))
    if policy.endswith("_capped"):
        if run["stopped"] and run["stopped"].startswith("cap"):
            out.append(record("soak", policy, budget, "oom_round", run["rounds"], run["rounds"]))
    elif math.isfinite(v["rss_slope_mb_per_round"]):
        out.append(record("soak", policy, budget, "rss_slope_mb_per_round", v["rss_slope_mb_per_round"], run["rounds"]))
    return out


def parse_duration(text: str) -> float:
    from streaming.questions import QuestionError, parse_time

    try:
        seconds = parse_time(text)
    except QuestionError as err:
        raise ConfigError(f"--duration: cannot read {text!r} as a duration (use e.g. 90s, 30m, 2h)") from err
    if not seconds > 0:
        raise ConfigError(f"--duration must be positive, got {text!r}")
    return seconds


def run(args) -> int:
    from streaming.sources import FileSource, bundled_clip

    if (args.rounds is None) == (args.duration is None):
        raise ConfigError("give exactly one of --rounds N or --duration TIME")
    if args.rounds is not None and args.rounds < 2:
        raise ConfigError(f"--rounds must be at least 2, got {args.rounds}")
    for name in ("clip_seconds", "fps"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if not (math.isfinite(args.sample_s) and args.sample_s >= 0):
        raise ConfigError(f"--sample-s must be a number of seconds ≥ 0 (0: every round), got {args.sample_s}")
    if args.question_every < 1 or args.max_new_tokens < 1:
        raise ConfigError("--question-every and --max-new-tokens must be at least 1")
    if not 0 <= args.warmup < 1:
        raise ConfigError(f"--warmup is a fraction of the rounds in [0, 1), got {args.warmup}")
    duration = parse_duration(args.duration) if args.duration else None
    video = Path(args.video) if args.video else bundled_clip("bikes.mp4")
    FileSource(video, fps=args.fps)  # a bad file fails here, before the model loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from streaming.memory import tune_allocator

    tune_allocator()  # as stream-qa does: the soak measures the product's own memory behaviour
    from models import load_adapter  # torch and transformers load only once the arguments are good

    adapter = load_adapter(args.model, device=args.device)
    budget = args.budget
    if budget == "auto":
        from streaming.memory import auto_budget_for

        budget, auto = auto_budget_for(adapter, args.max_new_tokens, args.device)
        print(f"soak: --budget auto: {budget} tokens per layer ({auto.explain()})", file=sys.stderr)
    elif str(budget).isdigit():
        budget = int(budget)
    log_path = out / f"{args.name}.jsonl"
    runs, verdicts = [], []
    with open(log_path, "w") as log:
        plan = [(args.policy, budget, None)]
        if args.compare_full:
            per_token = _bytes_per_token(adapter)
            tokens = budget if isinstance(budget, int) else None
            if tokens is None:
                raise ConfigError("--compare-full needs --budget in tokens")
            plan.append(("full", None, args.compare_full * tokens * per_token))
        for policy, b, cap in plan:
            print(f"soak: {policy}{' (capped)' if cap else ''} on {video.name}, "
                  f"{args.rounds or ''}{' rounds' if args.rounds else args.duration}…", file=sys.stderr)
            r = soak_one(adapter, video, policy, b, args.rounds, duration, args, log, cap)
            v = verdict(r, args)
            print(describe(v), flush=True)
            runs.append(r)
            verdicts.append(v)
            if r["stopped"] == "interrupted":
                break
    from benchmarks.common import write

    recs = [rec for r, v in zip(runs, verdicts, strict=True) for rec in records(r, v)]
    write(out, args.name, recs, ["rss_mb", "kv_mb"], x_label="round")
    (out / f"{args.name}_verdict.json").write_text(json.dumps(verdicts, indent=1) + "\n")
    print(f"soak: {out / args.name}.json, .png, _verdict.json and {log_path.name} written", file=sys.stderr)
    main = verdicts[0]
    return 0 if main["passed"] else 1


def _bytes_per_token(adapter) -> int:
    import torch

    from inf_mllm import KVShape

    shape = KVShape.from_config(adapter.model.config, torch.finfo(adapter.model.dtype).bits // 8)
    return shape.bytes_per_token_layer * shape.num_layers
