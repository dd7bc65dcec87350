"""A clip turn's prefill, old path against new (issue 23): the LM head over every position of the turn and K/V
appended by `torch.cat` (transformers' dynamic layers), as every prefill did before issue 23, against the last
position only (all a clip turn or a question needs) and K/V written into preallocated buffers; the middle path
(every position, buffers) tells the two changes apart.

tiny-vlm on the bundled clip, `inf_mllm` at budget 512 with the cache full: the same encoded clip goes in as
a clip turn again and again, the paths alternating turn by turn (one session with buffers, one without), so
all see the same cache size, the same eviction and the same machine load. Medians of `session.last.prefill_s`
(the forward) and of the turn with its eviction, and the old path's over the new one's.
"""

import numpy as np
import torch
from tqdm import tqdm

from models import load_adapter
from streaming.sources import FileSource, bundled_clip

from .common import median, print_table, record, write

BUDGET = 512
# (name, K/V in buffers, LM head over every position)
PATHS = [("old: every position, torch.cat", False, True), ("every position, buffers", True, True),
         ("new: last position, buffers", True, False)]


def run(args):
    rounds = 10 if args.quick else 60
    vlm = load_adapter("tiny-vlm")
    frames = [f for _, f in zip(range(4), FileSource(bundled_clip(), fps=1.0), strict=False)]
    visual = vlm.encode(np.stack([f.rgb for f in frames]), [f.t for f in frames])
    sessions = {static: vlm.new_session("inf_mllm", budget=BUDGET, static=static) for static in (False, True)}
    with torch.inference_mode():
        for session in sessions.values():
            while session.kv_tokens < BUDGET:  # fill the cache: eviction runs on every timed turn
                vlm.append_clip(session, visual, 1)
    turn = vlm.clip_turn(visual, 1, 0.0)
    paths = {name: (static, every) for name, static, every in PATHS}
    prefill, whole = ({name: [] for name in paths} for _ in range(2))
    with torch.inference_mode():
        for r in tqdm(range(len(paths) * rounds), desc="prefill", unit="turn"):
            name = list(paths)[r % len(paths)]
            static, every = paths[name]
            session = sessions[static]
            session.append(inputs_embeds=turn, all_logits=every)
            prefill[name].append(session.last.prefill_s)
            whole[name].append(session.last.prefill_s + session.last.evict_s)
    tokens = turn.shape[1]
    records = []
    for name in paths:
        records += [record("prefill", name, BUDGET, "prefill_ms", 1e3 * median(prefill[name]), tokens),
                    record("prefill", f"{name}, with eviction", BUDGET, "prefill_ms", 1e3 * median(whole[name]),
                           tokens)]
    old, new = PATHS[0][0], PATHS[-1][0]
    for label, times in (("prefill", prefill), ("with eviction", whole)):
        ratio = median(times[old]) / median(times[new])
        records.append(record("prefill", f"speed-up, {label} (old / new)", BUDGET, "ratio", ratio, tokens))
    print_table(records, ["prefill_ms", "ratio"])
    print(f"clip turn of {tokens} tokens, budget {BUDGET}, {rounds} turns per path: prefill "
          f"{1e3 * median(prefill[old]):.1f} ms → {1e3 * median(prefill[new]):.1f} ms")
    write(args.out, "prefill", records, [])
