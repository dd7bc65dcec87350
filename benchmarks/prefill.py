"""A clip turn's prefill, old path against new (issue 23): the LM head over every position of the turn and K/V
appended by `torch.cat` (transformers' dynamic layers), as every prefill did before issue 23, against the last
position only (all a clip turn or a question needs) and K/V written into preallocated buffers; the middle path
(every position, buffers) tells the two changes apart.

tiny-vlm on the bundled clip, `inf_mllm` at budget 512 with the cache full: the same encoded clip goes in as
a clip turn again and again, the paths alternating turn by turn (one session with buffers, one without), so
all see the same cache size, the same eviction and the same machine load. Medians of `session.last.prefill_s`
(the forward) and of the turn with its eviction, and the old path's over the new one's.

`--old-tree DIR` adds the code the issue measured, whole: a checkout of the commit before issue 23 (`git worktree
add DIR 57ad80a`) prefills the same turn in its own process (`prefill_worker.py`) with its own OpenMP setting,
taking its turn among the paths here. Each round visits the paths in an order drawn anew, and each turn starts
after a 10 ms pause, so no process's OpenMP workers are still spinning from the turn before.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models import load_adapter
from streaming import OPENMP_WAITING
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
    before = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.old_tree:
            torch.save(turn, Path(tmp) / "turn.pt")
            before = OldTree(args.old_tree, Path(tmp) / "turn.pt")
            paths[before.name] = before
        prefill, whole = ({name: [] for name in paths} for _ in range(2))
        try:
            rng = np.random.default_rng(0)  # each round in an order drawn anew: no path always follows another
            order = [str(name) for _ in range(rounds) for name in rng.permutation(list(paths))]
            with torch.inference_mode():
                for name in tqdm(order, desc="prefill", unit="turn"):
                    time.sleep(0.01)
                    if paths[name] is before:
                        prefill_s, evict_s = before.turn()
                    else:
                        static, every = paths[name]
                        session = sessions[static]
                        session.append(inputs_embeds=turn, all_logits=every)
                        prefill_s, evict_s = session.last.prefill_s, session.last.evict_s
                    prefill[name].append(prefill_s)
                    whole[name].append(prefill_s + evict_s)
        finally:
            if before is not None:
                before.close()
    tokens = turn.shape[1]
    records = []
    for name in paths:
        records += [record("prefill", name, BUDGET, "prefill_ms", 1e3 * median(prefill[name]), tokens),
                    record("prefill", f"{name}, with eviction", BUDGET, "prefill_ms", 1e3 * median(whole[name]),
                           tokens)]
    new = PATHS[-1][0]
    olds = {PATHS[0][0]: "old"} | ({before.name: "before issue 23"} if before else {})  # path: its ratio's name
    for old, what in olds.items():
        for label, times in (("prefill", prefill), ("with eviction", whole)):
            ratio = median(times[old]) / median(times[new])
            records.append(record("prefill", f"speed-up, {label} ({what} / new)", BUDGET, "ratio", ratio, tokens))
    print_table(records, ["prefill_ms", "ratio"])
    for old in olds:
        print(f"clip turn of {tokens} tokens, budget {BUDGET}, {rounds} turns per path: prefill "
              f"{1e3 * median(prefill[old]):.1f} ms ({old}) → {1e3 * median(prefill[new]):.1f} ms ({new})")
    write(args.out, "prefill", records, [])


class OldTree:
    """Another checkout's prefill of the same turn, in its own process (`prefill_worker.py`)."""

    def __init__(self, tree: str, turn_path: Path):
        tree = Path(tree).resolve()  # checked by `python -m benchmarks`
        commit = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True)
        self.name = f"before issue 23 ({commit.stdout.strip() or tree.name}), its own process"
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITING}
        env["PYTHONPATH"] = str(tree)
        worker = Path(__file__).with_name("prefill_worker.py")
        self.proc = subprocess.Popen([sys.executable, "-P", str(worker), str(turn_path), str(BUDGET)], cwd=tree,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"--old-tree {tree}: its prefill did not start (exit {self.proc.wait()})")

    def turn(self) -> tuple[float, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        prefill_s, evict_s = self.proc.stdout.readline().split()
        return float(prefill_s), float(evict_s)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
