"""Compiled decode (issue 23, item 2): the streaming cache's decode step run eagerly and compiled on fixed shapes
(`inf_mllm/compiled.py`), and transformers' own caches as the reference.

Ours: two sessions per policy (budget 1,024) on the same weights, streamed together, one eager and one with
`compile_decode=True`; at each measured length a first question round (it compiles, at the first length) is timed
apart with the memory it added, then question rounds (a 32-token question, a 32-token answer) alternate between
the two, so both see the same machine load. Medians of decode ms per token (the first round left out), their
ratio, the share of steps that ran compiled, and whether the two answered the same tokens (where they do not, how
many tokens the first differing answer shared, its context still the same in both). On this CPU the real SmolLM2
at one length; with `--shape` a randomly initialised 7B model on `--device`, at 2K, 8K, 32K and 128K streamed
tokens, each beside the bandwidth floor of the state's K/V. On a GPU the step times wait for its queued work:
a CUDA graph's replay returns before the GPU has run it.

The reference (`--shape` only, after ours): transformers' dynamic cache run eagerly and its static cache compiled
by `generate` (CUDA graphs on a GPU) at one context length, beside the bandwidth floor.
"""

import time

import psutil
import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model

from . import shapes
from .common import median, print_table, record, tokens_per_s, write
from .corpus import token_stream

CONTEXT = 2048
SHORT, LONG = 8, 72  # answer lengths: their time difference over LONG - SHORT tokens is decode alone
FEED, QUESTION, ANSWER, BUDGET = 512, 32, 32, 1024
PATHS = {"eager": False, "compiled": True}
PLOTTED = ["decode_ms_per_token", "decode_vs_floor"]  # with --shape: ours by streamed length, the reference at CONTEXT


VARIANTS = {"transformers_dynamic": {"cache_implementation": "dynamic"},
            "transformers_static": {"cache_implementation": "static", "disable_compile": True},
            "transformers_static_compiled": {"cache_implementation": "static"}}  # compiled by generate on a GPU


def decode_ms(model, ids, options: dict) -> float:
    def timed(n):
        shapes.sync(ids.device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **options)
        shapes.sync(ids.device)
        return time.perf_counter() - t0

    timed(SHORT), timed(LONG)  # warm-up (compiles the static cache's step)
    short = sorted(timed(SHORT) for _ in range(3))[1]
    long = sorted(timed(LONG) for _ in range(3))[1]
    return 1e3 * (long - short) / (LONG - SHORT)


def streaming(model, tok, ids, policy: str, lengths: list[int], rounds: int, floor=None) -> list[dict]:
    """Our cache's decode, eager against compiled, on one policy (see the module docstring), at each of `lengths`
    streamed tokens in turn. `ids` holds the stream, then the questions; `floor(kv_tokens)` the bandwidth floor."""
    sessions = {path: StreamSession(model, tok, policy, budget=BUDGET, compile_decode=compiled)
                for path, compiled in PATHS.items()}
    for session in sessions.values():  # on a GPU the step times wait for its queued work (CUDA graphs replay async)
        session.cache.timing.measure = ids.is_cuda
        session.cache.reserve(max(FEED, QUESTION) + 1 + ANSWER)  # one buffer shape at every length: one graph
    questions = ids[len(ids) - (rounds + 1) * QUESTION:]
    compiled = sessions["compiled"]._compiled
    records, fed, alike = [], 0, True
    for length in lengths:
        for session in sessions.values():
            for start in range(fed, length, FEED):
                session.append(ids[start:min(start + FEED, length)][None])
        fed = length
        decode, answers = ({path: [] for path in PATHS} for _ in range(2))
        rss, steps = psutil.Process().memory_info().rss, compiled.steps
        for r in tqdm(range(rounds + 1), desc=f"compiled_decode: {policy} at {length}", unit="round"):
            q = questions[r * QUESTION:(r + 1) * QUESTION][None]
            for path, session in sessions.items():
                session.append(q)
                t0 = time.perf_counter()
                tokens = [int(t[0]) for t in session.generate(ANSWER, eos_token_id=[])]
                if r == 0 and path == "compiled":
                    first_s, added = time.perf_counter() - t0, psutil.Process().memory_info().rss - rss
                answers[path].append(tokens)
                decode[path].append(1e3 / tokens_per_s(len(tokens), session.last.decode_s))
        timed = {path: values[1:] for path, values in decode.items()}  # round 0 may compile
        eager, fast = (median(timed[path]) for path in PATHS)
        tqdm.write(f"{policy} at {length}: decode {eager:.2f} ms/token eager, {fast:.2f} compiled; "
                   f"{compiled.steps - steps} steps compiled")  # in the log even if the run is cut short
        records += [record("compiled_decode", f"{policy}, {path}", BUDGET, "decode_ms_per_token", median(timed[path]),
                           length) for path in PATHS]
        records += [
            record("compiled_decode", f"{policy}: speed-up (eager / compiled)", BUDGET, "ratio", eager / fast, length),
            record("compiled_decode", f"{policy}: same answers", BUDGET, "rate",
                   float(answers["eager"] == answers["compiled"]), length),
            # every step after an answer's first token, unless the step fell back to eager
            record("compiled_decode", f"{policy}: steps run compiled", BUDGET, "rate",
                   (compiled.steps - steps) / ((rounds + 1) * (ANSWER - 1)), length),
            # the model's compiled step is shared: only the first policy's first answer compiles
            record("compiled_decode", f"{policy}: first compiled answer", BUDGET, "first_answer_s", first_s, length),
            record("compiled_decode", f"{policy}: memory it added", BUDGET, "rss_mb", added / 2**20, length)]
        differ = [(a, b) for a, b in zip(answers["eager"], answers["compiled"], strict=True) if a != b]
        if alike and differ:  # the first answer that differs, both sessions' contexts still alike before it
            alike = False
            # a broken step differs at the answer's second token (the first comes from the prefill, eager in both);
            # fp16 rounding anywhere two logits nearly tie
            records.append(record("compiled_decode", f"{policy}: first differing answer, tokens alike before",
                                  BUDGET, "rate", _agreeing(*differ[0]) / ANSWER, length))
        if floor is not None:
            kv = sessions["compiled"].cache.get_seq_length()
            records += [record("compiled_decode", f"{policy}, {path}", BUDGET, "decode_vs_floor",
                               median(timed[path]) / floor(kv), length) for path in PATHS]
            records.append(record("compiled_decode", f"{policy}: floor", BUDGET, "floor_ms_per_token", floor(kv),
                                  length))
    return records


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(args):
    rounds = 4 if args.quick else 15
    columns = ["decode_ms_per_token", "ratio", "rate", "first_answer_s", "rss_mb"]
    policies = args.policies or ["inf_mllm", "streaming_llm"]
    if not args.shape:  # this CPU: the real small model, ours only
        model, tok = load_model()
        length = 2048 if args.quick else 4096
        ids = token_stream(tok, length + (rounds + 1) * QUESTION)
        records = []
        for policy in policies:
            records += streaming(model, tok, ids, policy, [length], rounds)
        print_table(records, columns)
        write(args.out, "compiled_decode", records, [])
        return
    shape, name = args.shape, f"compiled_decode_{args.shape}"
    model = shapes.build(shape, args.device)
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = 0
    bw, weights, per_token = (shapes.bandwidth(args.device), shapes.weight_bytes_per_token(model),
                              shapes.kv_bytes_per_token(model))
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU"
    print(f"{name}: {device}, memory bandwidth {bw / 1e9:.0f} GB/s (read + written)")

    def floor(kv_tokens: int) -> float:
        return 1e3 * (weights + kv_tokens * per_token) / bw

    # ours first (streamed to each length, 7B turns at GPU speed), written before the reference runs
    rounds = 4 if args.quick else 9
    lengths = [1024, 2048] if args.quick else [2048, 8192, 32768, 131072]
    ids = torch.randint(3, model.config.vocab_size, (lengths[-1] + (rounds + 1) * QUESTION,), device=args.device)
    records = []
    for policy in policies:
        records += streaming(model, None, ids, policy, lengths, rounds, floor)
        write(args.out, name, records, [])
    model.set_attn_implementation("sdpa")  # the sessions registered the observing attention
    ids = torch.randint(3, model.config.vocab_size, (1, CONTEXT), device=args.device)
    records.append(record("compiled_decode", "floor", None, "floor_ms_per_token", floor(CONTEXT), CONTEXT))
    for variant, options in VARIANTS.items():
        ms = decode_ms(model, ids, options)
        records += [record("compiled_decode", variant, None, "decode_ms_per_token", ms, CONTEXT),
                    record("compiled_decode", variant, None, "decode_vs_floor", ms / floor(CONTEXT), CONTEXT)]
        write(args.out, name, records, [])
    write(args.out, name, records, PLOTTED, log_x=True)
    print_table(records, ["decode_ms_per_token", "floor_ms_per_token", "decode_vs_floor"] + columns)
