"""Many streams on one model (issue 46): the session pool against the same streams run one after another through one
lock, as the app served them before it, in the same run.

decode: SmolLM2-135M (fp32), `inf_mllm` at budget 1,024, N = 1, 2, 4, 8 streams, each its own session filled past its
budget with its own stretch of the Gutenberg corpus. Every round all N streams ask at once (a plain question, then 32
answer tokens, no end token). Pool: one thread per stream on a `SessionPool` (questions prefilled together, decode steps
batched in one eager forward). Pool, slot step: the same with the pool's decode steps in its slot arena (slots.py, run
as is; `stream-qa`'s choice for several sources). Lock: the same questions answered one stream after another on lone
sessions. Each mode has its own copies of the same streams; the modes take turns round by round, which goes first
turning, so a machine whose speed drifts during the run slows all alike. Per mode and N: aggregate decode tokens/s
(tokens after each stream's first, over the time from the last first token to the last token; for the lock, over the
sum of the streams' decode times), time to first token p50/p95 over every stream and round (from the moment all
asked), the decode step beside its bandwidth floor ((weights + N x the streams' KV bytes) / the read bandwidth measured
here), and memory per stream. For N > 1 each round also has each pool's first stream ask alone (the others
idle): the one stream its ratios are taken against, measured in the same rounds as the N (a machine whose speed drifts
between one N and the next moved the ratios of an earlier run by a fifth).

ingest: tiny-vlm, 4 streams of the bundled clip (looped to a minute) played at real time at 1 fps through the turn
engine on one pool, each asking a plain question every 10 s of video: each stream's ingest speed (x real time),
clips dropped, answers and their median time to first token.

--shape (a GPU, issue 46 item 2): a randomly initialised 7B model (fp16) on `--device`, N = 1, 2, 4, 8, 16, 32
streams in a pool whose decode steps run in its slot arena (inf_mllm/slots.py), compiled, the arena sized to N; each
stream filled past budget 1,024 with random ids, then rounds in which all N ask at once (32 tokens) and answer 32.
The first round compiles and is left out. Per N: the slot step's median time (the GPU waited for) beside its
bandwidth floor ((weights + N x the streams' K/V) / the copy bandwidth measured here), aggregate decode tokens/s end
to end (every thread taking its tokens), its ratio to one stream's, time to first token p50/p95, and GPU memory
(allocated, after each round: flat, and against weights + N x the per-stream bound).
"""

import gc
import os
import statistics
import threading
import time

import torch
from tqdm import tqdm

from inf_mllm import linear
from inf_mllm.loader import load_model
from inf_mllm.pool import SessionPool
from inf_mllm.session import StreamSession

from . import shapes
from .common import print_table, record, write
from .corpus import token_stream

BUDGET = 1024
FILL = 1200  # tokens streamed into each session before it is asked: past the budget, so eviction has run
ANSWER = 32
LOOPS = 6  # the bundled clip (10 s) played 6 times: a minute of video per stream, a question every 10 s
QUESTIONS_SEEN = ["what is on screen?", "is there a bicycle now?", "did you see a person?", "what was on screen at "
                  "the start?", "is there a car?"]
SLOTTED = "pool, slot step"
MODES = ["lock", "pool", SLOTTED]
ONE = " (one stream asking)"  # a pool's first stream asking alone, in the same rounds: the ratios' one stream
QUESTIONS = ["What did the last lines say about the garden?", "Who was speaking just now?",
             "Summarise the passage in a few words.", "What happened before the storm?"]


def run(args):
    if args.shape:
        return run_shape(args)
    counts = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    rounds = 2 if args.quick else 6
    model, tok = load_model()
    bandwidth = read_bandwidth()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    linear.as_chosen(model)  # INF_MLLM_LINEAR=onednn: the same bytes read, by oneDNN's products
    records = []
    for n in tqdm(counts, desc="streams"):
        for mode, result in decode_rounds(model, tok, n, rounds).items():
            floor_ms = (weights + (1 if mode.endswith(ONE) else n) * result["kv_bytes"]) / bandwidth * 1e3
            for metric, value in [("tokens_per_s", result["aggregate"]),
                                  ("ttft_s", result["ttft_p50"]), ("ttft_p95_s", result["ttft_p95"]),
                                  ("decode_ms_per_token", result["step_ms"]), ("floor_ms_per_token", floor_ms),
                                  ("decode_vs_floor", result["step_ms"] / floor_ms),
                                  ("kv_mb", result["kv_bytes"] / 2**20),
                                  ("bound_mb", result["bound"] / 2**20)]:
                records.append(record("streams", mode, BUDGET, metric, round(value, 4), n))
    for mode in MODES[1:]:  # ratios within each N's rounds: each pool against one of its streams asking alone, and
        for n in counts:  # against the lock
            alone = mode + ONE if n > 1 else mode
            one, one_ttft = _value(records, alone, n, "tokens_per_s"), _value(records, alone, n, "ttft_p95_s")
            tokens = _value(records, mode, n, "tokens_per_s")
            records += [record("streams", f"{mode}: tokens/s vs one stream", BUDGET, "ratio", round(tokens / one, 3),
                               n),
                        record("streams", f"{mode}: ttft p95 vs one stream", BUDGET, "ratio",
                               round(_value(records, mode, n, "ttft_p95_s") / one_ttft, 3), n),
                        record("streams", f"{mode}: tokens/s vs lock", BUDGET, "ratio",
                               round(tokens / _value(records, "lock", n, "tokens_per_s"), 3), n)]
    records.append(record("streams", "memory", None, "read_gb_s", round(bandwidth / 1e9, 2), 0))
    if not args.quick:
        records += ingest(streams=4)
    print_table(records, sorted({r["metric"] for r in records}))
    write(args.out, "streams", records, ["tokens_per_s", "ttft_p95_s"], x_label="streams")


def run_shape(args):
    """The slot step on a 7B shape (the module docstring)."""
    counts = [1, 2, 4] if args.quick else [int(n) for n in os.environ.get("STREAMS", "1,2,4,8,16,32").split(",")]
    rounds = args.rounds or (2 if args.quick else 3)
    model = shapes.build(args.shape, args.device)
    model.generation_config.eos_token_id = None
    bandwidth, weights = shapes.bandwidth(args.device), shapes.weight_bytes_per_token(model)
    per_token = shapes.kv_bytes_per_token(model)
    name, records = f"streams_{args.shape}", []
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU"
    print(f"{name}: {device}, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for n in counts:
        result = slot_round(model, n, rounds, args.device, os.environ.get("COMPILE_MODE"))
        floor_ms = (weights + n * result["kv_tokens"] * per_token) / bandwidth * 1e3
        for metric, value in [("tokens_per_s", result["aggregate"]), ("ttft_s", result["ttft_p50"]),
                              ("ttft_p95_s", result["ttft_p95"]), ("decode_ms_per_token", result["step_ms"]),
                              ("floor_ms_per_token", floor_ms), ("decode_vs_floor", result["step_ms"] / floor_ms),
                              ("round_ms", result["token_ms"]), ("first_answer_s", result["first_s"]),
                              ("gpu_mb", result["gpu_mb"]), ("bound_mb", result["bound"] / 2**20),
                              ("rss_slope_mb_per_round", result["gpu_slope_mb"])]:
            records.append(record("streams", "pool, slot step compiled", BUDGET, metric, round(value, 4), n))
        # the weights and what the pool added since it opened, against the weights and N streams at their bound
        records.append(record("streams", "GPU memory vs weights + N x bound", BUDGET, "ratio", round(
            result["gpu_mb"] * 2**20 / (shapes.weight_bytes(model) + n * result["bound"]), 3), n))
        write(args.out, name, records, [])  # after each N: a run cut short keeps what it measured
        print(f"{name}: {n} streams: step {result['step_ms']:.2f} ms = {result['step_ms'] / floor_ms:.2f}x floor, "
              f"{result['aggregate']:.0f} tokens/s, compile {result['first_s']:.0f} s", flush=True)
    if 1 in counts:
        one = _value(records, "pool, slot step compiled", 1, "tokens_per_s")
        records += [record("streams", "pool tokens/s vs one stream", BUDGET, "ratio",
                           round(_value(records, "pool, slot step compiled", n, "tokens_per_s") / one, 3), n)
                    for n in counts]
    records.append(record("streams", "memory", None, "read_gb_s", round(bandwidth / 1e9, 2), 0))
    write(args.out, name, records, ["decode_vs_floor", "tokens_per_s"], x_label="streams")
    print_table(records, sorted({r["metric"] for r in records}))


def slot_round(model, n: int, rounds: int, device: str, mode: str | None) -> dict:
    torch.manual_seed(n)
    gc.collect()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if cuda else 0
    weights = shapes.weight_bytes(model)
    pool = SessionPool(model, None, slots=n, compile_decode=True, compile_mode=mode)
    pool.slot_decode.timings = []
    streams = []
    for _ in range(n):
        session = StreamSession(model, None, "inf_mllm", budget=BUDGET)
        session.cache.reserve(64 + ANSWER)
        for _ in range(0, FILL, 200):
            session.append(torch.randint(3, model.config.vocab_size, (1, 200), device=device))
        streams.append(pool.admit(session))
    bound = pool.admission.bound(streams[0].session)
    ttfts, steps, tokens, memory = [], [], [], []
    for r in range(rounds + 1):
        asks = [torch.randint(3, model.config.vocab_size, (1, 32), device=device) for _ in range(n)]
        pool.slot_decode.timings.clear()
        t0 = time.perf_counter()
        firsts, lasts = ask_together(streams, asks, together=True)
        if r == 0:
            first_s = time.perf_counter() - t0  # the compile
            continue
        shapes.sync(device)
        memory.append((torch.cuda.memory_allocated() - before + weights) / 2**20 if cuda else 0.0)
        ttfts += firsts
        steps += pool.slot_decode.timings
        tokens.append((max(lasts) - max(firsts)) / (ANSWER - 1) * 1e3)
    slotted = pool.slot_decode.rows_advanced
    kv_tokens = statistics.mean(s.kv_tokens for s in streams)
    if os.environ.get("PROFILE"):
        profile_step(pool.slot_decode, device)
    pool.close()
    if not slotted or pool.slot_decode.failed:
        raise RuntimeError(f"the slot step did not run: {pool.slot_decode.failed}")
    return {"aggregate": n * 1e3 / statistics.median(tokens), "ttft_p50": statistics.median(ttfts),
            "ttft_p95": p95(ttfts),
            "step_ms": statistics.median(steps) * 1e3, "token_ms": statistics.median(tokens), "first_s": first_s,
            "gpu_mb": max(memory), "gpu_slope_mb": (memory[-1] - memory[0]) / max(1, len(memory) - 1),
            "bound": bound, "kv_tokens": kv_tokens}


def profile_step(step, device) -> None:
    """Where a slot step's time goes (PROFILE=1, a GPU): 20 replays back to back (no host work between them), then
    the device's kernels over 5 replays by time. The caches' rows past their ends are written and dropped."""
    from torch.profiler import ProfilerActivity, profile

    def replays(k):
        for _ in range(k):
            step._forward(step.tokens)

    with torch.inference_mode():
        replays(3)
        shapes.sync(device)
        t0 = time.perf_counter()
        replays(20)
        shapes.sync(device)
        print(f"profile: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms a replay, back to back", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            replays(5)
            shapes.sync(device)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60),
          flush=True)


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _value(records, policy, n, metric):
    return next(r["value"] for r in records if r["policy"] == policy and r["x"] == n and r["metric"] == metric)


def read_bandwidth() -> float:
    """Bytes per second a sum over 512 MB reads, median of 5: the floor a decode step's weight reads meet."""
    x = torch.ones(2**27)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(times[1:])


def filled_sessions(model, tok, n: int) -> list[StreamSession]:
    ids = token_stream(tok, FILL * n)
    sessions = []
    for i in range(n):
        session = StreamSession(model, tok, "inf_mllm", budget=BUDGET)
        session.cache.reserve(64 + ANSWER)
        own = ids[i * FILL:(i + 1) * FILL][None]
        for start in range(0, FILL, 200):
            session.append(own[:, start:start + 200])
        sessions.append(session)
    return sessions


def decode_rounds(model, tok, n: int, rounds: int) -> dict[str, dict]:
    """The same N streams' rounds through the lock, through the pool (its decode steps one eager batched forward),
    and through the pool with its slot step (the steps on fixed shapes, slots.py, run as is), the modes turning
    round by round (which goes first turning too), so a machine whose speed drifts over the run slows all alike."""
    sessions = {mode: filled_sessions(model, tok, n) for mode in MODES}
    pools = {"pool": SessionPool(model, tok), SLOTTED: SessionPool(model, tok, slots=n)}
    streams = {"lock": sessions["lock"], **{mode: [pool.admit(s) for s in sessions[mode]]
                                            for mode, pool in pools.items()}}
    order = MODES + ([mode + ONE for mode in pools] if n > 1 else [])
    seen = {mode: {"ttfts": [], "tokens": 0, "decode_s": 0.0, "steps": []} for mode in order}
    for r in range(rounds):
        asks = [tok(QUESTIONS[(i + r) % len(QUESTIONS)], return_tensors="pt").input_ids for i in range(n)]
        for mode in order[r % len(order):] + order[:r % len(order)]:
            base, k = mode.removesuffix(ONE), 1 if mode.endswith(ONE) else n
            firsts, lasts = ask_together(streams[base][:k], asks[:k], together=base != "lock")
            if base != "lock":
                span = max(lasts) - max(firsts)
            else:
                span = sum(last - first for first, last in zip(firsts, lasts, strict=True))
            own = seen[mode]
            own["ttfts"] += firsts
            own["tokens"] += k * (ANSWER - 1)
            own["decode_s"] += span
            own["steps"].append(span / (ANSWER - 1) * 1e3)  # pool: one batched step per answer token
    bounds = {"lock": 0, **{mode: pool.admission.bound(sessions[mode][0]) for mode, pool in pools.items()}}
    bounds.update({mode + ONE: bounds[mode] for mode in pools})
    if not pools[SLOTTED].slot_decode.rows_advanced or pools[SLOTTED].slot_decode.failed:
        raise RuntimeError(f"the slot step did not run: {pools[SLOTTED].slot_decode.failed}")
    for pool in pools.values():
        pool.close()
    steps = {"lock": seen["lock"]["decode_s"] / seen["lock"]["tokens"] * 1e3,  # per token, one stream at a time
             **{mode: statistics.median(own["steps"]) for mode, own in seen.items() if mode != "lock"}}
    return {mode: {"aggregate": own["tokens"] / own["decode_s"], "ttft_p50": statistics.median(own["ttfts"]),
                   "ttft_p95": p95(own["ttfts"]), "step_ms": steps[mode],
                   "kv_bytes": statistics.mean(s.kv_bytes for s in sessions[mode.removesuffix(ONE)]),
                   "bound": bounds[mode]}
            for mode, own in seen.items()}


def ask_together(streams, asks, together: bool) -> tuple[list[float], list[float]]:
    """Each stream's time to its first and its last answer token, from the moment all asked (at once on threads, or
    one after another)."""
    n = len(streams)
    firsts, lasts = [0.0] * n, [0.0] * n
    t0 = time.perf_counter()

    def answer(i):
        streams[i].append_question(asks[i])
        for k, _ in enumerate(streams[i].generate(ANSWER, eos_token_id=[])):
            if k == 0:
                firsts[i] = time.perf_counter() - t0
        lasts[i] = time.perf_counter() - t0

    if not together:
        for i in range(n):
            answer(i)
        return firsts, lasts
    threads = [threading.Thread(target=answer, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return firsts, lasts


def ingest(streams: int) -> list[dict]:
    """4 streams of the bundled clip at real time through the engine on one pool, a question every 10 s each."""
    from models import load_adapter
    from streaming import budgets
    from streaming.engine import TurnEngine
    from streaming.questions import Question, Schedule
    from streaming.sources import FileSource, bundled_clip

    vlm = load_adapter("tiny-vlm")
    pool = SessionPool(vlm.model, vlm.tokenizer, slots=streams)  # as stream-qa's streams
    engines, results = [], [None] * streams
    for _ in range(streams):
        session = pool.call(None, vlm.new_session, "inf_mllm", budget=512)
        session.cache.reserve(budgets.headroom(vlm, 16))
        engines.append(TurnEngine(vlm, pool.admit(session), drop_when_full=True))
    duration = FileSource(bundled_clip()).duration * LOOPS

    def play(i):
        source = FileSource(bundled_clip(), fps=1.0, realtime=True, loops=LOOPS)
        schedule = Schedule([Question(QUESTIONS_SEEN[(i + k) % len(QUESTIONS_SEEN)], at=float(t))
                             for k, t in enumerate(range(10, int(duration), 10))])
        answers = list(engines[i].run(source, schedule))
        results[i] = (engines[i].telemetry, answers)

    threads = [threading.Thread(target=play, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    pool.close()
    out = []
    for i, (telemetry, answers) in enumerate(results):
        for metric, value in [("ingest_speed", telemetry.ingest_speed), ("clips", telemetry.clips),
                              ("dropped", telemetry.dropped), ("answers", len(answers)),
                              ("ttft_s", statistics.median(a.ttft_s for a in answers) if answers else 0.0),
                              ("video_s", telemetry.video_s), ("wall_s", wall)]:
            out.append(record("streams_ingest", f"stream {i + 1}", 512, metric, round(value, 4), streams))
    return out
