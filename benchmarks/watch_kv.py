"""The KV cache of a stream with 16 model watches over a long run (issue 69): `python -m benchmarks watch_kv [--quick]
[--tokens CLIPS]` (default 1,000 clips; 100 with --quick).

`watch_model`'s montage and its 16 cost watches (the six kinds and ten things the detector does not count), each a
side question of tiny-vlm's after every clip, on one stream through the real `TurnEngine` (`inf_mllm+recall`, budget
512); beside it the same clips on a stream with no watch. After every clip: the cache's tokens and bytes on both. The
watched cache must hold what the plain one holds (every side question leaves the cache with its answer) and never pass
the budget. Writes `watch_kv.json`.
"""

import random
from pathlib import Path

from models.tiny_vlm.model import TinyVLM

from .common import machine, print_table, record, write
from .natural import compose, encode_pieces
from .watch import BUDGET
from .watch_model import COST_WATCHES, model_watches, stream


def run(args):
    clips = int(args.tokens) if args.tokens else (100 if args.quick else 1000)
    order = compose(random.Random(0), clips)
    vlm = TinyVLM()
    visual = encode_pieces(vlm, set(order))
    watched_bytes, plain_bytes = [], []
    fired, watched, *_ = stream(vlm, visual, order, model_watches(COST_WATCHES, "bench-kv"), ask=False,
                                desc=f"{len(COST_WATCHES)} model watches", kv_bytes=watched_bytes)
    _, plain, *_ = stream(vlm, visual, order, None, ask=False, desc="no watch", kv_bytes=plain_bytes)
    label = f"{len(COST_WATCHES)} model watches"
    of = f"of {clips} clips"
    recs = [record("watch_kv", label, BUDGET, "max_kv_tokens", max(watched), f"budget {BUDGET}, over {clips} clips"),
            record("watch_kv", "no watch", BUDGET, "max_kv_tokens", max(plain), f"budget {BUDGET}, over {clips} clips"),
            record("watch_kv", label, BUDGET, "clips", sum(n > BUDGET for n in watched), f"over the budget, {of}"),
            record("watch_kv", label, BUDGET, "clips_same_kv", sum(a == b for a, b in zip(watched, plain, strict=True)),
                   of),
            record("watch_kv", label, BUDGET, "kv_mb", max(watched_bytes) / 2**20, f"most, over {clips} clips"),
            record("watch_kv", label, BUDGET, "kv_mb", watched_bytes[-1] / 2**20, f"after clip {clips}"),
            record("watch_kv", "no watch", BUDGET, "kv_mb", max(plain_bytes) / 2**20, f"most, over {clips} clips"),
            record("watch_kv", label, BUDGET, "alerts", sum(len(v) for v in fired.values()), of)]
    write(Path(args.out), "watch_kv", recs, [])
    print(f"watch_kv: {clips} clips, {machine().get('cpu')}")
    print_table(recs, ["max_kv_tokens", "clips", "clips_same_kv", "kv_mb", "alerts"])
