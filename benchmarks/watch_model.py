"""Model-backed watches over the natural hour: `python -m benchmarks watch_model [--quick] [--tokens CLIPS]
[--policies watches cost pool]` (the parts to run; all by default).

The montage and its truth are `watch`'s; here each kind is watched as the model's own yes/no question ("is there a
person?") after every clip, a side question that leaves the cache with its answer, instead of by the detector's counts.
Two streams take the same clips through the real `TurnEngine` with tiny-vlm, one with the six model watches and one
with none, and every 25 clips both are asked "what is on screen?": the watches are scored as `watch` scores them
(precision, recall, false alerts an hour), and the streams' answers and caches are compared clip by clip (the watched
one must hold what the plain one holds: the same KV tokens after every clip, the same answers). The cost: the first
60 clips again with 16 model watches against none, their questions in shared forwards and one at a time, each clip's
turn and judging timed, set beside the clip's perception (`watch.see_seconds`) as the share of a clip's ingest the
watches add; and 4 streams x 4 watches on one pool against the same streams with none. Writes `watch_model.json`.
"""

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from models.tiny_vlm.model import TinyVLM
from models.watch import Watch
from streaming.engine import Clip, TurnEngine
from streaming.questions import Question
from streaming.watches import Watcher, Watches

from .common import machine, parts, print_table, record, write
from .natural import CLIP_S, HOUR_CLIPS, compose, encode_pieces, pieces
from .watch import BUDGET, KINDS, score, see_seconds, truth_of

ASKED_EVERY = 25  # clips between the streams' own questions
COST_CLIPS = 60
POOL_CLIPS = 30
# 16 questions for the cost run: the six kinds and ten things the detector does not count
COST_WATCHES = [*KINDS, "a traffic light", "a parking meter", "a street sign", "a tree", "a bench", "a boat", "a bird",
                "a horse", "a truck", "a helmet"]


def model_watches(texts, session: str) -> Watches:
    """Each text watched as the model's yes/no question, whatever the detector counts (`Watch` with no things)."""
    return Watches([Watcher(Watch(text, ()), i, cooldown_s=30.0) for i, text in enumerate(texts)], session)


def stream(vlm, visual, order, watches, ask: bool = True, desc: str = "streaming", kv_bytes: list | None = None):
    """The clips through a fresh stream with `watches`: (alert clips by watch, KV tokens after each clip, its answers,
    each clip's turn and judging in seconds); the cache's bytes after each clip appended to `kv_bytes` if given."""
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=BUDGET), clip_seconds=CLIP_S)
    engine.watches = watches
    fired = {w.watch.text: [] for w in watches.watchers} if watches is not None else {}
    kv, answers, spent = [], [], []
    with torch.inference_mode():
        for k, name in enumerate(tqdm(order, desc=desc, unit="clip")):
            t0 = time.perf_counter()
            engine.feed(Clip(k + 1, k * CLIP_S, (k + 1) * CLIP_S, visual[name], 0.0))
            spent.append(time.perf_counter() - t0)
            kv.append(engine.session.kv_tokens)
            if kv_bytes is not None:
                kv_bytes.append(engine.session.kv_bytes)
            for alert in engine.fired:
                fired[alert["alert"]].append(k)
            if ask and (k + 1) % ASKED_EVERY == 0:
                answers.append(engine.answer(Question("what is on screen?")).answer)
    return fired, kv, answers, spent


def cost(vlm, visual, first) -> list[dict]:
    """16 model watches on one stream against none, their questions packed into shared forwards and (the way before
    they were) one at a time, in the same run; each beside the clip's perception."""
    *_, packed = stream(vlm, visual, first, model_watches(COST_WATCHES, "bench-16"), ask=False, desc="16 watches")
    vlm.packs_side_questions = False
    try:
        *_, alone = stream(vlm, visual, first, model_watches(COST_WATCHES, "bench-16b"), ask=False,
                           desc="16 watches, one at a time")
    finally:
        del vlm.packs_side_questions  # the class's own again
    *_, none = stream(vlm, visual, first, None, ask=False, desc="no watch")
    perception = statistics.median(see_seconds(vlm, sorted(set(first))[:12]).values())  # 12 pieces: it is steady
    turn_0 = statistics.median(none)
    recs = [record("watch_model", "no watch", BUDGET, "turn_s", turn_0, "median clip turn"),
            record("watch_model", "stream", BUDGET, "perception_s", perception, "median perception of a clip")]
    for name, spent in (("16 model watches", packed), ("16 model watches, one at a time", alone)):
        turn = statistics.median(spent)
        recs += [record("watch_model", name, BUDGET, "turn_s", turn, "median clip turn + judging"),
                 record("watch_model", name, BUDGET, "ratio", (perception + turn) / (perception + turn_0),
                        "a clip's perception + turn with 16 watches / with none")]
    return recs


def pool_cost(vlm, visual, first, streams: int = 4, watches: int = 4) -> list[dict]:
    """4 streams x 4 model watches on one pool against the same 4 streams with none: each stream feeds the same clips
    from a thread of its own (the pool packs their clip turns; each stream's questions share a forward), and a round
    is the wall time from all four clips of a step given to all four judged."""
    from inf_mllm.pool import SessionPool

    def rounds(with_watches: bool) -> list[float]:
        pool = SessionPool(vlm.model, vlm.tokenizer)
        try:
            engines = []
            for n in range(streams):
                engine = TurnEngine(vlm, pool.open(make=lambda: vlm.new_session("inf_mllm+recall", budget=BUDGET)),
                                    clip_seconds=CLIP_S)
                engine.watches = model_watches(COST_WATCHES[n * watches:(n + 1) * watches], f"pool-{n}") \
                    if with_watches else None
                engines.append(engine)
            spent = []
            with ThreadPoolExecutor(streams) as threads, torch.inference_mode():
                for k, name in enumerate(tqdm(first, desc=f"pool, {'4' if with_watches else 'no'} watches a stream")):
                    clip = Clip(k + 1, k * CLIP_S, (k + 1) * CLIP_S, visual[name], 0.0)
                    t0 = time.perf_counter()
                    list(threads.map(TurnEngine.feed, engines, [clip] * streams))
                    spent.append(time.perf_counter() - t0)
            return spent
        finally:
            pool.close()

    watched, plain = statistics.median(rounds(True)), statistics.median(rounds(False))
    label = f"{streams} streams x {watches} model watches, one pool"
    each = f"median wall time of {streams} clips' turns"
    return [record("watch_model", label, BUDGET, "round_ms", 1000 * watched, each),
            record("watch_model", f"{streams} streams, no watch, one pool", BUDGET, "round_ms", 1000 * plain, each),
            record("watch_model", label, BUDGET, "ratio", watched / plain, "round with watches / without")]


PARTS = ("watches", "cost", "pool")  # `--policies` picks: the montage's alerts and answers, 16 watches' cost, the pool


def run(args):
    chosen = parts(args, "watch_model", PARTS)
    clips = int(args.tokens) if getattr(args, "tokens", None) else (150 if args.quick else HOUR_CLIPS)
    order = compose(random.Random(0), clips)
    vlm = TinyVLM()
    visual = encode_pieces(vlm, set(order) if "watches" in chosen else set(order[:COST_CLIPS]))
    recs = watched(vlm, visual, order) if "watches" in chosen else []
    if "cost" in chosen:
        recs += cost(vlm, visual, order[:COST_CLIPS])
    if "pool" in chosen:
        recs += pool_cost(vlm, visual, order[:POOL_CLIPS])
    write(Path(args.out), "watch_model", recs, [])
    print(f"watch_model: {clips} clips of {CLIP_S:g} s, {machine().get('cpu')}")
    print_table(recs, ["precision", "recall", "latency_clips", "false_per_hour", "clips_same_kv", "max_kv_tokens",
                       "answers_same", "turn_s", "perception_s", "ratio", "round_ms"])


def watched(vlm, visual, order) -> list[dict]:
    """The six model watches over the montage, scored against the annotation, and the watched stream's cache and
    answers against a stream with none."""
    truth = truth_of(pieces(), order)
    fired, kv, answers, _ = stream(vlm, visual, order, model_watches(KINDS, "bench-model"), desc="6 model watches")
    _, kv_plain, answers_plain, _ = stream(vlm, visual, order, None, desc="no watch")
    recs = []
    for text, clips_fired in fired.items():
        for metric, value in score(clips_fired, truth[text]).items():
            if value is not None:
                recs.append(record("watch_model", f"model watch: {text}", BUDGET, metric, float(value),
                                   "tiny-vlm's yes after a clip; re-arm 2 clips, cooldown 30 s"))
    same_kv = sum(a == b for a, b in zip(kv, kv_plain, strict=True))
    same_answers = sum(a == b for a, b in zip(answers, answers_plain, strict=True))
    return recs + [
        record("watch_model", "6 model watches", BUDGET, "clips_same_kv", same_kv, f"of {len(order)}"),
        record("watch_model", "6 model watches", BUDGET, "max_kv_tokens", max(kv), f"budget {BUDGET}"),
        record("watch_model", "no watch", BUDGET, "max_kv_tokens", max(kv_plain), f"budget {BUDGET}"),
        record("watch_model", "6 model watches", BUDGET, "answers_same", same_answers,
               f"of {len(answers)} 'what is on screen?' asked every {ASKED_EVERY} clips")]
