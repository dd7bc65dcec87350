"""Front-end checks shared by `stream-qa` and the app: configuration values checked before any model
loads, the device checked once torch is in, and the line between bad input and a bug.

A `UserError` becomes one line and exit 2. Anything else is a bug: exit 1, and the traceback goes to
a log file whose path the one-line message names, so it is neither lost nor blamed on the user.
"""

import datetime
import math
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

from inf_mllm.spec import parse_budget

from .errors import ConfigError

EXIT_BUG, EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED = 1, 2, 141, 130
MAX_NEW_TOKENS = 4096


def positive(name: str, value: float | None, integer: bool = False) -> None:
    if value is None:
        return
    if not (isinstance(value, int) or math.isfinite(value)) or value <= 0:
        kind = "a whole number ≥ 1" if integer else "a positive number"
        raise ConfigError(f"{name} must be {kind}, got {value}")


def check_budget(text: str) -> None:
    """Tokens per layer ("512"), a memory size ("512MB") or "auto", by the core's own grammar."""
    try:
        parse_budget(text)
    except ValueError as err:
        raise ConfigError(f"--{err}" if str(err).startswith("budget ") else f"--budget: {err}") from None


def check_args(args) -> None:
    """Every number `stream-qa` takes, before torch loads (so a typo costs no model load)."""
    positive("--fps", args.fps)
    positive("--clip-seconds", args.clip_seconds)
    positive("--loop", args.loop, integer=True)
    positive("--max-new-tokens", args.max_new_tokens, integer=True)
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens is at most {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    positive("--window", args.window, integer=True)
    if args.bias is not None and not (math.isfinite(args.bias) and args.bias >= 0):
        raise ConfigError(f"--bias must be a finite number ≥ 0, got {args.bias}")
    if args.webcam is not None and args.webcam < 0:
        raise ConfigError(f"--webcam takes a camera index ≥ 0, got {args.webcam}")
    check_budget(args.budget)
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", args.device):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or mps, got {args.device!r}")


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


def one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


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
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
