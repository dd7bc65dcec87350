"""The four ways a linked clip's KV is used, on the same questions from the same cache: `python -m benchmarks
link_modes [--quick]`.

The hour of real footage and the plain-words questions of `benchmarks natural` (same seed, same schedule), tiny-vlm
with `inf_mllm+recall` at budget 512, its clip turns stored with their inputs. At each question the model answers
and that links a stored clip, the question is asked once per reuse mode from the same cache (recall.py
`recompute_rows`): `full` (the stored KV as it is, MPIC's full reuse), `mpic` (each clip's text and first k visual
tokens recomputed with the question: MPIC-k, k = 4, the default; `mpic-0`, `mpic-8`: k = 0 and 8), `blend` (the 15%
of its tokens whose KV moves most: CacheBlend-r) and `reencode` (every token recomputed: the ceiling). Each ask
leaves with its answer (keep=False) and its linked block at the next ask, so all start from the same state; their
order turns from question to question.

Per mode: accuracy against the schedule's truth, how often the answer equals the re-encoded one, the first answer
token's distribution against the re-encoded one (KL divergence, top-1 agreement), and time to first token (linking,
recompute and prefill; medians, and the median of per-question ratios to full reuse and to re-encoding). `gap
closed` is the share of full reuse's distance to re-encoding a mode removes (KL: 1 - KL_mode / KL_full; answers:
(agree_mode - agree_full) / (1 - agree_full); accuracy: (acc_mode - acc_full) / (acc_reencode - acc_full)).
Writes `link_modes.json`.
"""

import random
import statistics
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from models.tiny_vlm.model import TinyVLM

from .common import print_table, record, write
from .natural import BUDGET, CLIP_S, HOUR_CLIPS, PRESENT, compose, encode_pieces, pieces, plan_questions, right

MODES = ("full", "mpic-0", "mpic", "mpic-8", "blend", "reencode")  # mpic-K: MPIC-k with k = K (mpic: the default, 4)


def ask_all(vlm, session, ask, reading, order_of_modes) -> dict | None:
    """The question asked once per mode from the same cache; None if it linked nothing."""
    base, out = session.recall, {}
    ids = vlm.question_turn(reading.text, session)
    for mode in order_of_modes:
        reuse, _, k = mode.partition("-")
        session.recall = replace(base, reuse=reuse, mpic_k=int(k) if k else base.mpic_k)
        t0 = time.perf_counter()
        logits = session.append_question(ids, named=reading.named, keep=False)
        ttft = time.perf_counter() - t0
        if not session.last_recalled:
            session.recall = base
            return None
        answer = "".join(vlm.stream_answer(session, 12)).strip()
        out[mode] = {"ttft_s": ttft, "answer": answer, "logp": torch.log_softmax(logits[0, -1].float(), dim=-1),
                     "linked": [meta["clip"] for _, meta in session.last_recalled]}
    session.recall = base
    return out


def run(args):
    clips = int(args.tokens) if getattr(args, "tokens", None) else (150 if args.quick else HOUR_CLIPS)
    rng = random.Random(0)  # the natural benchmark's draws, in its order: the same stream and questions
    table = pieces()
    order = compose(rng, clips)
    asks = plan_questions(rng, order, table, max(16, clips // 3))
    vlm = TinyVLM()
    visual = encode_pieces(vlm)
    session = vlm.new_session("inf_mllm+recall+reencode", budget=BUDGET)  # +reencode: turns stored with inputs
    rows, pending, turn = [], list(asks), random.Random(1)
    with torch.inference_mode(), tqdm(total=clips, desc="link modes", unit="clip") as bar:
        for k, name in enumerate(order):
            vlm.append_clip(session, visual[name], k + 1, k * CLIP_S, (k + 1) * CLIP_S)
            bar.update(1)
            while pending and pending[0].at == k:
                ask = pending.pop(0)
                if ask.kind in PRESENT:
                    continue
                log = session.store.clips()
                reading = vlm.read_question(ask.text, log, log[-1]["end"])
                if reading.direct is not None:  # the clip log answers it: the model is not asked
                    continue
                modes = list(MODES)
                turn.shuffle(modes)
                got = ask_all(vlm, session, ask, reading, modes)
                if got is not None:
                    rows.append({"question": ask.text, "kind": ask.kind, "at_clip": k + 1, **{
                        mode: {"ok": right(ask, r["answer"], order, table), "answer": r["answer"],
                               "ttft_s": r["ttft_s"], "linked": r["linked"], "logp": r["logp"]}
                        for mode, r in got.items()}})
    recs = summarize(rows)
    write(args.out, "link_modes", recs, [])
    print_table(recs, ["accuracy", "rate", "kl", "ttft_s", "ratio", "questions"])


def summarize(rows: list[dict]) -> list[dict]:
    recs = []

    def add(mode, metric, value, x):
        reuse, _, k = mode.partition("-")
        name = "inf_mllm+recall" + (f"+{reuse}" if reuse != "full" else "") + (f", k={k}" if k else "")
        recs.append(record("link_modes", name, BUDGET, metric, value, x))

    kl, agree, accuracy = {}, {}, {}
    for mode in MODES:
        ceiling = [r["reencode"]["logp"] for r in rows]
        mine = [r[mode]["logp"] for r in rows]
        kl[mode] = statistics.mean(float((c.exp() * (c - m)).sum()) for c, m in zip(ceiling, mine, strict=True))
        agree[mode] = statistics.mean(r[mode]["answer"] == r["reencode"]["answer"] for r in rows)
        add(mode, "questions", len(rows), "linking questions")
        accuracy[mode] = statistics.mean(r[mode]["ok"] for r in rows)
        add(mode, "accuracy", accuracy[mode], "linking questions")
        add(mode, "rate", agree[mode], "answer equals re-encoding's")
        add(mode, "rate", statistics.mean(int(r[mode]["logp"].argmax() == r["reencode"]["logp"].argmax())
                                          for r in rows), "first token equals re-encoding's")
        add(mode, "kl", kl[mode], "first token, KL(re-encoding || mode), mean")
        add(mode, "ttft_s", statistics.median(r[mode]["ttft_s"] for r in rows), "median, linking")
        add(mode, "ratio", statistics.median(r[mode]["ttft_s"] / r["full"]["ttft_s"] for r in rows),
            "time to first token / full reuse's, median")
        add(mode, "ratio", statistics.median(r[mode]["ttft_s"] / r["reencode"]["ttft_s"] for r in rows),
            "time to first token / re-encoding's, median")
    for mode in [m for m in MODES if m not in ("full", "reencode")]:
        if kl["full"] > 0:
            add(mode, "ratio", 1 - kl[mode] / kl["full"], "gap closed (first-token KL)")
        if accuracy["reencode"] > accuracy["full"]:
            add(mode, "ratio", (accuracy[mode] - accuracy["full"]) / (accuracy["reencode"] - accuracy["full"]),
                "gap closed (accuracy)")
        if agree["full"] < 1:
            add(mode, "ratio", (agree[mode] - agree["full"]) / (1 - agree["full"]), "gap closed (answers)")
    return recs
