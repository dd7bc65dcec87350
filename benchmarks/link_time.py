"""What linking an evicted clip costs per reuse mode as a clip's visual tokens grow (issue 49, item 3): `python -m
benchmarks link_time [--quick] [--shape vicuna-7b --device cuda]`.

`link_modes` measures the four modes' answers on tiny-vlm, whose clip turn holds 24 visual tokens: there MPIC-k
recomputes 14 of a linked clip's 34 rows and re-encoding 34, so their times differ little. Here only time, with the
turn of tiny-vlm's layout (9 text tokens, V visual tokens, 1 text token; stored with its inputs, `+reencode`) at V =
24 (tiny-vlm), 196 (a LLaVA-OneVision frame), 576 (a LLaVA-1.5 image) and 1,568 (8 frames of 196). Per V: a session
`inf_mllm+recall+reencode` whose budget holds 2 clips (+ 32), 10 clips streamed, then questions (20 tokens) that each
name one of the first 4 clips (evicted by then); each question is asked once per mode from the same cache, the modes
in an order that turns from question to question (`link_modes`' protocol), the first question a warm-up. Time to
first token = linking, the recompute and the question's prefill, the device waited for. Per mode and V: its median,
and the medians of per-question ratios to full reuse and to re-encoding (goal: MPIC-k <= 1.3x full reuse, <= 0.5x
re-encoding).

Model: SmolLM2-135M (tiny-vlm's language model, its real weights, fp32) on the CPU, or `--shape` (a randomly
initialised 7B model, fp16) on `--device`. The visual embeddings are random at the scale of the model's token
embeddings: a forward's time does not depend on their values. Writes `link_time.json` (`link_time_<shape>.json`)
and a plot of time to first token against V.
"""

import random
import statistics
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from inf_mllm.loader import load_model
from inf_mllm.session import StreamSession

from . import shapes
from .common import print_table, record, write

VISUAL = (24, 196, 576, 1568)
TEXT_BEFORE, TEXT_AFTER = 9, 1  # tiny-vlm's clip turn around its visual tokens
CLIPS, NAMED = 10, 4  # clips streamed; questions name one of the first NAMED (evicted by the end)
QUESTION = 20
MODES = ("full", "mpic", "blend", "reencode")


def run(args):
    device = args.device
    model = shapes.build(args.shape, device) if args.shape else load_model()[0].to(device)
    sizes = VISUAL[:2] if args.quick else VISUAL
    asks = 3 if args.quick else (args.rounds or 9)
    name = f"link_time_{args.shape}" if args.shape else "link_time"
    records = []
    for visual in sizes:
        rows = time_modes(model, visual, asks, device)
        records += summarize(rows, visual)
        write(args.out, name, records, [])  # after each size: a run cut short keeps what it measured
    write(args.out, name, records, ["ttft_s"], log_x=True, x_label="visual tokens per clip")
    print_table(records, ["ttft_s", "ratio", "questions"])


def time_modes(model, visual: int, asks: int, device) -> list[dict]:
    """Per question after the warm-up: each mode's time to first token and how many stored clips it linked."""
    gen = torch.Generator().manual_seed(visual)
    table = model.get_input_embeddings().weight
    scale, width = float(table.detach().float().std()), table.shape[1]
    vocab = min(table.shape[0], 32000)  # ids any of the shapes' vocabularies holds
    turn = TEXT_BEFORE + visual + TEXT_AFTER
    session = StreamSession(model, None, "inf_mllm+recall+reencode", budget=2 * turn + 32)
    base, order, rows = session.recall, random.Random(visual), []
    with torch.inference_mode():
        for clip in tqdm(range(1, CLIPS + 1), desc=f"link time, {visual} visual tokens: clips", unit="clip"):
            ids = torch.randint(100, vocab, (1, turn), generator=gen)
            embeds = table[ids.to(table.device)].clone()
            embeds[0, TEXT_BEFORE:TEXT_BEFORE + visual] = (torch.randn(visual, width, generator=gen) * scale).to(
                embeds)
            session.append(inputs_embeds=embeds, meta={"clip": clip, "start": 4.0 * (clip - 1), "end": 4.0 * clip},
                           vision=(TEXT_BEFORE, TEXT_BEFORE + visual))
        for q in tqdm(range(asks + 1), desc=f"link time, {visual} visual tokens: questions", unit="question"):
            target = 1 + q % NAMED
            question = torch.randint(100, vocab, (1, QUESTION), generator=gen).to(device)
            modes = list(MODES)
            order.shuffle(modes)
            got = {}
            for mode in modes:
                session.recall = replace(base, reuse=mode)
                shapes.sync(device)
                t0 = time.perf_counter()
                logits = session.append_question(question, named=lambda meta, c=target: meta.get("clip") == c,
                                                 keep=False)
                logits.float().sum().item()  # waits for the device
                got[mode] = {"ttft_s": time.perf_counter() - t0, "linked": len(session.last_recalled)}
            session.recall = base
            if q and all(r["linked"] for r in got.values()):  # q = 0: the warm-up
                rows.append(got)
    return rows


def summarize(rows: list[dict], visual: int) -> list[dict]:
    label = {"full": "full reuse", "mpic": "MPIC-k (+mpic)", "blend": "CacheBlend-r (+blend)",
             "reencode": "re-encoding (+reencode)"}
    recs = [record("link_time", "questions", None, "questions", len(rows), visual)]
    for mode in MODES:
        recs.append(record("link_time", label[mode], None, "ttft_s",
                           statistics.median(r[mode]["ttft_s"] for r in rows), visual))
        for other in ("full", "reencode"):
            if other != mode:
                recs.append(record("link_time", f"{label[mode]}: / {label[other].split(' (')[0]}", None, "ratio",
                                   statistics.median(r[mode]["ttft_s"] / r[other]["ttft_s"] for r in rows), visual))
    return recs
