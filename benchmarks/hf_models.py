"""transformers' video LLMs on the bounded cache, per family on its tiny random checkpoint (issue 24): time and
memory only, random weights answer nothing.

Each family's tiny checkpoint (`models.hf.tiny`: 8 layers of width 64, a 2-layer 32-px vision tower) is
saved to a temporary folder and loaded through `--model hf` as a user's would be; four real frames of the
bundled clip make every clip turn. `inf_mllm` at a budget of four clip turns (at least its 64-token window and
some), filled first so that every timed turn evicts. Medians: a clip turn's encode (vision tower) and prefill (the
forward; eviction apart), decode ms per token of 16-token answers, and the KV bytes one clip turn adds.

`--shape 7b --device cuda`: LLaVA-OneVision at its 7B size (benchmarks/shapes.py), random, in bf16.
"""

import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

from models import load_adapter
from models.hf import tiny
from models.hf.adapter import HFVideo
from streaming.sources import FileSource, bundled_clip

from . import shapes
from .common import median, print_table, record, write


def measure(adapter, frames, times, rounds: int, name: str | None = None) -> list[dict]:
    name = name or adapter.family.name
    budget = max(4 * adapter.turn_tokens(), 96)
    session = adapter.new_session("inf_mllm", budget=budget)
    cuda = adapter.model.device.type == "cuda"
    session.cache.timing.measure = cuda  # the session's turn times wait for the GPU's queued work
    encode, prefill, decode = [], [], []
    with torch.inference_mode():
        while session.kv_tokens < budget:
            adapter.append_clip(session, adapter.encode(frames, times), 1)
        for r in tqdm(range(rounds), desc=name, unit="clip"):
            t0 = time.perf_counter()
            visual = adapter.encode(frames, times)
            shapes.sync(adapter.model.device)
            encode.append(time.perf_counter() - t0)
            adapter.append_clip(session, visual, r + 2, 4.0 * r)
            prefill.append(session.last.prefill_s)
            if r % 4 == 3:
                "".join(adapter.ask(session, "what is in the video?", max_new_tokens=16, eos_token_id=[]))
                if session.last.decoded > 1:
                    decode.append(session.last.decode_s / (session.last.decoded - 1))
    per_clip = adapter.turn_tokens() * session.kv_bytes / session.kv_tokens
    return [record("hf_models", name, budget, "encode_ms", 1e3 * median(encode), adapter.turn_tokens()),
            record("hf_models", name, budget, "prefill_ms", 1e3 * median(prefill), adapter.turn_tokens()),
            record("hf_models", name, budget, "decode_ms_per_token", 1e3 * median(decode), adapter.turn_tokens()),
            record("hf_models", name, budget, "kv_kb_per_clip", per_clip / 1024, adapter.turn_tokens())]


def run(args):
    rounds = 8 if args.quick else 40
    clip = [f for _, f in zip(range(4), FileSource(bundled_clip(), fps=1.0), strict=False)]
    frames, times = np.stack([f.rgb for f in clip]), [f.t for f in clip]
    records = []
    with tempfile.TemporaryDirectory() as folder:
        if args.shape == "7b":
            path, model = shapes.llava_onevision_7b(folder, args.device)
            adapter = HFVideo(path, args.device, model=model)
            records += measure(adapter, frames, times, rounds, "llava_onevision_7b")
        elif args.shape is None:
            for family in tiny.FAMILY_NAMES:
                adapter = load_adapter("hf", tiny.save(family, f"{folder}/{family}"), device=args.device)
                records += measure(adapter, frames, times, rounds)
        else:
            raise SystemExit(f"hf_models: --shape takes 7b, not {args.shape!r}")
    print_table(records, ["encode_ms", "prefill_ms", "decode_ms_per_token", "kv_kb_per_clip"])
    write(args.out, "hf_models" if args.shape is None else f"hf_models_{args.shape}", records, [])
