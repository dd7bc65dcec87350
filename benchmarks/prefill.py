"""A clip turn's prefill, old path against new (issue 23): the LM head over every position of the turn, as
every prefill did, against the last position only, which is all a clip turn or a question needs.

tiny-vlm on the bundled clip, `inf_mllm` at budget 512 with the cache full: the same encoded clip goes in as
a clip turn again and again, the two paths alternating turn by turn, so both see the same cache, the same
eviction and the same machine load. Medians of `session.last.prefill_s` (the forward; eviction is timed
apart and is the same for both) and their ratio.
"""

import numpy as np
import torch
from tqdm import tqdm

from models import load_adapter
from streaming.sources import FileSource, bundled_clip

from .common import median, print_table, record, write

BUDGET = 512


def run(args):
    rounds = 10 if args.quick else 60
    vlm = load_adapter("tiny-vlm")
    frames = [f for _, f in zip(range(4), FileSource(bundled_clip(), fps=1.0), strict=False)]
    visual = vlm.encode(np.stack([f.rgb for f in frames]), [f.t for f in frames])
    session = vlm.new_session("inf_mllm", budget=BUDGET)
    with torch.inference_mode():
        while session.kv_tokens < BUDGET:  # fill the cache: eviction runs on every timed turn
            vlm.append_clip(session, visual, 1)
    turn = vlm.clip_turn(visual, 1, 0.0)
    times = {"all positions (old)": [], "last position (new)": []}
    with torch.inference_mode():
        for r in tqdm(range(2 * rounds), desc="prefill", unit="turn"):
            path = list(times)[r % 2]
            session.append(inputs_embeds=turn, all_logits=path.startswith("all"))
            times[path].append(session.last.prefill_s)
    tokens = turn.shape[1]
    records = [record("prefill", path, BUDGET, "prefill_ms", 1e3 * median(t), tokens)
               for path, t in times.items()]
    old, new = (median(t) for t in times.values())
    records.append(record("prefill", "speed-up (old / new)", BUDGET, "ratio", old / new, tokens))
    print_table(records, ["prefill_ms", "ratio"])
    print(f"clip turn of {tokens} tokens, budget {BUDGET}, {rounds} turns per path: "
          f"{1e3 * old:.1f} ms → {1e3 * new:.1f} ms, {old / new:.2f}x")
    write(args.out, "prefill", records, [])
