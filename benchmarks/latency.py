"""Latency and memory against stream length (paper Fig. 7), every policy at one budget.

The stream is fed in 512-token turns; at each checkpoint a few question rounds are timed: time to
first token (prefill + eviction), decode ms per token, the share of the round spent scoring and
evicting, KV MB and process RSS. Medians over the rounds; the full cache stops at the model's context.
"""

import time

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model

from .common import median, policy_configs, print_table, record, rss_mb, write
from .corpus import token_stream

FEED = 512
QUESTION = 32
ANSWER = 16


def measure(session, ids, pos, rounds):
    """Median timings of question rounds; the probe SDPA runs that price the scores are taken out."""
    ttft, decode, share, tps = [], [], [], []
    for r in range(rounds):
        q = ids[pos + r * QUESTION: pos + (r + 1) * QUESTION][None]
        session.cache.pop_score_time()
        t0 = time.perf_counter()
        session.append(q)
        score_1, probe_1 = session.cache.pop_score_time()
        first = time.perf_counter() - t0 - probe_1
        tokens = list(session.generate(ANSWER, eos_token_id=[]))
        score_2, probe_2 = session.cache.pop_score_time()
        round_s = time.perf_counter() - t0 - probe_1 - probe_2
        session.discard_pending()
        decode_s = session.last.decode_s - probe_2
        ttft.append(first)
        decode.append(decode_s / (len(tokens) - 1) * 1e3)
        tps.append((len(tokens) - 1) / decode_s)
        share.append((session.last.evict_s + score_1 + score_2) / round_s)
    return {"ttft_s": median(ttft), "decode_ms_per_token": median(decode), "evict_share": median(share),
            "tokens_per_s": median(tps), "kv_tokens": session.kv_tokens, "kv_mb": session.kv_bytes / 2**20,
            "rss_mb": rss_mb()}


def run(args):
    torch.manual_seed(0)
    model, tok = load_model()
    budget = 1024
    checkpoints = [1024, 4096] if args.quick else [2048, 8192, 32768, 131072]
    if args.tokens:
        checkpoints = [c for c in checkpoints if c <= args.tokens]
    rounds = 3 if args.quick else 5
    ids = token_stream(tok, checkpoints[-1] + rounds * QUESTION + FEED)
    plans = [(p, budget, cfg) for p, cfg in policy_configs(args.policies, budget).items()]
    limit = model.config.max_position_embeddings
    records = []
    total = sum(min(checkpoints[-1], limit) if p == "full" else checkpoints[-1] for p, _, _ in plans)
    with tqdm(total=total, unit="tok", desc="latency") as bar:
        for policy, budget_p, cfg in plans:
            bar.set_postfix_str(policy)
            session = StreamSession(model, tok, policy, budget=None if policy == "full" else budget_p, **cfg)
            session.cache.measure_overhead = True
            pos = 0
            for checkpoint in checkpoints:
                if policy == "full" and checkpoint + rounds * (QUESTION + ANSWER) > limit:
                    checkpoint = limit - rounds * (QUESTION + ANSWER)  # the last point inside its context
                    if checkpoint <= pos:
                        break
                while pos < checkpoint:
                    step = min(FEED, checkpoint - pos)
                    session.append(ids[pos:pos + step][None])
                    pos += step
                    bar.update(step)
                stats = measure(session, ids, pos, rounds)
                records += [record("latency", policy, budget, k, v, checkpoint) for k, v in stats.items()]
            write(args.out, "latency", records, ["decode_ms_per_token", "ttft_s", "kv_mb", "evict_share"], log_x=True)
    print_table(records, ["decode_ms_per_token", "ttft_s", "evict_share", "kv_mb", "rss_mb", "tokens_per_s"])
    write(args.out, "latency", records, ["decode_ms_per_token", "ttft_s", "kv_mb", "evict_share"], log_x=True)
