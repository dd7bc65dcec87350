"""Multi-round line retrieval (the paper's LongEval experiment, adapted to a 135M model).

Each round streams 5 lines `word: 123` (single-token words, 3-digit values), then asks for the value
of one earlier line with the prompt `word:`. Question and true answer go in as one turn, and the
answer counts as right when greedy decoding would have produced it: the model's top token equals the
answer's at every answer position (teacher forcing). So the stream holds correct answers, as a
transcript would; a wrong guess left in the stream is copied by later answers. Accuracy is reported
by how many tokens back the asked line was. (H2O, which also evicts while decoding, sees the answer
as part of the turn, without those few decode-step evictions.)
"""

import collections
import random
import re

import torch
from tqdm import tqdm

from inf_mllm import StreamSession, load_model
from inf_mllm.recall import resident_spans

from .common import RoundTimer, plans, print_table, record, write
from .corpus import gutenberg_text

BUCKETS = ((0, 256, "<256"), (256, 512, "256-512"), (512, 1024, "512-1K"), (1024, 1 << 40, ">=1K"))


def key_words(tok, count=1500):
    """Frequent corpus words that are one token after a newline and before a colon."""
    freq = collections.Counter(re.findall(r"[a-z]{4,8}", gutenberg_text().lower()))
    words = [w for w, _ in freq.most_common(6000) if len(tok("\n" + w + ":", add_special_tokens=False).input_ids) == 3]
    return words[100:100 + count]  # skip function words


def bucket(distance):
    return next(name for lo, hi, name in BUCKETS if lo <= distance < hi)


def token_ids(tok, text):
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids


def answered(session, question_ids, answer_ids, after_ids, oracle=None) -> bool:
    """Append question + answer (+ what follows it) as one turn; whether greedy decoding after the
    question gives the answer. With recall the question's own tokens pick the turns to link."""
    turn = torch.cat([question_ids, answer_ids, after_ids], dim=1)
    if session.recall is not None:
        logits = session.append_question(turn, probe_ids=question_ids, oracle=oracle, all_logits=True)
    else:
        logits = session.append(turn, all_logits=True)
    start = question_ids.shape[1] - 1  # the logits at the question's last token predict the answer's first
    return bool((logits[0, start:start + answer_ids.shape[1]].argmax(-1) == answer_ids[0]).all())


def trial(model, tok, words, policy, budget, cfg, rounds, seed, bar, timed=False):
    """One stream of `rounds` rounds; per round {distance (tokens), ok, evicted (the asked line's turn had
    left the cache; None without recall), recalled (that turn was linked back), round_s, evict_share, kv_mb,
    kv_tokens}.
    The questions depend on `seed` alone, never on the policy. `timed` prices the scores
    (`cache.timing.measure`), which only the timings need."""
    def ids(text):
        return token_ids(tok, text)

    rng = random.Random(seed)
    keys = rng.sample(words, rounds * 5)
    session = StreamSession(model, tok, policy, budget=budget, **cfg)
    session.cache.timing.measure = timed
    lines, results = [], []
    for r in range(rounds):
        timer = RoundTimer(session)
        block = []
        for i in range(5):
            value = rng.randint(100, 999)
            before = ids("\n".join(block) + "\n").shape[1] if block else 0  # tokens before this line
            lines.append((keys[r * 5 + i], value, session.seen + before, r))
            block.append(f"{keys[r * 5 + i]}: {value}")
        session.append_text("\n".join(block) + "\n", meta={"round": r})
        timer.turn()
        word, value, pos, at = rng.choice(lines)
        evicted = recalled = None
        if session.store is not None:
            by_round = {span.meta["round"]: i for i, span in session.store.spans.items()}
            evicted = by_round[at] not in resident_spans(session.cache, session.store, session.recall.resident)
        ok = answered(session, ids(f"{word}:"), ids(f" {value}"), ids("\n"),
                      oracle=lambda meta, at=at: meta["round"] == at)
        round_s = timer.turn()
        if session.store is not None:
            recalled = any(meta["round"] == at for _, meta in session.last_recalled)
        results.append({"distance": session.seen - pos, "ok": ok, "evicted": evicted, "recalled": recalled,
                        "round_s": round_s, "evict_share": timer.share(round_s), "kv_mb": session.kv_bytes / 2**20,
                        "kv_tokens": session.kv_tokens})
        bar.update(1)
    return results


def run(args):
    model, tok = load_model()
    words = key_words(tok)
    budgets = args.budgets or ([256] if args.quick else [256, 512])
    seeds = [0] if args.quick else [0, 1, 2]
    rounds = 12 if args.quick else 40
    # the full cache always runs: the accuracies are read against it
    todo = plans(None if args.policies is None else ["full", *args.policies], budgets, recall=True)
    records = []
    with tqdm(total=len(todo) * len(seeds) * rounds, desc="retrieval", unit="round") as bar:
        for plan in todo:
            policy, budget = plan.key
            bar.set_postfix_str(f"{policy}@{budget}")
            hits, found = collections.defaultdict(list), []
            for seed in seeds:
                for row in trial(model, tok, words, policy, budget, plan.cfg, rounds, seed, bar):
                    hits[bucket(row["distance"])].append(row["ok"])
                    hits["all"].append(row["ok"])
                    if row["evicted"]:  # the asked line's turn had left the cache: was it linked back?
                        hits["evicted"].append(row["ok"])
                        found.append(row["recalled"])
            for name in [b[2] for b in BUCKETS] + ["all", "evicted"]:
                if hits[name]:
                    records.append(record("retrieval", policy, budget, "accuracy", sum(hits[name]) / len(hits[name]),
                                          name))
            if found:
                records.append(record("retrieval", policy, budget, "recall_at_k", sum(found) / len(found), "evicted"))
            write(args.out, "retrieval", records, ["accuracy"])
    print_table(records, ["accuracy", "recall_at_k"])
    write(args.out, "retrieval", records, ["accuracy"])
