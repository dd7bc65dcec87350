"""Streaming perplexity (paper Fig. 5): Gutenberg text fed in 64-token chunks, every policy, fixed budgets.

Each chunk is one turn: it is scored by the model over the current cache, then the cache evicts.
The full cache runs only up to the model's trained context (8K for SmolLM2).
"""

import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from inf_mllm import StreamSession, load_model
from inf_mllm.loader import resolve

from .common import RoundTimer, median, plans, print_table, read, record, write
from .corpus import corpus_tokens, token_stream

CHUNK = 64


def stream(model, tok, ids, policy, budget, cfg, segment, bar, state=None, on_round=None):
    """Yield (end, ppl, kv_tokens, evict_share, state) per segment; `state` (what a checkpoint holds)
    continues a stopped run where it was saved. `on_round(session, round_s, share)` sees every chunk."""
    session = StreamSession(model, tok, policy, budget=budget, **cfg)
    prev, first = None, 0
    if state:
        session.cache, session.seen, prev, first = state["cache"], state["seen"], state["prev"], state["end"]
        bar.update(first)
    session.cache.timing.measure = True
    nll, count, shares = 0.0, 0, []
    for start in range(first, ids.numel(), CHUNK):
        chunk = ids[start:start + CHUNK][None]
        timer = RoundTimer(session)
        logits = session.append(chunk, all_logits=True)
        round_s = timer.turn()
        shares.append(timer.share(round_s))
        if on_round:
            on_round(session, round_s, shares[-1])
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
            snapshot = {"cache": session.cache, "seen": session.seen, "prev": prev, "end": end}
            yield end, math.exp(nll / count), session.kv_tokens, median(shares), snapshot
            nll, count, shares = 0.0, 0, []
        bar.update(chunk.shape[1])


def run(args):
    model, tok = load_model()
    budgets = args.budgets or ([256, 1024] if args.quick else [256, 512, 1024])
    length = args.tokens or (4096 if args.quick else 65536)
    segment = 512 if args.quick else 1024
    context = 2048 if args.quick else model.config.max_position_embeddings
    full_len = min(length, context)
    ids = token_stream(tok, length)
    todo = [(p.policy, p.budget, p.cfg, p.length) for p in plans(args.policies, budgets, length, context)]
    run_id = {"tokens": length, "segment": segment}
    records, state, done = [], None, set()
    if getattr(args, "resume", False):
        records, state, done = resumed(Path(args.out), todo, run_id)
    checkpoint = Path(args.out) / "stream_ppl.ckpt"
    with tqdm(total=sum(p[3] for p in todo), unit="tok", desc="stream_ppl") as bar:
        for policy, budget, cfg, n in todo:
            bar.set_postfix_str(f"{policy}@{budget}")
            if (policy, budget) in done:
                bar.update(n)
                continue
            here = state if state and (state["policy"], state["budget"]) == (policy, budget) else None
            parts = stream(model, tok, ids[:n], policy, budget, cfg, segment, bar, here)
            for x, ppl, kv, share, snapshot in parts:
                records += [record("stream_ppl", policy, budget, "ppl", ppl, x),
                            record("stream_ppl", policy, budget, "kv_tokens", kv, x),
                            record("stream_ppl", policy, budget, "evict_share", share, x)]
                if (x // segment) % 64 == 0:  # long runs keep what they have measured, and can resume
                    write(args.out, "stream_ppl", records, [])
                    save(checkpoint, snapshot | run_id | {"policy": policy, "budget": budget})
            write(args.out, "stream_ppl", records, ["ppl"], log_x=True)
    checkpoint.unlink(missing_ok=True)
    summary = summarize(records, full_len, period=corpus_tokens(tok), segment=segment)
    print_table(summary, ["ppl", "evict_share"])
    write(args.out, "stream_ppl", records + summary, ["ppl"], log_x=True)


def save(path: Path, state: dict):
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def resumed(out: Path, todo, run_id):
    """Records and checkpoint of a stopped run in `out` (`--resume`): the runs it finished, and the
    state of the one it was in, with that run's records up to the state. Partial runs without a
    checkpoint start again."""
    path, checkpoint = out / "stream_ppl.json", out / "stream_ppl.ckpt"
    if not path.exists():
        raise SystemExit(f"nothing to resume: {path} not found")
    state = torch.load(checkpoint, weights_only=False) if checkpoint.exists() else None
    if state and {k: state[k] for k in run_id} != run_id:
        raise SystemExit(f"{checkpoint} is from another run ({ {k: state[k] for k in run_id} }), not {run_id}")
    records = [r for r in read(path) if not isinstance(r["x"], str)]
    last = {(p[0], p[1]): p[3] // run_id["segment"] * run_id["segment"] for p in todo}
    reached = {}
    for r in records:
        key = (r["policy"], r["budget"])
        reached[key] = max(reached.get(key, 0), r["x"])
    done = {key for key, x in reached.items() if key in last and x >= last[key]}
    at = (state["policy"], state["budget"]) if state else None
    keep = [r for r in records if (r["policy"], r["budget"]) in done
            or ((r["policy"], r["budget"]) == at and r["x"] <= state["end"])]
    return keep, (state if at not in done else None), done


def by_pass(ppl, period, segment):
    """[(pass, its mean ppl, the first pass's and the previous pass's over the same text)] for a stream
    that repeats a `period`-token corpus: the text changes perplexity far more than stream length
    does, so a later pass is only comparable with the first over the same segments (aligned to
    within half a segment)."""
    at = {r["x"]: r["value"] for r in ppl}  # x: the segment's end
    out = []
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    for p in range(2, max(at) // period + 2):
        first = round((p - 1) * period / segment) * segment  # shift back to the same text in pass 1
        previous = first - round((p - 2) * period / segment) * segment  # … and in pass p - 1
        xs = [x for x in at if (p - 1) * period <= x - segment and x <= p * period and x - first in at]
        if xs:
            out.append((p, mean([at[x] for x in xs]), mean([at[x - first] for x in xs]),
                        mean([at[x - previous] for x in xs])))
    return out


def summarize(records, full_len, period=None, segment=1024):
    """Mean ppl over 0..full_len (the span the full cache covers) and over the whole stream; with the
    corpus length `period`, each later pass beside the first pass over the same text."""
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
        for p, later, first, previous in by_pass(ppl, period, segment) if period else []:
            out.append(record("stream_ppl", policy, budget, "ppl", later, f"pass{p}"))
            out.append(record("stream_ppl", policy, budget, "ppl", first, f"pass1@pass{p}"))
            if p > 2:
                out.append(record("stream_ppl", policy, budget, "ppl", previous, f"pass{p - 1}@pass{p}"))
    return out


def merge(out_dir, in_dirs, full_len=8192):
    """One stream_ppl.json and plot from runs made apart (in parallel processes or in several
    sessions); a later folder's (policy, budget) replaces an earlier one's."""
    merged = {}
    for folder in in_dirs:
        runs = {}
        for r in read(Path(folder) / "stream_ppl.json"):
            if not isinstance(r["x"], str):
                runs.setdefault((r["policy"], r["budget"]), []).append(r)
        merged.update(runs)
    records = [r for rs in merged.values() for r in rs]
    segment = min(r["x"] for r in records)
    summary = summarize(records, full_len, period=corpus_tokens(AutoTokenizer.from_pretrained(resolve("smollm2"))),
                        segment=segment)
    print_table(summary, ["ppl", "evict_share"])
    return write(out_dir, "stream_ppl", records + summary, ["ppl"], log_x=True)


if __name__ == "__main__":  # python -m benchmarks.stream_ppl OUT_DIR IN_DIR...
    if len(sys.argv) < 3:
        sys.exit("usage: python -m benchmarks.stream_ppl OUT_DIR IN_DIR... (merges their stream_ppl.json)")
    merge(sys.argv[1], sys.argv[2:])
