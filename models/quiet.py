"""What libraries print that a user of the commands does not need: progress bars of weights loading (transformers),
and lines printed from C straight to fd 2 (decord, ffmpeg, OpenCV, the TFLite runtime) that a one-line error says
better or that say nothing ("Created TensorFlow Lite XNNPACK delegate for CPU"). `stream-qa -v` keeps the first."""

import os
import sys
import threading
from contextlib import contextmanager

# fd 2 is the process's: two threads quieting it at once would each save what the other had put there, and the
# later to restore could leave the process's stderr on /dev/null for good (several streams' ingest threads
# loading BlazeFace on their first clip did: a stream-qa run of 4-6 streams printed no clip line, no warning, no
# error). One quiet stretch at a time, re-entered by the thread that holds it.
_FD2 = threading.RLock()


@contextmanager
def quiet_native_logs():
    """fd 2 to /dev/null while a native library opens something: a file probed ("moov atom not found", "ERROR
    opening"), a TFLite interpreter made. Another thread's line written meanwhile is lost with it, so keep it short."""
    with _FD2:
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
