"""The server under the hostile set (issue 61): `python -m benchmarks hostile [--quick]`.

One `python -m serve` on loopback (the reliability table's token and limits, room for 10 sessions) holds 4
well-behaved sessions, each having played the bundled clip (pulled from the media folder, 1 fps, 2 s clips, as fast
as the model takes it). They are asked plain questions, all 4 at once, round after round: first on a quiet server,
then while every row of the server's reliability table (`jetson/reliability/server.py`, the hostile rows included)
runs against the same server from another thread, until the table is done. Reported: the well-behaved questions'
time to first token (p50, p95) quiet and under attack, and the ratio of the p95s (issue 61's goal: ≤ 2×); the rows
(as expected, and how many answered 500: the goal is 0); the server's RSS before the table, after it, and its
largest rise above that baseline after any row.
"""

import tempfile
import threading
import time
from pathlib import Path

import psutil

from .common import print_table, record, write
from .serve import QUESTIONS, _ask_there, _at_once, _p

STREAMS = 4


def run(args):
    from jetson.reliability.server import run_rows
    from jetson.reliability.serving import TOKEN, serving
    from streaming.remote import Client

    quiet_rounds = 2 if args.quick else 6
    limits = {"max_sessions": 10, "max_questions": 12}
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp), **limits) as (url, media, process):
        server = psutil.Process(process.pid)
        client = Client(url, token=TOKEN)
        sessions = [client.open(budget="256", clip_seconds=2.0, source={"file": "bikes.mp4", "realtime": False})
                    for _ in range(STREAMS)]
        try:
            for s in sessions:
                while not s.state()["ended"]:
                    time.sleep(0.1)
            quiet = rounds(sessions, lambda n: n < quiet_rounds)
            baseline = server.memory_info().rss / 2**20
            rss_after, table, done = [], [], threading.Event()

            def attack():
                try:
                    table.extend(run_rows(url, media, pid=process.pid, limits=limits,
                                          each=lambda row: rss_after.append(server.memory_info().rss / 2**20)))
                finally:
                    done.set()

            t0 = time.perf_counter()
            threading.Thread(target=attack, daemon=True).start()
            loud = rounds(sessions, lambda n: not done.is_set())
            table_s = time.perf_counter() - t0
            after = server.memory_info().rss / 2**20
            answered = [s.answer("what is on screen?")["answer"] for s in sessions]
        finally:
            for s in sessions:
                s.close()
            client.close()
    bad = [r for r in table if not r["ok"]]
    five_hundreds = sum(": 500" in r["observed"][:12] or r["observed"].startswith("500") for r in table)
    x = f"{STREAMS} streams"
    recs = [record("hostile", "quiet", 256, "ttft_s", _p(quiet, 50), x),
            record("hostile", "quiet", 256, "ttft_p95_s", _p(quiet, 95), x),
            record("hostile", "quiet", 256, "questions", len(quiet), x),
            record("hostile", "under the hostile set", 256, "ttft_s", _p(loud, 50), x),
            record("hostile", "under the hostile set", 256, "ttft_p95_s", _p(loud, 95), x),
            record("hostile", "under the hostile set", 256, "questions", len(loud), x),
            record("hostile", "under the hostile set", 256, "ratio", _p(loud, 95) / _p(quiet, 95), "p95 / quiet p95"),
            record("hostile", "hostile rows", None, "requests", len(table), "rows"),
            record("hostile", "hostile rows", None, "errors", len(bad), "rows not as expected"),
            record("hostile", "hostile rows", None, "errors", five_hundreds, "answers with status 500"),
            record("hostile", "hostile rows", None, "wall_s", table_s, "the table's run"),
            record("hostile", "server", None, "rss_mb", baseline, "before the table"),
            record("hostile", "server", None, "rss_mb", after, "after the table"),
            record("hostile", "server", None, "rss_mb", max(rss_after) - baseline, "largest rise after a row"),
            record("hostile", "server", None, "answers", sum(bool(a) for a in answered), "well-behaved, after")]
    write(args.out, "hostile", recs, [])
    print_table(recs, ["ttft_s", "ttft_p95_s", "questions", "ratio", "requests", "errors", "wall_s", "rss_mb",
                       "answers"])
    for row in bad:
        print(f"  not as expected: {row['input']}: {row['observed']}")


def rounds(sessions, go_on) -> list[float]:
    """Rounds of the plain questions, all sessions at once, while `go_on(rounds so far)`: each answer's time to
    first token."""
    ttft, n = [], 0
    while go_on(n):
        for text in QUESTIONS:
            times, _ = _at_once([lambda s=s, text=text: _ask_there(s, text) for s in sessions])
            ttft += [first for first, *_ in times]
        n += 1
    return ttft
