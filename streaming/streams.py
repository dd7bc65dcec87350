"""`stream-qa a.mp4 b.mp4 --webcam 0 …`: several sources in one run, one model, one session pool.

Each source is a stream of its own: its own session (budget, policy, recall store), its own turn engine and
ingest thread, the same questions. The pool (inf_mllm/pool.py) runs every stream's turns on the one model and
batches the answers that are decoding together. Every line says which stream it is about: answers on stdout
(`[stream 2 b.mp4] …`, or JSON with "stream" and "input"), clips and telemetry on stderr. A stream whose source
fails ends with one line, and the others go on; the run's exit status says that one did.

`--session DIR` keeps each stream in a session folder of its own, DIR/stream-N (settings with its source, span
store, transcript, lock: `session_dir.py`), so a crash loses no answer printed and no clip stored of any stream;
`--resume DIR` continues every stream from its folder, each from its own source.
"""

import json
import re
import sys
import threading
from pathlib import Path

from .budgets import compiles_decode
from .errors import EXIT_BAD_INPUT, ConfigError, UsageError, is_user_error
from .events import Alert, ClipSeen, Done, Handler
from .lines import clip_line, clip_record
from .memory import MB, auto_budget
from .provenance import notes
from .session_dir import SETTINGS, SessionDir
from .settings import settings_of
from .source_spec import SourceSpec
from .watch_options import watching
from .watches import alert_line

SOURCE_KEYS = ("video", "webcam", "url")


def sources_of(args) -> list[tuple[str, dict]]:
    """Every source the command line names, as (label, open_source arguments)."""
    out = [(Path(v).name, {"video": v}) for v in args.video]
    out += [(f"webcam {w}", {"webcam": w}) for w in args.webcam]
    out += [(u, {"url": u}) for u in args.url]
    return out


def stream_folders(root) -> list[Path]:
    """The folders of a several-stream session (DIR/stream-1, stream-2, …) in stream order; [] for anything else."""
    root = Path(root)
    if not root.is_dir() or (root / SETTINGS).exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"stream-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def open_folders(args, sources, defaults: dict) -> tuple[list, list]:
    """--session DIR / --resume DIR with several streams: (sources, one SessionDir per stream, or Nones). Resumed, the
    sources are the folders' own and `args` takes the first folder's other settings (one command started them all);
    `defaults` are the parser's, to tell the options given from those left out."""
    if args.session and args.resume:
        raise UsageError("--session starts a session and --resume continues one: give one of them")
    if not (args.session or args.resume):
        return sources, [None] * len(sources)
    folders = []
    try:
        if args.session:
            for i in range(1, len(sources) + 1):
                folders.append(SessionDir(Path(args.session) / f"stream-{i}", resume=False))
            return sources, folders
        if sources:
            raise UsageError(f"--resume {args.resume} continues its streams from the sources they started with: "
                             "give no video, webcam or URL")
        for path in stream_folders(args.resume):
            folders.append(SessionDir(path, resume=True))
        args.video = args.webcam = args.url = None
        folders[0].resume_args(args, defaults | dict.fromkeys(SOURCE_KEYS))
        sources = []
        for folder in folders:
            where = {k: v for k, v in folder.settings().items() if k in SOURCE_KEYS and v is not None}
            if not where:
                raise ConfigError(f"--resume {folder.path}: {SETTINGS} names no source")
            label = Path(where["video"]).name if "video" in where else \
                f"webcam {where['webcam']}" if "webcam" in where else where["url"]
            sources.append((label, where))
        return sources, folders
    except BaseException:
        for folder in folders:
            folder.close()
        raise


def check_several(args, count: int) -> None:
    """What one run of several streams cannot do, said before anything loads."""
    for flag, given in (("--soak", args.soak), ("--server", args.server), ("--webhook", args.webhook),
                        ("--mqtt", args.mqtt)):
        if given:
            raise UsageError(f"{flag} takes one source; {count} were given")
    if str(args.budget).strip().lower() == "auto":
        raise UsageError("--budget auto sizes one stream from free memory; with several sources give tokens or MB "
                         "per stream (the pool refuses a stream that would not fit)")


def open_sources(args, sources) -> list:
    """(label, opened source) for each: a missing file or a bad URL is refused before the model loads."""
    return [(label, SourceSpec.of(where, fps=args.fps, realtime=not args.fast, loops=args.loop).open())
            for label, where in sources]


def open_here(args, adapter, slots: int = 0):
    """A pool for the run's model (`slots`: streams whose decode steps share one step on fixed shapes; compiled on a
    GPU) and its config: what `open_stream` takes for each stream."""
    from inf_mllm.pool import SessionPool

    from .open import StreamConfig

    compiled = compiles_decode(args.device, args.compile_decode)
    if compiled:
        print("stream-qa: decode steps run compiled on fixed shapes where the cache allows; the first answer "
              "waits for the compile (--no-compile-decode: eager)", file=sys.stderr)
    free = auto_budget(None, args.device) if slots else None  # several streams: their caches within free memory
    pool = SessionPool(adapter.model, adapter.tokenizer, slots=slots or int(compiled), compile_decode=compiled,
                       kv_bytes=max(0, free.free_bytes - free.reserve_bytes) if free else None)
    return pool, StreamConfig(settings_of(args, args.model[0]), args.device), free


def run_streams(args, sources, questions, adapter, out, folders=None, settings=None) -> int:
    """Every (label, source) through its own engine on one pool, each with its session folder if `folders` (resumed,
    or new: `settings[i]` saved in stream i's); returns the exit status (0, or EXIT_BAD_INPUT when a stream ended on
    an error)."""
    pool, config, free = open_here(args, adapter, slots=len(sources))
    folders = folders or [None] * len(sources)
    try:
        streams = [_open_stream(args, pool, config, i, label, source, folder, adapter, questions, free, settings)
                   for i, ((label, source), folder) in enumerate(zip(sources, folders, strict=True), start=1)]
        print(f"stream-qa: {len(streams)} streams on one {type(adapter).__name__} (budget {args.budget} tokens a "
              f"layer each; {pool.admission.kv_bytes / MB:.0f} MB for their caches)", file=sys.stderr)
        lock, failed = threading.Lock(), []
        threads = [threading.Thread(target=_play, args=(args, out, lock, failed, *stream), name=f"stream-{stream[0]}",
                                    daemon=True) for stream in streams]
        _join(threads, [stream[2] for stream in streams])
    finally:
        pool.close()
        for folder in folders:
            if folder is not None:
                folder.close(folder.store)
    return EXIT_BAD_INPUT if failed else 0


def _open_stream(args, pool, config, i, label, source, folder, adapter, questions, free, settings) -> tuple:
    """Stream i's session (its own adapter, admitted to the pool or refused in one line), engine and schedule."""
    from inf_mllm.admission import PoolFull

    from .open import open_stream
    from .questions import Schedule

    try:
        stream = open_stream(config, source, pool, adapter, folder)
    except PoolFull as err:
        raise ConfigError(f"stream {i} ({label}): {err} ({free.explain()})") from None
    asked = list(questions)
    if folder is not None and args.resume:
        resume_at, asked, line = folder.resume_into(stream.session, asked)
        stream.engine.resume(resume_at)
        print(f"stream-qa: stream {i} ({label}): {line}", file=sys.stderr)
    elif folder is not None:
        folder.save_settings(settings[i - 1])
    stream.engine.watches = watching(args, label, folder, stream.engine.resume_at[0])
    return i, label, stream.engine, stream.session, source, Schedule(asked), folder


def _play(args, out, lock, failed: list, i, label, engine, session, source, schedule, folder) -> None:
    """One stream's run on its own thread: its lines tagged with it, under the lock; an error ends it alone."""
    try:
        engine.play(source, schedule, Tagged(args, out, lock, i, label, engine, folder))
    except Exception as err:  # one stream's end: the others go on
        failed.append(i)
        kind = "" if is_user_error(err) else f"{type(err).__name__}: "
        with lock:
            print(f"stream-qa: stream {i} ({label}) ended: {kind}{str(err).strip().splitlines()[0]}", file=sys.stderr)


class Tagged(Handler):
    """What `stream-qa` writes of stream i's events among several: every line tagged with the stream, written under
    the run's `lock`; clips and answers kept in its session folder before they are printed."""

    def __init__(self, args, out, lock, i: int, label: str, engine, folder):
        self.args, self.out, self.lock, self.engine, self.folder = args, out, lock, engine, folder
        self.i, self.label, self.tag = i, label, f"[stream {i} {label}]"

    def on_clip_seen(self, event: ClipSeen) -> None:
        with self.lock:
            line = clip_line(event.clip, self.engine.session, self.engine.telemetry, objects=False)
            print(f"{self.tag} {line}", file=sys.stderr)
            if self.folder is not None:
                self.folder.write_clip(event.clip)
            if self.args.json and getattr(self.args, "clips", False):
                self.out.write(json.dumps({"stream": self.i, "input": self.label, **clip_record(event.clip)}) + "\n")

    def on_alert(self, event: Alert) -> None:
        with self.lock:
            said = json.dumps({"stream": self.i, "input": self.label} | event.alert) if self.args.json else \
                f"{self.tag} {alert_line(event.alert)}"
            self.out.write(said + "\n")
            self.out.flush()

    def on_done(self, event: Done) -> None:
        answer, tag = event.answer, self.tag
        with self.lock:
            if self.folder is not None:  # kept before it is printed: a crash loses nothing printed
                self.folder.write_answer(answer)
            if self.args.json:
                self.out.write(json.dumps({"stream": self.i, "input": self.label} | answer.as_dict()) + "\n")
            else:
                self.out.write(f"{tag} [{answer.video_t:7.1f}s] Q: {answer.question}\n{tag} {'':9}A: "
                               f"{answer.answer}\n{tag} {'':9}({answer.ttft_s:.2f} s to first token, "
                               f"{answer.kv_tokens} KV tokens; {notes(answer)})\n")
            self.out.flush()


def _join(threads: list, engines: list) -> None:
    """Run the streams' threads to their end; Ctrl-C (which reaches the main thread between joins) stops them all."""
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.2)
    except KeyboardInterrupt:
        for engine in engines:
            engine.close()
        for thread in threads:
            thread.join(timeout=10)
        raise
