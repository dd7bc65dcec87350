"""What decode costs without this project's cache: transformers' own caches on the same random 7B model
(issue 23, item 2's reference). A dynamic cache run eagerly, and a static cache whose decode step
transformers compiles (torch.compile, CUDA graphs on a GPU), at one context length, beside the
bandwidth floor. The gap between the eager figure and `latency`'s tells what the streaming cache adds;
the gap to the compiled one what fixed shapes would win.
"""

import time

import torch

from . import shapes
from .common import print_table, record, write

CONTEXT = 2048
SHORT, LONG = 8, 72  # answer lengths: their time difference over LONG - SHORT tokens is decode alone


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


def run(args):
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
    print_table(records, ["decode_ms_per_token", "floor_ms_per_token", "decode_vs_floor"])
    write(args.out, f"compiled_decode_{shape}", records, [])
