"""Streaming perplexity (paper Fig. 5): Gutenberg text fed in 64-token chunks, every policy, fixed budgets.

Each chunk is one turn: it is scored by the model over the current cache, then the cache evicts.
The full cache runs only up to the model's trained context (8K for SmolLM2).
"""

import math
import time

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model

from .common import median, policy_configs, print_table, record, write
from .corpus import token_stream

CHUNK = 64


def stream(model, tok, ids, policy, budget, cfg, segment, bar):
    session = StreamSession(model, tok, policy, budget=budget, **cfg)
    session.cache.measure_overhead = True
    nll, count, prev, shares = 0.0, 0, None, []
    evict_s = 0.0
    for start in range(0, ids.numel(), CHUNK):
        chunk = ids[start:start + CHUNK][None]
        t0 = time.perf_counter()
        logits = session.append(chunk)
        score_s, probe_s = session.cache.pop_score_time()
        round_s = time.perf_counter() - t0 - probe_s
        shares.append((session.last.evict_s + score_s) / round_s)
        evict_s += session.last.evict_s
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        targets = chunk[0]
        if prev is not None:
            nll -= float(prev[targets[0]])
            count += 1
        nll -= float(logp[:-1].gather(1, targets[1:, None]).sum())
        count += targets.numel() - 1
        prev = logp[-1]
        end = start + chunk.shape[1]
        if end % segment == 0:
            yield end, math.exp(nll / count), session.kv_tokens, median(shares)
            nll, count, shares = 0.0, 0, []
        bar.update(chunk.shape[1])


def run(args):
    model, tok = load_model()
    budgets = args.budgets or ([256, 1024] if args.quick else [256, 512, 1024])
    length = args.tokens or (4096 if args.quick else 65536)
    segment = 512 if args.quick else 1024
    full_len = min(length, 2048 if args.quick else model.config.max_position_embeddings)
    ids = token_stream(tok, length)
    records = []
    plans = [("full", None, {}, full_len)]
    for budget in budgets:
        plans += [(p, budget, cfg, length) for p, cfg in policy_configs(args.policies, budget).items() if p != "full"]
    if args.policies and "full" not in args.policies:
        plans = plans[1:]
    with tqdm(total=sum(p[3] for p in plans), unit="tok", desc="stream_ppl") as bar:
        for policy, budget, cfg, n in plans:
            bar.set_postfix_str(f"{policy}@{budget}")
            for i, (x, ppl, kv, share) in enumerate(stream(model, tok, ids[:n], policy, budget, cfg, segment, bar)):
                records += [record("stream_ppl", policy, budget, "ppl", ppl, x),
                            record("stream_ppl", policy, budget, "kv_tokens", kv, x),
                            record("stream_ppl", policy, budget, "evict_share", share, x)]
                if i % 64 == 63:  # long runs keep what they have measured if stopped
                    write(args.out, "stream_ppl", records, [])
            write(args.out, "stream_ppl", records, ["ppl"], log_x=True)
    summary = summarize(records, full_len)
    print_table(summary, ["ppl", "evict_share"])
    write(args.out, "stream_ppl", records + summary, ["ppl"], log_x=True)


def summarize(records, full_len):
    """Mean ppl over 0..full_len (the span the full cache covers) and over the whole stream."""
    out = []
    keys = {(r["policy"], r["budget"]) for r in records}
    for policy, budget in sorted(keys, key=str):
        ppl = [r for r in records if r["policy"] == policy and r["budget"] == budget and r["metric"] == "ppl"]
        share = [r["value"] for r in records if r["policy"] == policy and r["budget"] == budget
                 and r["metric"] == "evict_share"]
        head = [r["value"] for r in ppl if r["x"] <= full_len]
        out.append(record("stream_ppl", policy, budget, "ppl", sum(head) / len(head), f"0-{full_len}"))
        out.append(record("stream_ppl", policy, budget, "ppl", sum(r["value"] for r in ppl) / len(ppl), "all"))
        out.append(record("stream_ppl", policy, budget, "evict_share", median(share), "all"))
    return out
