"""Latency and memory against stream length (paper Fig. 7), every policy at one budget.

The stream is fed in 512-token turns; at each checkpoint a few question rounds are timed: time to
first token (prefill + eviction), decode ms per token, the share of the round spent scoring and
evicting, KV MB and process RSS. Medians over the rounds; the full cache stops at the model's context.
"""

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model

from .common import RoundTimer, clip_to_context, median, plans, print_table, record, rss_mb, tokens_per_s, write
from .corpus import token_stream

FEED = 512
QUESTION = 32
ANSWER = 16


def measure(session, ids, pos, rounds):
    """Median timings of question rounds; the probe SDPA runs that price the scores are taken out."""
    ttft, decode, share, tps = [], [], [], []
    for r in range(rounds):
        q = ids[pos + r * QUESTION: pos + (r + 1) * QUESTION][None]
        timer = RoundTimer(session)
        session.append(q)
        ttft.append(timer.turn())
        tokens = list(session.generate(ANSWER, eos_token_id=[]))
        round_s = timer.lap()
        session.discard_pending()
        speed = tokens_per_s(len(tokens), session.last.decode_s - timer.lap_probe_s)
        tps.append(speed)
        decode.append(1e3 / speed if speed else float("nan"))
        share.append(timer.share(round_s))
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
    limit = model.config.max_position_embeddings
    todo = plans(args.policies, [budget], checkpoints[-1], limit)
    records = []
    with tqdm(total=sum(p.length for p in todo), unit="tok", desc="latency") as bar:
        for plan in todo:
            policy = plan.policy
            bar.set_postfix_str(policy)
            session = StreamSession(model, tok, policy, budget=plan.budget, **plan.cfg)
            session.cache.measure_overhead = True
            pos = 0
            for checkpoint in checkpoints:
                if policy == "full":  # the last point inside its context
                    checkpoint = clip_to_context(checkpoint, limit, reserve=rounds * (QUESTION + ANSWER))
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
