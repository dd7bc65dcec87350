"""`python -m jetson soak`: a long run that proves memory stays flat.

A video loops through the real pipeline (file source → ingest thread → adapter → bounded cache), one
clip turn per round, a question every K rounds. Memory is sampled every N seconds into JSON lines,
each flushed as written, so a soak killed by the out-of-memory killer keeps its record. At the end
(or on Ctrl-C) the samples become benchmark records (`rss_mb`, `kv_mb` per sample, x = round; one
`rss_slope_mb_per_round`), a plot and a verdict: the steady-state RSS slope from a linear fit after
a warm-up, with its confidence interval, peak KV against the budget, swap, OOM events, and answers
produced against expected. `--compare-full` adds a full cache capped at a multiple of the budget's
memory, which climbs until the cap (an out-of-memory stand-in) and shows the difference in one plot.
`--streams N` soaks N copies of the video at once on one session pool, one verdict per stream (KV flat per stream),
passing when every stream passes.
"""

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from inf_mllm.spec import parse_budget
from streaming.budgets import auto_budget_for
from streaming.checks import check_budget
from streaming.errors import ConfigError
from streaming.questions import QuestionError, parse_time
from streaming.records import machine, record, write
from streaming.settings import Settings, check_options, option_names
from streaming.soak import EveryKRounds, describe, run_soak, verdict
from streaming.source_spec import SourceSpec
from streaming.sources import FileSource, bundled_clip

from .tegrastats import Tegrastats


def soak_one(adapter, video, policy: str, budget, rounds: int | None, duration_s: float | None, args, log,
             cap_bytes: int | None = None, options: dict | None = None, on_clip=None) -> dict:
    """One soak of `policy` on a looped `video`; every sample goes to `log` (one JSON object per line).
    `options` are the policy's (default: `policy_options` without a window or bias of its own); `on_clip` is
    called after each clip turn (the progress bar)."""
    from inf_mllm.pool import SessionPool  # loads torch: this module stays light until the arguments are checked
    from streaming.open import open_stream

    options = policy_options(policy, budget) if options is None else options
    per_loop = max(1, math.ceil(FileSource(video, fps=args.fps).duration / args.clip_seconds))
    loops = math.ceil(rounds / per_loop) + 1 if rounds else 10**9
    source = SourceSpec("file", str(video), fps=args.fps, realtime=False, loops=loops).open()
    pool = SessionPool(adapter.model, adapter.tokenizer)  # a lone stream is a pool of one
    try:
        stream = open_stream(stream_config(policy, budget, options, args), source, pool, adapter)
        return _soak(stream, source, policy, rounds, duration_s, args, log, cap_bytes, on_clip)
    finally:
        pool.close()


def stream_config(policy: str, budget, options: dict, args):
    """The soak's stream as `open_stream` takes it: its policy, budget and options, the soak's clip and answer
    lengths."""
    from streaming.open import StreamConfig

    return StreamConfig(Settings(policy=policy, budget=str(budget if budget is not None else Settings.budget),
                                 fps=args.fps, clip_seconds=args.clip_seconds, max_new_tokens=args.max_new_tokens,
                                 **options), args.device)


def _soak(stream, source, policy, rounds, duration_s, args, log, cap_bytes, on_clip) -> dict:
    engine, session = stream.engine, stream.session
    schedule = EveryKRounds(args.question_every, args.clip_seconds)
    label = policy if cap_bytes is None else f"{policy}_capped"
    with Tegrastats(interval_ms=int(args.sample_s * 1000)) as teg:
        return run_soak(engine, session, source, schedule, log, rounds=rounds, duration_s=duration_s,
                        sample_s=args.sample_s, device=args.device, label=label, cap_bytes=cap_bytes,
                        extra=lambda: {"tegrastats": teg.latest} if teg.latest else {}, on_clip=on_clip)


def soak_streams(adapter, video, policy: str, budget, rounds: int | None, duration_s: float | None, args, log,
                 options: dict, streams: int, on_clip=None) -> list[dict]:
    """`streams` copies of the looped video, each its own session on one session pool (inf_mllm/pool.py), soaked
    together as `soak_one` soaks one: one run per stream (labelled "POLICY stream N"), each sample with that
    stream's KV beside the process's memory. Ctrl-C stops every stream and keeps what each sampled."""
    import threading

    from inf_mllm.pool import SessionPool
    from streaming.open import open_stream

    pool = SessionPool(adapter.model, adapter.tokenizer, slots=streams)  # as stream-qa's streams (slots.py)
    per_loop = max(1, math.ceil(FileSource(video, fps=args.fps).duration / args.clip_seconds))
    loops = math.ceil(rounds / per_loop) + 1 if rounds else 10**9
    runs, errors, engines, threads = [None] * streams, [], [], []
    with Tegrastats(interval_ms=int(args.sample_s * 1000)) as teg:
        for i in range(streams):
            stream = open_stream(stream_config(policy, budget, options, args), None, pool, adapter)
            engine, pooled = stream.engine, stream.session
            engines.append(engine)

            def soak(i=i, engine=engine, session=pooled):
                try:
                    runs[i] = run_soak(engine, session, FileSource(video, fps=args.fps, realtime=False, loops=loops),
                                       EveryKRounds(args.question_every, args.clip_seconds), log, rounds=rounds,
                                       duration_s=duration_s, sample_s=args.sample_s, device=args.device,
                                       label=f"{policy} stream {i + 1}", on_clip=on_clip,
                                       extra=lambda: {"tegrastats": teg.latest} if teg.latest else {})
                except BaseException as err:  # noqa: BLE001 (raised on the main thread)
                    errors.append(err)

            threads.append(threading.Thread(target=soak, name=f"soak-{i + 1}", daemon=True))
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)  # Ctrl-C reaches the main thread between joins
        except KeyboardInterrupt:
            for engine in engines:
                engine.stop.set()
            for thread in threads:
                thread.join(timeout=30)
            for run in runs:
                if run is not None:
                    run["stopped"] = "interrupted"
        finally:
            pool.close()
    if errors:
        raise errors[0]
    return [run for run in runs if run is not None]


def policy_options(policy: str, budget, window: int | None = None, bias: float | None = None) -> dict:
    """The policy's options, from the soak's own `--window` and `--bias`. Without a window, a policy that
    has a retrieval window keeps its default one but never more than a quarter of a token budget, the
    rule the benchmarks run by: at budget 64 the default window (64) would be the whole cache."""
    from inf_mllm.policies import window_cap  # loads torch: only once the arguments have been checked

    options = {k: v for k, v in (("bias", bias), ("window", window)) if v is not None}
    return options if window is not None else options | window_cap(policy, budget)


def records(run: dict, v: dict) -> list[dict]:
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
    try:
        seconds = parse_time(text)
    except QuestionError as err:
        raise ConfigError(f"--duration: cannot read {text!r} as a duration (use e.g. 90s, 30m, 2h)") from err
    if not seconds > 0:
        raise ConfigError(f"--duration must be positive, got {text!r}")
    return seconds


def check_soak_args(args) -> None:
    """Every number a soak takes, checked (one line each) before the model loads."""
    if (args.rounds is None) == (args.duration is None):
        raise ConfigError("give exactly one of --rounds N or --duration TIME")
    if args.rounds is not None and args.rounds < 2:
        raise ConfigError(f"--rounds must be at least 2, got {args.rounds}")
    check_options(args, tuple(n for n in option_names() if n not in ("policy", "budget")))
    if not (math.isfinite(args.sample_s) and args.sample_s >= 0):
        raise ConfigError(f"--sample-s must be a number of seconds ≥ 0 (0: every round), got {args.sample_s}")
    if args.question_every < 1:
        raise ConfigError("--question-every must be at least 1")
    if not 0 <= args.warmup < 1:
        raise ConfigError(f"--warmup is a fraction of the rounds in [0, 1), got {args.warmup}")
    check_budget(args.budget)
    if args.streams < 1:
        raise ConfigError(f"--streams must be at least 1, got {args.streams}")
    if args.streams > 1 and args.compare_full:
        raise ConfigError("--compare-full runs beside one stream: leave out --streams")


def run(args) -> int:
    check_soak_args(args)
    duration = parse_duration(args.duration) if args.duration else None
    video = Path(args.video) if args.video else bundled_clip("bikes.mp4")
    FileSource(video, fps=args.fps)  # a bad file fails here, before the model loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from models import load_adapter  # torch and transformers load only once the arguments are good

    adapter = load_adapter(args.model, device=args.device)
    budget = parse_budget(args.budget)  # the one grammar, read once (checked before the model loaded)
    if budget.auto:
        tokens, auto = auto_budget_for(adapter, args.max_new_tokens, args.device)
        print(f"soak: --budget auto: {tokens} tokens per layer ({auto.explain()})", file=sys.stderr)
        budget = parse_budget(tokens)
    budget = budget.tokens if budget.tokens is not None else str(budget)  # a number or its text: records, caps
    log_path = out / f"{args.name}.jsonl"
    runs, verdicts = [], []
    with open(log_path, "w") as log:
        for policy, b, cap, options in _plan(args, adapter, budget):
            done = _soak_policy(args, adapter, video, policy, b, cap, options, duration, log)
            for r in done:
                v = verdict(r, args)
                print(describe(v), flush=True)
                runs.append(r)
                verdicts.append(v)
            if any(r["stopped"] == "interrupted" for r in done):
                break
    recs = [rec for r, v in zip(runs, verdicts, strict=True) for rec in records(r, v)]
    write(out, args.name, recs, ["rss_mb", "kv_mb"], x_label="round")
    where = machine()  # each verdict says where it ran, as the records do
    (out / f"{args.name}_verdict.json").write_text(json.dumps([v | {"machine": where} for v in verdicts], indent=1)
                                                   + "\n")
    print(f"soak: {out / args.name}.json, .png, _verdict.json and {log_path.name} written", file=sys.stderr)
    main = [v for v in verdicts if v["passed"] is not None]  # every stream's; the capped comparison is not judged
    return 0 if main and all(v["passed"] for v in main) else 1


def _plan(args, adapter, budget) -> list[tuple]:
    """(policy, budget, memory cap, options) of each run: the soaked policy, then the capped full cache compared."""
    plan = [(args.policy, budget, None, policy_options(args.policy, budget, args.window, args.bias))]
    if args.compare_full:
        per_token = _bytes_per_token(adapter)
        tokens = budget if isinstance(budget, int) else None
        if tokens is None:
            raise ConfigError("--compare-full needs --budget in tokens")
        plan.append(("full", None, args.compare_full * tokens * per_token, {}))
    return plan


def _soak_policy(args, adapter, video, policy, budget, cap, options, duration, log) -> list[dict]:
    """One policy's soak (one stream, or `--streams` of them on one pool) under a progress bar of clips."""
    many = f"{args.streams} streams of " if args.streams > 1 else ""
    print(f"soak: {many}{policy}{' (capped)' if cap else ''} on {video.name}, "
          f"{args.rounds or ''}{' rounds' if args.rounds else args.duration}…", file=sys.stderr)
    bar = tqdm(total=args.rounds * args.streams if args.rounds else None, unit="clip", file=sys.stderr,
               desc="soak" if args.streams == 1 else f"soak, {args.streams} streams", disable=None)

    def step(clip):  # each clip turn of any stream
        bar.update(1)

    try:
        if args.streams > 1:
            return soak_streams(adapter, video, policy, budget, args.rounds, duration, args, log, options,
                                args.streams, on_clip=step)
        return [soak_one(adapter, video, policy, budget, args.rounds, duration, args, log, cap, options,
                         on_clip=step)]
    finally:
        bar.close()


def _bytes_per_token(adapter) -> int:
    import torch  # not at the top: this module stays torch-free until run() has checked the arguments

    from inf_mllm import KVShape

    shape = KVShape.from_config(adapter.model.config, torch.finfo(adapter.model.dtype).bits // 8)
    return shape.bytes_per_token_layer * shape.num_layers
