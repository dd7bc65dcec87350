"""`python -m app` (`make ui`): serve the chat on 127.0.0.1 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT honoured)."""

import streaming.offline  # noqa: F401, I001  (first: before gradio or the hub client loads)

import argparse
import os

from models.quiet import quiet_loaders
from streaming.errors import one_line
from streaming.settings import IDLE_CLOSE_S

from streaming.hosted import Host

from .ui import launch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    p.add_argument("--port", type=int, default=int(os.environ["GRADIO_SERVER_PORT"])
                   if os.environ.get("GRADIO_SERVER_PORT") else None, help="default: Gradio's (7860, or the next free)")
    p.add_argument("--idle", type=float, default=IDLE_CLOSE_S,
                   help="seconds without a question before a session is released")
    p.add_argument("--max-upload-mb", type=float, default=200)
    p.add_argument("--clock-speed", type=float, default=1.0,
                   help="video seconds per second when no player reports its position (API clients)")
    p.add_argument("--hf", action="append", default=[], metavar="DIR",
                   help="also offer this transformers checkpoint folder (LLaVA-OneVision, SmolVLM2) as a model")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the model loaders' own progress bars and messages on stderr too (hidden by default)")
    args = p.parse_args(argv)
    if not args.verbose:
        quiet_loaders()
    host = Host()
    for folder in args.hf:
        try:
            print(f"offering {host.add_checkpoint(folder)}")
        except ValueError as err:
            raise SystemExit(f"python -m app: {one_line(err)}") from None
    launch(args.port, idle_s=args.idle, max_upload_mb=args.max_upload_mb, clock_speed=args.clock_speed, host=host)


if __name__ == "__main__":
    main()
