"""What `stream-qa` writes as a stream goes: a clip's progress line (stderr), a clip's record line (--json --clips),
and an answer's record line (--json) or the line after its streamed text."""

import json

from .provenance import notes


def clip_record(meta: dict) -> dict:
    """What `--json --clips` prints of a clip: its times, words and the detector's objects and boxes."""
    return {k: meta[k] for k in ("clip", "start", "end", "seen", "objects", "counted_at", "boxes") if k in meta}


def clip_line(clip, session, telemetry, objects: bool = True) -> str:
    """A clip's progress line: its end time, the cache's size, ingest speed, drops and (`objects`) what the detector
    saw."""
    from models.detector import plural  # here: torch has loaded by now

    seen = clip.encoded.meta.get("objects") if objects else None
    return (f"[{clip.end:7.1f}s] clip {clip.index:4d} | kv {session.kv_tokens} tok "
            f"{session.kv_bytes / 2**20:.1f} MB | ingest {telemetry.ingest_speed:.1f}x real time"
            + (f" | dropped {telemetry.dropped}" if telemetry.dropped else "")
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
