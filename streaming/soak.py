"""A soak: the stream runs for N rounds or a wall-clock time while memory is sampled, then a verdict.

Shared by `stream-qa --soak` and `python -m jetson soak` (which adds tegrastats, a capped full cache
beside the bounded one, benchmark records and a plot). Every sample is one JSON line, flushed as
written, so a soak killed by the out-of-memory killer keeps its record. The verdict is the
steady-state RSS slope from a linear fit after a warm-up, with its confidence interval, peak KV
against the budget, swap, out-of-memory events, and answers produced against expected.
"""

import json
import math
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .checks import STOP_STATUS, check_output_file
from .errors import EXIT_INTERRUPTED, EXIT_SOAK_FAILED, EXIT_SOAK_INCONCLUSIVE, ConfigError, UsageError
from .memory import MB, probe
from .questions import Question, QuestionError, parse_time

GOAL_SLOPE_MB_PER_ROUND = 0.01
QUESTION = "what is on screen now?"  # the default soak loops the bundled street clip: a question that fits it


class CapReached(Exception):
    """The capped full cache passed its memory cap (it would run out of memory here)."""


class EveryKRounds:
    """A schedule (the engine's `due`/`rest` interface) asking one question every `k` clips of video,
    generated as the video runs, so an open-ended soak holds no list of future questions."""

    def __init__(self, k: int, clip_seconds: float, text: str = QUESTION):
        self.k, self.text, self.released = k, text, 0
        self.step = self.next_t = k * clip_seconds
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


def parse_soak(text: str) -> tuple[int | None, float | None]:
    """`--soak 10000` is a number of rounds; `--soak 2h` (or 30m, 90s, 1:30:00) a wall-clock time."""
    text = str(text).strip()
    if text.isdigit():
        if int(text) < 2:
            raise ConfigError(f"--soak needs at least 2 rounds, got {text}")
        return int(text), None
    try:
        seconds = parse_time(text)
    except QuestionError as err:
        raise ConfigError(f"--soak: cannot read {text!r} as rounds or a duration (use e.g. 10000, 30m, 2h)") from err
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"--soak duration must be positive, got {text!r}")
    return None, seconds


def oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat), None where unavailable."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        return None
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
        from scipy.stats import t as student_t  # optional (the data extra); a normal quantile stands in

        q = float(student_t.ppf(0.975, n - 2))
    except ImportError:
        q = 1.96
    return {"slope": float(slope), "ci95": q * se, "n": n}


def run_soak(engine, session, source, schedule, log, *, rounds: int | None, duration_s: float | None,
             sample_s: float, device: str, label: str, cap_bytes: int | None = None, extra=None,
             on_answer=None, on_token=None, on_clip=None) -> dict:
    """Drive `engine` over `source` until `rounds` clips or `duration_s` seconds (or Ctrl-C), one JSON
    line per memory sample into `log`. `extra()` adds fields to each sample (tegrastats); `cap_bytes`
    stops a full cache where it would run out of memory."""
    state = {"round": 0, "answers": 0, "empty": 0, "peak_kv": 0, "last_sample": -1e9, "samples": []}
    start, oom_before = time.monotonic(), oom_kills()

    def sample(force=False):
        now = time.monotonic()
        if not force and now - state["last_sample"] < sample_s:
            return
        state["last_sample"] = now
        row = {"policy": label, "round": state["round"], "t_s": round(now - start, 3), "video_t": engine.video_t,
               "kv_tokens": session.kv_tokens, "kv_mb": session.kv_bytes / MB, "peak_kv_tokens": state["peak_kv"],
               "answers": state["answers"], **probe(device).as_dict(), **(extra() if extra else {})}
        state["samples"].append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()

    def clip_done(clip):
        state["round"] = clip.index
        state["peak_kv"] = max(state["peak_kv"], session.kv_tokens)
        sample(force=clip.index == 1)
        if cap_bytes is not None and session.kv_bytes > cap_bytes:
            raise CapReached(clip.index)
        if (rounds and clip.index >= rounds) or (duration_s and time.monotonic() - start >= duration_s):
            engine.stop.set()
        if on_clip:
            on_clip(clip)

    stopped, oom_event, stop_signal = None, None, None
    try:
        for answer in engine.run(source, schedule, on_clip=clip_done, on_token=on_token):
            state["answers"] += 1
            state["empty"] += not answer.answer
            state["peak_kv"] = max(state["peak_kv"], answer.kv_tokens)
            if on_answer:
                on_answer(answer)
    except CapReached as err:
        stopped = f"cap reached at round {err.args[0]}"
    except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(err, MemoryError) and "out of memory" not in str(err).lower():
            raise
        oom_event = f"{type(err).__name__} at round {state['round']}"
    except KeyboardInterrupt as stop:
        stopped, stop_signal = "interrupted", getattr(stop, "signum", None)  # None: Ctrl-C
    sample(force=True)
    oom_after = oom_kills()
    killed = oom_before is not None and oom_after is not None and oom_after > oom_before
    oom = ([oom_event] if oom_event else []) + ([f"kernel oom_kill count +{oom_after - oom_before}"] if killed else [])
    return _result(label, state, engine, session, schedule, time.monotonic() - start, stopped, stop_signal, oom)


def _result(label: str, state: dict, engine, session, schedule, elapsed: float, stopped, stop_signal,
            oom: list) -> dict:
    """What a soak run returns: its rounds, answers (and how many it owed), peak KV, samples and how it ended."""
    n_rounds = state["round"]
    every = getattr(schedule, "k", 0)
    # a question at k·K clips is asked before clip k·K + 1 goes in, so R rounds owe floor((R-1)/K) answers
    expected = (n_rounds - 1) // every if n_rounds and every else state["answers"]
    budgets = session.cache.budgets
    adapter = engine.adapter
    return {"policy": label, "budget": min(budgets) if budgets else None, "rounds": n_rounds,
            "elapsed_s": elapsed, "s_per_round": elapsed / n_rounds if n_rounds else float("nan"),
            "answers": state["answers"], "empty_answers": state["empty"], "expected_answers": expected,
            "peak_kv_tokens": state["peak_kv"], "samples": state["samples"], "stopped": stopped,
            "stop_signal": stop_signal, "oom_events": oom, "turn_tokens": adapter.turn_tokens(),
            "question_tokens": adapter.question_tokens(getattr(schedule, "text", QUESTION))}


def verdict(run: dict, args) -> dict:
    """Steady-state slopes after the warm-up (`args.warmup`, a share of the rounds, never before the cache is full,
    nor before the second answer where that leaves half the rounds: the first answer's one-time allocations, +13 MB
    for tiny-vlm, settle over the rounds after it, and on a loaded CPU past a short run's share), peak KV against
    budget + one turn + one answer, swap, OOM events, answers."""
    samples = run["samples"]
    full = [s["round"] for s in samples if run["budget"] is not None and s["kv_tokens"] >= run["budget"]]
    second = [s["round"] for s in samples if s.get("answers", 0) >= 2 and s["round"] <= run["rounds"] // 2]
    warm = max(1, int(run["rounds"] * args.warmup), full[0] if full else 0, second[0] if second else 0)
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
    v["verdict"] = None if run["policy"].endswith("_capped") else judged(v)  # the comparison run: meant to climb
    v["passed"] = None if v["verdict"] is None else v["verdict"] == "PASS"
    return {k: (round(x, 6) if isinstance(x, float) else x) for k, x in v.items()}


def judged(v: dict) -> str:
    """PASS, FAIL, or INCONCLUSIVE: RSS climbed, but over too few rounds for its interval to tell a slow leak from
    noise (the KV bound, OOM events and the answers decide at once). A leak is memory that grows: a falling slope
    is no leak, however wide its interval."""
    if not (v["kv_within_bound"] and not v["oom_events"] and v["answers"] >= v["expected_answers"]
            and not v["empty_answers"]):
        return "FAIL"
    if v["rss_slope_mb_per_round"] <= GOAL_SLOPE_MB_PER_ROUND:
        return "PASS"
    return "FAIL" if v["rss_slope_ci95_mb_per_round"] <= GOAL_SLOPE_MB_PER_ROUND else "INCONCLUSIVE"  # nan: too few


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
    if v["verdict"] is not None:
        lines.append(f"  verdict: {v['verdict']} (goal: slope ≤ {GOAL_SLOPE_MB_PER_ROUND} "
                     "MB/round, KV within budget + one turn, no OOM, no answer lost)")
        if not v["rss_slope_ci95_mb_per_round"] <= GOAL_SLOPE_MB_PER_ROUND:  # nan (too few samples) included
            lines.append(f"  note: the slope's interval is wider than the goal ({GOAL_SLOPE_MB_PER_ROUND} MB/round): "
                         f"{v['rounds']} rounds are too few to tell a slow leak from noise; run more rounds")
    return "\n".join(lines)


# --- under stream-qa (`--soak`) ----------------------------------------------------------------------


def soak_plan(args) -> tuple[int | None, float | None] | None:
    """--soak: (rounds, seconds), checked before torch loads; None without --soak."""
    if args.soak is None:
        return None
    if args.ask or args.questions:
        raise UsageError("--soak asks --question every --every of video; --ask and --questions do not apply")
    if not (args.soak_sample >= 0 and args.soak_sample < float("inf")):
        raise UsageError(f"--soak-sample must be a number of seconds ≥ 0, got {args.soak_sample}")
    check_output_file("--soak-log", args.soak_log)
    return parse_soak(args.soak)


def soak_schedule(args):
    """A question every --every of video (default every 10 clips), generated as the video runs."""
    step = parse_time(args.every) if args.every else 10 * args.clip_seconds
    if not step > 0:
        raise UsageError(f"--every must be a positive time, got {args.every!r}")
    return EveryKRounds(max(1, round(step / args.clip_seconds)), args.clip_seconds, args.question or QUESTION)


def run_soak_cli(args, soak, engine, session, source, schedule, on_answer, on_token, out) -> int:
    """The soak under `stream-qa`: answers as usual on stdout, a progress bar on stderr, samples in
    --soak-log, then the verdict (text, or one JSON object with --json)."""
    rounds, seconds = soak
    bar = tqdm(total=rounds, unit="round", desc="soak", file=sys.stderr, disable=None,
               postfix={"kv": session.kv_tokens})
    print(f"stream-qa: soak of {rounds or f'{seconds:.0f} s'}{' rounds' if rounds else ''}; memory samples in "
          f"{args.soak_log}", file=sys.stderr)

    def on_clip(clip):
        bar.update(clip.index - bar.n)
        bar.set_postfix(kv=session.kv_tokens, refresh=False)

    with open(args.soak_log, "w") as log:
        run = run_soak(engine, session, source, schedule, log, rounds=rounds, duration_s=seconds,
                       sample_s=args.soak_sample, device=args.device, label=args.policy, on_answer=on_answer,
                       on_token=on_token, on_clip=on_clip)
    bar.close()
    v = verdict(run, Namespace(warmup=0.2, max_new_tokens=args.max_new_tokens))
    out.write(json.dumps({"soak_verdict": v}) + "\n" if args.json else describe(v) + "\n")
    out.flush()
    if run["stopped"] == "interrupted":
        print("stream-qa: soak stopped; the verdict covers the rounds run", file=sys.stderr)
        return STOP_STATUS.get(run["stop_signal"], EXIT_INTERRUPTED)
    return {"PASS": 0, "INCONCLUSIVE": EXIT_SOAK_INCONCLUSIVE}.get(v["verdict"], EXIT_SOAK_FAILED)
