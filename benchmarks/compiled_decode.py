"""Compiled decode (issue 23, item 2): the streaming cache's decode step run eagerly and compiled on fixed shapes
(`inf_mllm/compiled.py`), and transformers' own caches as the reference.

Ours: two sessions per policy (budget 1,024) on the same weights, streamed to the same point, one eager and one
with `compile_decode=True`; a first question round compiles (timed apart, with the memory it added), then
question rounds (a 32-token question, a 32-token answer) alternate between the two, so both see the same machine
load. Medians of decode ms per token (the compiling round left out), their ratio, and whether the two answered
the same tokens. On this CPU the real SmolLM2; with `--shape` a randomly initialised 7B model on `--device`.

The reference (`--shape` only): transformers' dynamic cache run eagerly and its static cache compiled by
`generate` (CUDA graphs on a GPU) at one context length, beside the bandwidth floor.
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


def streaming(model, tok, ids, policy: str, length: int, rounds: int) -> list[dict]:
    """Our cache's decode, eager against compiled, on one policy (see the module docstring)."""
    sessions = {path: StreamSession(model, tok, policy, budget=BUDGET, compile_decode=compiled)
                for path, compiled in PATHS.items()}
    for session in sessions.values():
        for start in range(0, length, FEED):
            session.append(ids[start:start + FEED][None])
    decode, answers = ({path: [] for path in PATHS} for _ in range(2))
    rss = psutil.Process().memory_info().rss
    for r in tqdm(range(rounds + 1), desc=f"compiled_decode: {policy}", unit="round"):
        q = ids[length + r * QUESTION: length + (r + 1) * QUESTION][None]
        for path, session in sessions.items():
            session.append(q)
            t0 = time.perf_counter()
            tokens = [int(t[0]) for t in session.generate(ANSWER, eos_token_id=[])]
            if r == 0 and path == "compiled":
                first_s, added = time.perf_counter() - t0, psutil.Process().memory_info().rss - rss
            answers[path].append(tokens)
            decode[path].append(1e3 / tokens_per_s(len(tokens), session.last.decode_s))
    timed = {path: values[1:] for path, values in decode.items()}  # round 0 compiled
    records = [record("compiled_decode", f"{policy}, {path}", BUDGET, "decode_ms_per_token", median(timed[path]),
                      length) for path in PATHS]
    eager, compiled = (median(timed[path]) for path in PATHS)
    return records + [
        record("compiled_decode", f"{policy}: speed-up (eager / compiled)", BUDGET, "ratio", eager / compiled, length),
        record("compiled_decode", f"{policy}: same answers", BUDGET, "rate",
               float(answers["eager"] == answers["compiled"]), length),
        # the model's compiled step is shared: only the first policy's first answer compiles
        record("compiled_decode", f"{policy}: first compiled answer", BUDGET, "first_answer_s", first_s, length),
        record("compiled_decode", f"{policy}: memory it added", BUDGET, "rss_mb", added / 2**20, length)]


def run(args):
    rounds = 4 if args.quick else 15
    length = 2048 if args.quick else 4096
    columns = ["decode_ms_per_token", "ratio", "rate", "first_answer_s", "rss_mb"]
    if not args.shape:  # this CPU: the real small model, ours only
        model, tok = load_model()
        ids = token_stream(tok, length + 2 * (rounds + 1) * QUESTION)
        records = []
        for policy in (args.policies or ["inf_mllm", "streaming_llm"]):
            records += streaming(model, tok, ids, policy, length, rounds)
        print_table(records, columns)
        write(args.out, "compiled_decode", records, [])
        return
    shape = args.shape or "vicuna-7b"
    model = shapes.build(shape, args.device)
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, model.config.vocab_size, (1, CONTEXT), device=args.device)
    floor = 1e3 * (shapes.weight_bytes_per_token(model) + CONTEXT * shapes.kv_bytes_per_token(model)) / \
        shapes.bandwidth(args.device)
    records = [record("compiled_decode", "floor", None, "floor_ms_per_token", floor, CONTEXT)]
    for name, options in VARIANTS.items():
        ms = decode_ms(model, ids, options)
        records += [record("compiled_decode", name, None, "decode_ms_per_token", ms, CONTEXT),
                    record("compiled_decode", name, None, "decode_vs_floor", ms / floor, CONTEXT)]
    ids = torch.randint(3, model.config.vocab_size, (length + 2 * (rounds + 1) * QUESTION,), device=args.device)
    for policy in (args.policies or ["inf_mllm", "streaming_llm"]):
        records += streaming(model, None, ids, policy, length, rounds)
    print_table(records, ["decode_ms_per_token", "floor_ms_per_token", "decode_vs_floor"] + columns)
    write(args.out, f"compiled_decode_{shape}", records, [])
