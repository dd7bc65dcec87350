"""What libraries print that a user of the commands does not need: progress bars of weights loading (transformers),
and lines printed from C straight to fd 2 (decord, ffmpeg, OpenCV, the TFLite runtime) that a one-line error says
better or that say nothing ("Created TensorFlow Lite XNNPACK delegate for CPU"). `stream-qa -v` keeps the first."""

import os
import sys
from contextlib import contextmanager


@contextmanager
def quiet_native_logs():
    """fd 2 to /dev/null while a native library opens something (one thread, before any telemetry): a file probed
    ("moov atom not found", "ERROR opening"), a TFLite interpreter made."""
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):
        yield
        return
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def quiet_loaders() -> None:
    """transformers' progress bars and its info and warning lines off (a model converts and loads in silence)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
