"""Latency and memory against stream length (paper Fig. 7), every policy at one budget.

The stream is fed in 512-token turns; at each checkpoint the session's state is kept (a copy of its
cache, on the same weights), and once every policy has streamed to its last checkpoint the question
rounds are timed, each round visiting every (policy, checkpoint) state once, in an order of its own:
time to first token (prefill + eviction), decode ms per token, the share of the round spent scoring and
evicting, KV MB and process RSS. Medians over the rounds. Timing a checkpoint's rounds right after it is
fed, as this benchmark once did, put each stream length at a different moment of a shared machine's
load: the 2K and 128K rounds of one policy were minutes apart, and their ratio moved with whatever else
ran (issue 23: a 1.23x TTFT rise of `inf_mllm` that interleaved rounds do not show). The full cache stops
at the model's context (or where the device runs out of memory). After the question rounds, a clip turn's time to first
token (112 visual tokens and 16 of text, Chat-UniVi's event) is timed the same way.

`--shape vicuna-7b` / `llama-2-7b-32k` (benchmarks/shapes.py) times randomly initialised 7B models in fp16
on `--device` (a GPU: streams go on to 1M tokens), beside the floor set by the device's memory bandwidth,
and the GPU memory each state needs alone: the weights, its own K/V and its round's peak working memory.
"""

import copy
import random
import time

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model
from inf_mllm.session import TurnStats

from . import shapes
from .common import RoundTimer, clip_to_context, median, plans, print_table, record, rss_mb, tokens_per_s, write
from .corpus import token_stream

FEED = 512
QUESTION = 32
ANSWER = 16
CLIP = 112 + 16  # a Chat-UniVi event's visual tokens and its turn's text
MB = 2**20


def one_round(session, q, clock) -> dict:
    """A question round: its time to first token, decode speed and eviction share; the probe SDPA runs that
    price the scores are taken out."""
    timer = RoundTimer(session, clock)
    session.append(q)
    ttft = timer.turn()
    tokens = list(session.generate(ANSWER, eos_token_id=[]))
    round_s = timer.lap()
    session.discard_pending()
    speed = tokens_per_s(len(tokens), session.last.decode_s - timer.lap_probe_s)
    return {"ttft_s": ttft, "decode_ms_per_token": 1e3 / speed if speed else float("nan"),
            "evict_share": timer.share(round_s), "tokens_per_s": speed}


def clip_round(session, clip, clock) -> dict:
    """A clip turn's time to first token: its prefill and the eviction after it."""
    timer = RoundTimer(session, clock)
    session.append(clip)
    return {"clip_ttft_s": timer.turn()}


def load(shape: str | None, device: str):
    """(model, tokenizer or None): SmolLM2's real weights, or a random model of `shape` in fp16."""
    return load_model(device=device) if shape is None else (shapes.build(shape, device), None)


def stream(tok, model, length: int) -> torch.Tensor:
    """The corpus as tokens for a real tokenizer; random ids for a random model (its speed is the same)."""
    if tok is not None:
        return token_stream(tok, length)
    return torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))


class Memory:
    """The GPU memory one state needs alone, though every state is held at once: the weights, its own K/V
    and the peak its rounds allocate beyond what was allocated before them."""

    def __init__(self, model, device):
        self.cuda = torch.device(device).type == "cuda"
        self.weights = shapes.weight_bytes(model)
        self.working: dict = {}

    def before(self) -> None:
        if self.cuda:
            shapes.sync("cuda")
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()

    def after(self, key) -> None:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() - self._base
            self.working[key] = max(self.working.get(key, 0), peak)

    def stats(self, key, kv_bytes: int) -> dict:
        if not self.cuda:
            return {}
        return {"gpu_mb": (self.weights + kv_bytes + self.working.get(key, 0)) / MB}


def snapshot(session):
    """The session as it stands at this point of the stream, on the same weights: its own copy of the cache."""
    clone = copy.copy(session)
    clone.cache = copy.deepcopy(session.cache)
    clone.last = TurnStats()
    return clone


def checkpoints_for(args, cuda: bool) -> list[int]:
    if args.quick:
        points = [1024, 4096]
    else:
        points = [2048, 8192, 32768, 131072] + ([1048576] if cuda else [])
    return [c for c in points if c <= args.tokens] if args.tokens else points


def run(args):
    torch.manual_seed(0)
    device = args.device
    cuda = torch.device(device).type == "cuda"
    model, tok = load(args.shape, device)
    budget = 1024
    checkpoints = checkpoints_for(args, cuda)
    rounds = args.rounds or (3 if args.quick else 9)
    ids = stream(tok, model, checkpoints[-1] + rounds * (QUESTION + CLIP) + FEED).to(device)
    limit = model.config.max_position_embeddings
    memory = Memory(model, device)

    def clock():  # the time after the GPU's queued work
        shapes.sync(device)
        return time.perf_counter()

    todo = plans(args.policies, [budget], checkpoints[-1], limit)
    states = []  # (policy, checkpoint, session state there, stream position)
    with tqdm(total=sum(p.length for p in todo), unit="tok", desc="latency: streaming") as bar:
        for plan in todo:
            policy = plan.policy
            bar.set_postfix_str(policy)
            session = StreamSession(model, tok, policy, budget=plan.budget, **plan.cfg)
            session.cache.timing.measure = True
            pos = 0
            for checkpoint in checkpoints:
                if policy == "full":  # the last point inside its context
                    checkpoint = clip_to_context(checkpoint, limit, reserve=rounds * (QUESTION + ANSWER + CLIP))
                    if checkpoint <= pos:
                        break
                try:
                    while pos < checkpoint:
                        step = min(FEED, checkpoint - pos)
                        session.append(ids[pos:pos + step][None])
                        pos += step
                        bar.update(step)
                except torch.OutOfMemoryError:  # the full cache on a GPU: its last state is the longest it holds
                    tqdm.write(f"latency: {policy} ran out of device memory at {pos} tokens")
                    break
                states.append((policy, checkpoint, snapshot(session), pos))
    timings = {(policy, checkpoint): [] for policy, checkpoint, _, _ in states}
    # every state once per round, so all see the machine at the same moments, in an order drawn anew each round:
    # in a fixed order each state always follows the same one, and a state after h2o's (which allocates at
    # every decode step) decoded 5-12% slower than alone (stop 42)
    orders = [random.Random(r).sample(states, len(states)) for r in range(rounds)]
    with tqdm(total=2 * rounds * len(states), unit="round", desc="latency: rounds") as bar:
        for r in range(rounds):
            for policy, checkpoint, session, pos in orders[r]:
                q = ids[pos + r * QUESTION: pos + (r + 1) * QUESTION][None]
                memory.before()
                timings[policy, checkpoint].append(one_round(session, q, clock))
                memory.after((policy, checkpoint))
                bar.update()
        for r in range(rounds):  # then a clip turn on each, after its question rounds
            for policy, checkpoint, session, pos in orders[r]:
                start = pos + rounds * QUESTION + r * CLIP
                memory.before()
                timings[policy, checkpoint][r] |= clip_round(session, ids[start:start + CLIP][None], clock)
                memory.after((policy, checkpoint))
                bar.update()
    bw = shapes.bandwidth(device)
    weights = shapes.weight_bytes_per_token(model)
    records = []
    for policy, checkpoint, session, _ in states:
        rows = timings[policy, checkpoint]
        stats = {key: median([row[key] for row in rows]) for key in rows[0]}
        stats |= {"kv_tokens": session.kv_tokens, "kv_mb": session.kv_bytes / MB, "rss_mb": rss_mb()}
        stats |= memory.stats((policy, checkpoint), session.kv_bytes)
        stats["floor_ms_per_token"] = 1e3 * (weights + session.kv_bytes) / bw
        stats["decode_vs_floor"] = stats["decode_ms_per_token"] / stats["floor_ms_per_token"]
        if policy != "streaming_llm" and ("streaming_llm", checkpoint) in timings:
            # paired by round: both states ran within the same round, so a machine slowing between rounds
            # cancels out, where it moves a ratio of two medians (issue 23: decode <= 1.02x streaming_llm's)
            ratios = [mine["decode_ms_per_token"] / theirs["decode_ms_per_token"]
                      for mine, theirs in zip(rows, timings["streaming_llm", checkpoint], strict=True)]
            stats["decode_vs_streaming_llm"] = median(ratios)
        records += [record("latency", policy, budget, k, v, checkpoint) for k, v in stats.items()]
    name = "latency" if args.shape is None else f"latency_{args.shape}"
    print(f"{name}: {torch.cuda.get_device_name() if cuda else 'CPU'}, memory bandwidth {bw / 1e9:.0f} GB/s "
          f"(a copy's bytes read + written), weights read per token {weights / MB:.0f} MB")
    columns = ["decode_ms_per_token", "decode_vs_streaming_llm", "floor_ms_per_token", "ttft_s", "clip_ttft_s",
               "evict_share", "kv_mb"]
    print_table(records, columns + (["gpu_mb"] if cuda else ["rss_mb"]) + ["tokens_per_s"])
    write(args.out, name, records, ["decode_ms_per_token", "clip_ttft_s", "kv_mb" if not cuda else "gpu_mb",
                                    "evict_share"], log_x=True)
