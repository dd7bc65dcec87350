"""`python -m serve`: the streaming-session API on http://127.0.0.1:8000 (docs at /docs), on the bundled model.

Bad options end with one line and exit status 2; Ctrl-C or SIGTERM closes every session and stops.
"""

import streaming.offline  # noqa: F401, I001  (first: before uvicorn, the model or the hub client loads)

import argparse
import os
import sys
from pathlib import Path

from .limits import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--media", metavar="DIR", help="the folder sessions may pull video files from (default: none)")
    p.add_argument("--sessions", metavar="DIR", help="keep each session's folder (clips, transcript) here: a session "
                   "continues after a crash or restart at its next request (default: in memory only)")
    p.add_argument("--token", default=os.environ.get("STREAM_QA_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default $STREAM_QA_TOKEN; unset: open)")
    p.add_argument("--model", action="append", metavar="NAME", help="load before serving (default tiny-vlm)")
    p.add_argument("--hf", action="append", default=[], metavar="DIR", help="offer a transformers checkpoint")
    d = ServerConfig()
    p.add_argument("--max-sessions", type=int, default=d.max_sessions)
    p.add_argument("--max-questions", type=int, default=d.max_questions, help="in flight, all sessions together")
    p.add_argument("--max-upload-mb", type=float, default=d.max_upload_mb)
    p.add_argument("--idle", type=float, default=d.idle_s, metavar="S", help="close a session idle this long")
    p.add_argument("--allow-url-host", action="append", default=[], metavar="HOST",
                   help="open source URLs on HOST whatever it resolves to (a camera on the LAN; 127.0.0.1 for a "
                        "stream on this machine); may be repeated. Otherwise only public addresses are opened")
    p.add_argument("--allow-private-urls", action="store_true",
                   help="open source URLs that resolve to private or link-local addresses (loopback still needs "
                        "--allow-url-host)")
    p.add_argument("--max-session-questions", type=int, default=d.max_session_questions,
                   help="one session's questions waiting at once (for video time or a turn)")
    p.add_argument("--realtime-fps", type=float, default=d.realtime_fps, metavar="N",
                   help="frames a second one Realtime WebSocket connection may send (/v1/realtime)")
    p.add_argument("--webhook", action="append", default=[], metavar="URL",
                   help="POST every session's alerts here as JSON (at least once, the alert's id as Idempotency-Key; "
                        "under the same URL rules as sources); may be repeated")
    p.add_argument("--mqtt", metavar="URL",
                   help="publish every session's alerts to this MQTT broker, "
                        "mqtt://[USER:PASSWORD@]HOST[:PORT][/PREFIX], with Home Assistant's discovery (under the same "
                        "URL rules as sources)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the model loaders' own progress bars and messages on stderr too (hidden by default)")
    p.add_argument("--sse-batch-ms", type=float, default=d.sse_batch_ms, metavar="MS",
                   help="send an answer's tokens (after its first) that come within MS of each other as one chunk "
                        "(default 0: each at once; behind a proxy each chunk costs a hop)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    media = Path(args.media).expanduser() if args.media else None
    if media is not None and not media.is_dir():
        print(f"python -m serve: --media {args.media}: no such folder", file=sys.stderr)
        return 2
    try:
        config = ServerConfig.parse(dict(
            media=media, token=args.token or None, max_sessions=args.max_sessions, max_questions=args.max_questions,
            max_upload_mb=args.max_upload_mb, idle_s=args.idle, sse_batch_ms=args.sse_batch_ms,
            allow_url_hosts=tuple(args.allow_url_host), allow_private_urls=args.allow_private_urls,
            max_session_questions=args.max_session_questions, realtime_fps=args.realtime_fps,
            preload=tuple(args.model or ("tiny-vlm",)), webhooks=tuple(args.webhook), mqtt=args.mqtt))
    except ValueError as err:  # the option's name as the user typed it
        option = {"idle_s": "idle"}.get(str(err).split()[0], str(err).split()[0]).replace("_", "-")
        print(f"python -m serve: --{option} {str(err).split(' ', 1)[1]}", file=sys.stderr)
        return 2
    from streaming.mqtt import Mqtt
    from streaming.urls import UrlRefused
    from streaming.webhooks import Webhooks

    for flag, check in (("--webhook", lambda: Webhooks.check(config.webhooks, config.url_policy)),
                        ("--mqtt", lambda: config.mqtt and Mqtt.check(config.mqtt, config.url_policy))):
        try:
            check()
        except UrlRefused as err:
            print(f"python -m serve: {flag}: {err}", file=sys.stderr)
            return 2
    import uvicorn

    from models.quiet import quiet_loaders
    from streaming.hosted import Host

    if not args.verbose:
        quiet_loaders()

    from .api import create_app

    try:
        host = Host()
        offered = [host.add_checkpoint(folder) for folder in args.hf]
    except (ValueError, OSError) as err:
        print(f"python -m serve: --hf: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    sessions = Path(args.sessions).expanduser() if args.sessions else None
    if sessions is not None:
        try:
            sessions.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(f"python -m serve: --sessions {args.sessions}: {err.strerror}", file=sys.stderr)
            return 2
    config.sessions, config.preload = sessions, config.preload + tuple(offered)
    print(f"python -m serve: loading {', '.join(config.preload)}; then http://{args.host}:{args.port} "
          f"(API docs at /docs)", file=sys.stderr, flush=True)
    # h11 (not httptools): its limit on a request's head is what caps header size (64 KB here)
    uvicorn.run(create_app(config, host=host), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5,
                http="h11", h11_max_incomplete_event_size=64 * 1024,
                ws="websockets-sansio", ws_max_size=config.max_message_bytes)  # /v1/realtime: a frame's event at most
    return 0


if __name__ == "__main__":
    sys.exit(main())
