"""Latency and memory against stream length (paper Fig. 7), every policy at one budget.

The stream is fed in 512-token turns; at each checkpoint the session's state is kept (a copy of its
cache, on the same weights), and once every policy has streamed to its last checkpoint the question
rounds are timed round-robin over every (policy, checkpoint) state: time to first token (prefill +
eviction), decode ms per token, the share of the round spent scoring and evicting, KV MB and process
RSS. Medians over the rounds. Timing a checkpoint's rounds right after it is fed, as this benchmark
once did, put each stream length at a different moment of a shared machine's load: the 2K and 128K
rounds of one policy were minutes apart, and their ratio moved with whatever else ran (issue 23: a
1.23x TTFT rise of `inf_mllm` that interleaved rounds do not show). The full cache stops at the model's
context.
"""

import copy

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model
from inf_mllm.session import TurnStats

from .common import RoundTimer, clip_to_context, median, plans, print_table, record, rss_mb, tokens_per_s, write
from .corpus import token_stream

FEED = 512
QUESTION = 32
ANSWER = 16


def one_round(session, q) -> dict:
    """A question round: its time to first token, decode speed and eviction share; the probe SDPA runs that
    price the scores are taken out."""
    timer = RoundTimer(session)
    session.append(q)
    ttft = timer.turn()
    tokens = list(session.generate(ANSWER, eos_token_id=[]))
    round_s = timer.lap()
    session.discard_pending()
    speed = tokens_per_s(len(tokens), session.last.decode_s - timer.lap_probe_s)
    return {"ttft_s": ttft, "decode_ms_per_token": 1e3 / speed if speed else float("nan"),
            "evict_share": timer.share(round_s), "tokens_per_s": speed}


def snapshot(session):
    """The session as it stands at this point of the stream, on the same weights: its own copy of the cache."""
    clone = copy.copy(session)
    clone.cache = copy.deepcopy(session.cache)
    clone.last = TurnStats()
    return clone


def run(args):
    torch.manual_seed(0)
    model, tok = load_model()
    budget = 1024
    checkpoints = [1024, 4096] if args.quick else [2048, 8192, 32768, 131072]
    if args.tokens:
        checkpoints = [c for c in checkpoints if c <= args.tokens]
    rounds = 3 if args.quick else 9
    ids = token_stream(tok, checkpoints[-1] + rounds * QUESTION + FEED)
    limit = model.config.max_position_embeddings
    todo = plans(args.policies, [budget], checkpoints[-1], limit)
    states = []  # (policy, checkpoint, session state there, stream position)
    with tqdm(total=sum(p.length for p in todo), unit="tok", desc="latency: streaming") as bar:
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
                states.append((policy, checkpoint, snapshot(session), pos))
    timings = {(policy, checkpoint): [] for policy, checkpoint, _, _ in states}
    with tqdm(total=rounds * len(states), unit="round", desc="latency: rounds") as bar:
        for r in range(rounds):  # round-robin: every state sees the machine at the same moments
            for policy, checkpoint, session, pos in states:
                q = ids[pos + r * QUESTION: pos + (r + 1) * QUESTION][None]
                timings[policy, checkpoint].append(one_round(session, q))
                bar.update()
    records = []
    for policy, checkpoint, session, _ in states:
        rows = timings[policy, checkpoint]
        stats = {key: median([row[key] for row in rows]) for key in rows[0]}
        stats |= {"kv_tokens": session.kv_tokens, "kv_mb": session.kv_bytes / 2**20, "rss_mb": rss_mb()}
        records += [record("latency", policy, budget, k, v, checkpoint) for k, v in stats.items()]
    print_table(records, ["decode_ms_per_token", "ttft_s", "evict_share", "kv_mb", "rss_mb", "tokens_per_s"])
    write(args.out, "latency", records, ["decode_ms_per_token", "ttft_s", "kv_mb", "evict_share"], log_x=True)
