"""Clip turns of several streams packed into one forward (issue 68): this checkout's pool against the checkout in
`--old-tree` (which ran every clip turn alone, one a round), interleaved in one run; without `--old-tree`, against
this checkout's pool taking one clip turn a round (`max_batched_tokens=1`).

tiny-vlm, N = 1, 2, 4 streams on one pool, each its own `inf_mllm+recall` session at budget 256 (the app's and the
server's policy) with its own fork of the adapter. Every stream feeds the same 5 real clips of the bundled bikes.mp4
(1 fps, 2 s, encoded once before timing: perception runs outside the pool's thread and packing does not change it)
as fast as the pool takes them, 3 laps, and asks a plain question after every 5th clip (16 tokens, its end token
allowed). Each side is a worker process of its own with its checkout's code (this file runs there as is: it uses only
what both have), holding its model between rounds; the sides take turns round by round, which goes first turning, so
only one runs at a time. The side started first runs slower by about 7% on the 2-core CI-class machine (two
sides of this checkout: 0.93 of each other at one stream), so the old side is started first. Per side and N: the
aggregate rate of clip turns and answers (work items per second of wall time), the clip turns that shared a
forward, and a lone stream's decode ms/token (stream 1's answers, `TurnStats`).

Writes `packed.json` (records: `rate` items/s, `ratio` new over old, `clips` that shared a forward,
`decode_ms_per_token`) in `--out`.
"""

import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

CLIPS, LAPS, ASK_EVERY = 5, 3, 5
QUESTIONS = ["what is on screen?", "is there a bicycle now?", "did you see a person?", "is there a car?"]
STREAMS = (1, 2, 4)


def encoded_clips(vlm) -> list:
    """The bundled clip's first CLIPS 2-s clips, encoded by the model as ingest would."""
    from streaming.sources import FileSource, bundled_clip

    frames = list(FileSource(bundled_clip(), fps=1.0))
    pairs = [frames[2 * k:2 * k + 2] for k in range(CLIPS)]
    return [(k, pair[0].t, vlm.encode(np.stack([f.rgb for f in pair]), [f.t for f in pair]))
            for k, pair in enumerate(pairs)]


def one_round(vlm, clips, streams: int, max_batched_tokens: int | None) -> dict:
    from inf_mllm.pool import SessionPool

    packs = "max_batched_tokens" in inspect.signature(SessionPool).parameters  # the old tree's pool takes none
    pool = SessionPool(vlm.model, vlm.tokenizer, **({"max_batched_tokens": max_batched_tokens}
                                                    if packs and max_batched_tokens else {}))
    adapters = [vlm.fork() for _ in range(streams)]  # a stream's own adapter, as every product gives it
    sessions = [pool.open(make=lambda a=a: a.new_session("inf_mllm+recall", budget=256)) for a in adapters]
    decode_ms = []

    def play(i: int) -> None:
        own, session, n = adapters[i], sessions[i], 0
        for lap in range(LAPS):
            for k, start, clip in clips:
                index, t = lap * CLIPS + k + 1, lap * 2.0 * CLIPS + start
                own.append_clip(session, clip, index, t, t + 2.0)
                if index % ASK_EVERY == 0:
                    "".join(own.ask(session, QUESTIONS[(i + n) % len(QUESTIONS)], 16))
                    n += 1
                    if i == 0 and session.last.decoded > 1:
                        decode_ms.append(1e3 * session.last.decode_s / session.last.decoded)

    # written out here, not taken from benchmarks/common.py: this runs on the old tree's code too
    threads = [threading.Thread(target=play, args=(i,), name=f"packed-{i}") for i in range(streams)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    out = {"rate": streams * LAPS * CLIPS * (1 + 1 / ASK_EVERY) / wall, "shared": getattr(pool, "turns", 0),
           "decode_ms": statistics.median(decode_ms) if decode_ms else None}
    for session in sessions:
        session.close()
    pool.close()
    return out


def worker(max_batched_tokens: int | None) -> None:
    """A side's process: rounds asked on stdin ("N"), each one's figures as a JSON line on stdout."""
    from models import load_adapter

    vlm = load_adapter("tiny-vlm")
    clips = encoded_clips(vlm)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(one_round(vlm, clips, int(line), max_batched_tokens)), flush=True)


class Side:
    def __init__(self, tree: Path, max_batched_tokens: int | None = None):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["PYTHONPATH"] = str(tree.resolve())
        argv = [sys.executable, "-P", str(Path(__file__).resolve()), str(max_batched_tokens or 0)]
        self.proc = subprocess.Popen(argv, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def round(self, streams: int) -> dict:
        self.proc.stdin.write(f"{streams}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(args) -> None:
    from streaming.records import machine, print_table, record, write

    here = Path(__file__).resolve().parents[1]
    old_name = "old tree" if args.old_tree else "one a round"
    # the side started second is the faster by ~7% on this machine (two sides of the same code: 0.93): the old side
    # starts first, so the bias works against the new code, not for it
    other = Side(Path(args.old_tree)) if args.old_tree else Side(here, 1)
    sides = {"new": Side(here), old_name: other}
    rounds = args.rounds or (2 if args.quick else 5)
    records = []
    try:
        for streams in STREAMS:
            got = {name: [] for name in sides}
            for side in sides.values():
                side.round(streams)  # warm: the first forwards of a shape are slower
            for r in range(rounds):
                for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
                    got[name].append(sides[name].round(streams))
            for name, rows in got.items():
                records += [record("packed", name, 256, "rate", statistics.median(x["rate"] for x in rows), streams),
                            record("packed", name, 256, "clips", statistics.median(x["shared"] for x in rows),
                                   streams)]
                ms = [x["decode_ms"] for x in rows if x["decode_ms"] is not None]
                if ms:
                    records.append(record("packed", name, 256, "decode_ms_per_token", statistics.median(ms), streams))
            ratio = statistics.median(n["rate"] / o["rate"] for n, o in zip(got["new"], got[old_name], strict=True))
            records.append(record("packed", f"new / {old_name}", 256, "ratio", ratio, streams))
            print_table(records, ["rate", "clips", "decode_ms_per_token", "ratio"], lambda x, s=streams: x == s)
    finally:
        for side in sides.values():
            side.close()
    path = write(args.out, "packed", records, [])
    if args.old_tree:  # where the other side's code came from
        data = json.loads(path.read_text())
        data["old_tree"] = machine(args.old_tree)
        path.write_text(json.dumps(data, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":  # a side's worker, run from its checkout's root
    import streaming  # noqa: F401  (its OpenMP setting, before torch loads)

    worker(int(sys.argv[1]) or None)
