"""Decode speed of this checkout against another (`--old-tree DIR`), interleaved in one run: a change to the answer
loop must not slow it. Each side runs in its own process with its own code, old and new alternating, `--rounds`
times (default 5): a lone session's ms per answer token, and a session pool's ms per batched decode step with one
stream and with four (their ratio is what many streams cost). SmolLM2-135M on the CPU, policy inf_mllm at budget
256, a 300-token turn, then questions answered with 48 (lone) or 32 (pool) tokens. Only what both sides have is
used (`StreamSession`, `SessionPool.open`), so this file runs unchanged on the code before a change.

`python -m benchmarks decode_ab --old-tree DIR [--rounds N] [--out DIR]` -> decode_ab.json.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FIGURES = ("lone_ms_per_token", "pool1_ms_per_step", "pool4_ms_per_step")


def measure() -> dict:
    """This checkout's figures (run from its root)."""
    import threading
    import time

    import torch

    from inf_mllm import StreamSession, load_model
    from inf_mllm.pool import SessionPool

    torch.manual_seed(0)
    model, tok = load_model()
    g = torch.Generator().manual_seed(0)
    turn, question = torch.randint(100, 20000, (1, 300), generator=g), torch.randint(100, 20000, (1, 12), generator=g)

    def lone() -> float:
        session = StreamSession(model, tok, "inf_mllm", budget=256)
        session.append(turn)
        per = []
        for _ in range(3):
            session.append_question(question)
            t0 = time.perf_counter()
            n = sum(1 for _ in session.generate(48, eos_token_id=[]))
            per.append((time.perf_counter() - t0) / n * 1000)
        return statistics.median(per)

    def pooled(streams: int) -> float:
        pool = SessionPool(model, tok)
        sessions = [pool.open("inf_mllm", budget=256, headroom=64) for _ in range(streams)]
        for session in sessions:
            session.append(turn)

        def ask(session):
            session.append_question(question)
            for _ in session.generate(32, eos_token_id=[]):
                continue

        walls = []
        for _ in range(3):
            threads = [threading.Thread(target=ask, args=(s,)) for s in sessions]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            walls.append((time.perf_counter() - t0) / 32 * 1000)
        for session in sessions:
            session.close()
        pool.close()
        return statistics.median(walls)

    return {"lone_ms_per_token": lone(), "pool1_ms_per_step": pooled(1), "pool4_ms_per_step": pooled(4)}


def _side(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    out = subprocess.run([sys.executable, "-P", str(Path(__file__).resolve()), "--measure"], cwd=tree, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args) -> None:
    from streaming.records import machine

    if not args.old_tree:
        raise SystemExit("decode_ab: --old-tree DIR is required (e.g. `git worktree add DIR <commit before>`)")
    sides = {"old": args.old_tree, "new": str(Path.cwd())}
    runs = {name: [] for name in sides}
    for r in range(args.rounds or 5):
        for name, tree in sides.items():
            runs[name].append(_side(tree))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()),
                  file=sys.stderr, flush=True)
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in FIGURES} for name, rs in runs.items()}
    for m in medians.values():
        m["pool4_over_pool1"] = m["pool4_ms_per_step"] / m["pool1_ms_per_step"]
    ratios = {k: medians["new"][k] / medians["old"][k] for k in (*FIGURES, "pool4_over_pool1")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "decode_ab", "machine": machine(), "old_tree": machine(args.old_tree),
              "medians": medians, "new_over_old": ratios, "runs": runs}
    (out / "decode_ab.json").write_text(json.dumps(record, indent=1) + "\n")
    for k, v in ratios.items():
        print(f"{k:22s} old {medians['old'][k]:8.3f}  new {medians['new'][k]:8.3f}  new/old {v:.3f}")


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:  # one side, from that checkout's root
    import streaming  # noqa: F401  (its OpenMP setting, before torch loads)

    print(json.dumps(measure()))
