"""Front-end checks shared by `stream-qa` and the app: configuration values checked before any model
loads, the device checked once torch is in, and the line between bad input and a bug.

A `UserError` becomes one line and exit 2. Anything else is a bug: exit 1, and the traceback goes to
a log file whose path the one-line message names, so it is neither lost nor blamed on the user.
"""

import contextlib
import datetime
import math
import os
import re
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from inf_mllm.spec import parse_budget

from .errors import EXIT_INTERRUPTED, ConfigError, OutputError, one_line
from .settings import check_options, option_names

MAX_NEW_TOKENS = 4096
# stream-qa's settings options checked by their fields' bounds (the policy and the budget by their own grammar)
SETTING_OPTIONS = tuple(name for name in option_names() if name not in ("policy", "budget"))


def positive(name: str, value: float | None, integer: bool = False) -> None:
    if value is None:
        return
    if not (isinstance(value, int) or math.isfinite(value)) or value <= 0:
        kind = "a whole number ≥ 1" if integer else "a positive number"
        raise ConfigError(f"{name} must be {kind}, got {value}")


def check_budget(text: str, model: str | None = None) -> None:
    """Tokens per layer ("512"), a memory size ("512MB") or "auto", by the core's own grammar; in tokens, at least
    what one clip turn and a question of `model` take (`models.Adapter.least_budget`: known before it loads)."""
    import models  # the registry only: no torch

    try:
        budget = parse_budget(text)
    except ValueError as err:
        raise ConfigError(f"--{err}" if str(err).startswith("budget ") else f"--budget: {err}") from None
    least = models.ADAPTERS[model].least_budget if model in models.ADAPTERS else 1
    if budget.tokens is not None and budget.tokens < least:
        tokens = f"{budget.tokens} token{'s' if budget.tokens > 1 else ''}"
        raise ConfigError(f"budget of {tokens} per layer cannot hold one clip turn and a question of {model} "
                          f"({least} tokens): raise --budget")


def check_args(args) -> None:
    """Every number `stream-qa` takes, before torch loads (so a typo costs no model load)."""
    check_options(args, SETTING_OPTIONS, {"max_new_tokens": {"le": MAX_NEW_TOKENS}})
    positive("--loop", args.loop, integer=True)
    for webcam in args.webcam if isinstance(args.webcam, list) else [args.webcam]:  # several sources: a list
        if webcam is not None and webcam < 0:
            raise ConfigError(f"--webcam takes a camera index ≥ 0, got {webcam}")
    model = args.model[0] if isinstance(args.model, list) else args.model
    check_budget(args.budget, model if bounded(args) else None)
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", args.device):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or mps, got {args.device!r}")


def bounded(args) -> bool:
    """Whether --policy keeps a budget (a policy that does not parse is said later, by `policy_spec`)."""
    from inf_mllm.spec import PolicySpec

    try:
        return PolicySpec.parse(args.policy).bounded
    except ValueError:
        return True


def check_output_file(option: str, path: str) -> None:
    """A file stream-qa will write: its folder must exist and be a folder, known before the model loads."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist" if not folder.exists() else
                          f"{option} {path}: {folder} is not a folder")
    if Path(path).is_dir():
        raise ConfigError(f"{option} {path} is a folder: give a file name")


def check_context(budget: int, headroom: int, context: int) -> None:
    """A budget whose cache, with one clip turn, a question and an answer on top (`headroom`), would run past the
    positions the model was trained on: refused, with the largest budget that fits."""
    if budget + headroom > context:
        raise ConfigError(f"budget of {budget:,} tokens per layer runs past the model's context of {context:,} "
                          f"positions once a clip turn, a question and an answer are added ({headroom} tokens): "
                          f"use --budget {max(context - headroom, 1)} or less")


def check_device(device: str) -> None:
    """After torch is imported: the device asked for exists here."""
    import torch  # lazy: called once torch is in; the checks above run before it loads

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA GPU is usable here (torch {torch.__version__}"
                              f"{'' if torch.version.cuda else ', a CPU-only build'}); use --device cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps: Apple's MPS backend is not available here; use --device cpu")


def log_dir() -> Path:
    """$STREAM_QA_LOG_DIR, else logs/ in the project cache ($INF_MLLM_CACHE or ~/.cache/inf_mllm)."""
    if os.environ.get("STREAM_QA_LOG_DIR"):
        return Path(os.environ["STREAM_QA_LOG_DIR"])
    return Path(os.environ.get("INF_MLLM_CACHE", Path.home() / ".cache" / "inf_mllm")) / "logs"


def write_bug_report(err: BaseException, prog: str = "stream-qa", argv=None) -> Path:
    """The full traceback (ingest-thread errors keep theirs) in a new file; its path is returned."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = (f"{prog} {' '.join(sys.argv[1:] if argv is None else argv)}\npython {sys.version.split()[0]}\n\n"
            + "".join(traceback.format_exception(type(err), err, err.__traceback__)))
    for folder in (log_dir(), Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{prog}-{stamp}-{os.getpid()}.log"
            path.write_text(text)
            return path
        except OSError:
            continue
    raise err


def detach_stdout() -> None:
    """The reader of stdout has gone (`| head -1`): point fd 1 at /dev/null so the interpreter's final
    flush does not raise a second BrokenPipeError at exit."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class CheckedStdout:
    """stdout for the answers: a write that fails for lack of space or a dead device is one user-facing line
    (`OutputError`), not an internal error. A reader that left (EPIPE) stays a BrokenPipeError: exit 141. It knows
    whether a line is open, so a stop mid-answer can end that line, marked as cut, before exiting."""

    def __init__(self, stream):
        self.stream = stream
        self.mid_line = False  # the last write left a line open (an answer being streamed)

    def _fault(self, err: OSError) -> OutputError:
        return OutputError(f"cannot write the answers to stdout ({err.strerror or err}); the answers given so far "
                           f"are above (and in the session transcript with --session)")

    def write(self, text: str) -> int:
        if text:
            self.mid_line = not text.endswith("\n")
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise self._fault(err) from err

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise self._fault(err) from err


def checked_stdout() -> CheckedStdout:
    """stdout, checked before the model loads: closed (`>&-`) or going to a full device is known now."""
    import stat

    try:
        st = os.fstat(1)
    except OSError:
        st = None
    if sys.stdout is None or st is None:
        raise OutputError("stdout is closed (>&-): the answers have nowhere to go; redirect it to a file or "
                          "/dev/null instead")
    full = stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 7)  # /dev/full
    if stat.S_ISREG(st.st_mode):
        with contextlib.suppress(OSError):
            vfs = os.fstatvfs(1)
            full = vfs.f_bavail == 0 and vfs.f_blocks > 0
    if full:
        raise OutputError("stdout goes to a full disk (no space left): the answers could not be written; free "
                          "some space or write them elsewhere")
    return CheckedStdout(sys.stdout)


class Stopped(KeyboardInterrupt):
    """A signal that ends the run like Ctrl-C (every answer given so far flushed); `signum` sets the exit status."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


# a stop signal ends as 128 + its number, as a shell reports a process it killed: SIGTERM 143, SIGHUP (the
# terminal closed) 129, SIGQUIT (Ctrl-backslash) 131; Ctrl-C 130
STOP_STATUS = {signum: 128 + signum for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}


def stop_on_signals() -> None:
    for signum in STOP_STATUS:
        signal.signal(signum, _stop)


def stop_status(stop: KeyboardInterrupt) -> int:
    return STOP_STATUS.get(getattr(stop, "signum", None), EXIT_INTERRUPTED)


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the CLI: a library's warning as the one line a user reads."""
    print(f"warning: {one_line(message) if isinstance(message, BaseException) else message}", file=sys.stderr,
          flush=True)
