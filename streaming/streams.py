"""`stream-qa a.mp4 b.mp4 --webcam 0 …`: several sources in one run, one model, one session pool.

Each source is a stream of its own: its own session (budget, policy, recall store), its own turn engine and
ingest thread, the same questions. The pool (inf_mllm/pool.py) runs every stream's turns on the one model and
batches the answers that are decoding together. Every line says which stream it is about: answers on stdout
(`[stream 2 b.mp4] …`, or JSON with "stream" and "input"), clips and telemetry on stderr. A stream whose source
fails ends with one line, and the others go on; the run's exit status says that one did.
"""

import json
import sys
import threading
from pathlib import Path

from .budgets import compiles_decode, headroom
from .errors import EXIT_BAD_INPUT, ConfigError, UsageError, is_user_error
from .memory import MB, auto_budget
from .provenance import notes


def sources_of(args) -> list[tuple[str, dict]]:
    """Every source the command line names, as (label, open_source arguments)."""
    out = [(Path(v).name, {"video": v}) for v in args.video]
    out += [(f"webcam {w}", {"webcam": w}) for w in args.webcam]
    out += [(u, {"url": u}) for u in args.url]
    return out


def check_several(args, count: int) -> None:
    """What one run of several streams cannot do, said before anything loads."""
    for flag, given in (("--session", args.session), ("--resume", args.resume), ("--soak", args.soak),
                        ("--server", args.server)):
        if given:
            raise UsageError(f"{flag} takes one source; {count} were given")
    if str(args.budget).strip().lower() == "auto":
        raise UsageError("--budget auto sizes one stream from free memory; with several sources give tokens or MB "
                         "per stream (the pool refuses a stream that would not fit)")


def open_sources(args, sources) -> list:
    """(label, opened source) for each: a missing file or a bad URL is refused before the model loads."""
    from .sources import open_source

    return [(label, open_source(**where, fps=args.fps, realtime=not args.fast, loops=args.loop))
            for label, where in sources]


def run_streams(args, sources, questions, spec, adapter, out) -> int:
    """Every (label, source) through its own engine on one pool; returns the exit status (0, or EXIT_BAD_INPUT when
    a stream ended on an error)."""
    from inf_mllm.pool import PoolFull, SessionPool

    from .budgets import open_session
    from .engine import TurnEngine
    from .questions import Schedule
    free = auto_budget(None, args.device)
    compiled = compiles_decode(args.device, args.compile_decode)  # on a GPU: the streams' steps as one CUDA graph
    pool = SessionPool(adapter.model, adapter.tokenizer, kv_bytes=max(0, free.free_bytes - free.reserve_bytes),
                       slots=len(sources) if compiled else 0, compile_decode=compiled)
    lock = threading.Lock()
    engines, failed = [], []
    try:
        for i, (label, source) in enumerate(sources, start=1):
            own = adapter.fork()
            session, _ = pool.call(None, open_session, own, spec, args.budget, args.max_new_tokens, args.device)
            session.cache.reserve(headroom(own, args.max_new_tokens))
            try:
                pooled = pool.admit(session)
            except PoolFull as err:
                raise ConfigError(f"stream {i} ({label}): {err} ({free.explain()})") from None
            engine = TurnEngine(own, pooled, clip_seconds=args.clip_seconds, max_new_tokens=args.max_new_tokens,
                                drop_when_full=source.live)
            engines.append((i, label, engine, pooled, source, Schedule(list(questions))))
        print(f"stream-qa: {len(engines)} streams on one {type(adapter).__name__} (budget {args.budget} tokens a "
              f"layer each; {pool.kv_bytes / MB:.0f} MB for their caches)", file=sys.stderr)

        def play(i, label, engine, session, source, schedule):
            tag = f"[stream {i} {label}]"

            def on_clip(clip):
                t = engine.telemetry
                with lock:
                    print(f"{tag} [{clip.end:7.1f}s] clip {clip.index:4d} | kv {session.kv_tokens} tok "
                          f"{session.kv_bytes / MB:.1f} MB | ingest {t.ingest_speed:.1f}x real time"
                          + (f" | dropped {t.dropped}" if t.dropped else ""), file=sys.stderr)

            try:
                for answer in engine.run(source, schedule, on_clip):
                    with lock:
                        if args.json:
                            out.write(json.dumps({"stream": i, "input": label} | answer.as_dict()) + "\n")
                        else:
                            out.write(f"{tag} [{answer.video_t:7.1f}s] Q: {answer.question}\n{tag} {'':9}A: "
                                      f"{answer.answer}\n{tag} {'':9}({answer.ttft_s:.2f} s to first token, "
                                      f"{answer.kv_tokens} KV tokens; {notes(answer)})\n")
                        out.flush()
            except Exception as err:  # one stream's end: the others go on
                failed.append(i)
                kind = "" if is_user_error(err) else f"{type(err).__name__}: "
                with lock:
                    print(f"stream-qa: stream {i} ({label}) ended: {kind}{str(err).strip().splitlines()[0]}",
                          file=sys.stderr)

        threads = [threading.Thread(target=play, args=item, name=f"stream-{item[0]}", daemon=True)
                   for item in engines]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.2)  # Ctrl-C reaches the main thread between joins
        except KeyboardInterrupt:
            for _, _, engine, *_ in engines:
                engine.close()
            for thread in threads:
                thread.join(timeout=10)
            raise
    finally:
        pool.close()
    return EXIT_BAD_INPUT if failed else 0
