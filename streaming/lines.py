"""What `stream-qa` writes as a stream goes: a clip's progress line (stderr), a clip's record line (--json --clips),
an alert's line (or its record with --json), and an answer's record line (--json) or the line after its streamed
text."""

import json
import sys

from .events import Alert, ClipSeen, Done, Handler, Started, Token, WatchState
from .provenance import notes
from .watches import alert_line


def clip_record(meta: dict) -> dict:
    """What `--json --clips` prints of a clip: its times, words and the detector's objects and boxes."""
    keys = ("clip", "start", "end", "seen", "objects", "counted_at", "boxes", "merged", "into", "since")
    return {k: meta[k] for k in keys if k in meta}


def clip_line(meta: dict, session, telemetry, objects: bool = True) -> str:
    """A clip's progress line, from its clip-log entry: its end time, the cache's size, ingest speed, drops, what
    the change gate let pass and (`objects`) what the detector saw (a merged clip: since when nothing changed)."""
    from models.detector import plural  # here: torch has loaded by now

    seen = meta.get("objects") if objects else None
    return (f"[{meta['end']:7.1f}s] clip {meta['clip']:4d} | kv {session.kv_tokens} tok "
            f"{session.kv_bytes / 2**20:.1f} MB | ingest {telemetry.ingest_speed:.1f}x real time"
            + (f" | dropped {telemetry.dropped}" if telemetry.dropped else "")
            + (f" | gated {telemetry.gated} frames ({telemetry.merged} clips merged)" if telemetry.merged else "")
            + (f" | unchanged since {meta['since']:.1f}s (clip {meta['into']})" if meta.get("merged") else "")
            + (f" | sees {', '.join(f'{n} {plural(w) if n > 1 else w}' for w, n in seen.items()) or 'nothing'}"
               if seen is not None else ""))


def print_clip(out, meta: dict) -> None:
    """A clip's record line (--json --clips): its times, words and detections."""
    out.write(json.dumps(clip_record(meta)) + "\n")
    out.flush()


def print_answer(args, out, answer, folder) -> None:
    """An answer's record line (--json), or the line after its streamed text; kept in a session folder."""
    if folder is not None:
        folder.write_answer(answer)
    if args.json:
        out.write(json.dumps(answer.as_dict()) + "\n")
    else:
        out.write(f"   ({answer.ttft_s:.2f} s to first token, {answer.kv_tokens} KV tokens; {notes(answer)})\n")
    out.flush()


class Printed(Handler):
    """What `stream-qa` writes of one stream's events: each clip's progress line on stderr (and its record with
    `--json --clips`), each question and its answer's text as it comes, then the answer's record line; the clips and
    the answers kept in the session folder (`folder`) first."""

    def __init__(self, args, out, engine, folder=None, deliverers=()):
        self.args, self.out, self.engine, self.folder, self.deliverers = args, out, engine, folder, list(deliverers)

    def on_clip_seen(self, event: ClipSeen) -> None:
        print(clip_line(event.clip, self.engine.session, self.engine.telemetry), file=sys.stderr)
        if self.args.json and self.args.clips:
            print_clip(self.out, event.clip)
        if self.folder is not None:
            self.folder.write_clip(event.clip)

    def on_alert(self, event: Alert) -> None:  # in the folder already (`Watches.judge`)
        for deliverer in self.deliverers:  # webhooks, a broker: queued, so a slow receiver never holds up the stream
            deliverer.put(event)
        self.out.write((json.dumps(event.alert) if self.args.json else alert_line(event.alert)) + "\n")
        self.out.flush()

    def on_watch_state(self, event: WatchState) -> None:
        for deliverer in self.deliverers:  # a home-automation sensor follows the condition
            deliverer.put(event)

    def on_started(self, event: Started) -> None:
        if not self.args.json:
            self.out.write(f"[{event.video_t:7.1f}s] Q: {event.question}\n{'':11}A: ")
            self.out.flush()

    def on_token(self, event: Token) -> None:
        if not self.args.json:
            self.out.write(event.text)
            self.out.flush()

    def on_done(self, event: Done) -> None:
        print_answer(self.args, self.out, event.answer, self.folder)
