"""fd 2 quieted from several threads at once comes back as it was: several streams' ingest threads load BlazeFace on
their first clip at the same moment, and a stream-qa run of 4-6 streams once printed no line at all on stderr
afterwards (each thread had saved what another had put on fd 2: /dev/null). Run in a child process of its own, since
the failure is the process's stderr lost."""

import subprocess
import sys

CHILD = """
import os, sys, threading
from models.quiet import quiet_native_logs
from models.tiny_vlm.encoder import FrameEncoder
from models.tiny_vlm.perception import Perceiver

def still_stderr():
    mine, null = os.fstat(2), os.stat(os.devnull)
    return (mine.st_ino, mine.st_dev) != (null.st_ino, null.st_dev)

start = threading.Barrier(8)

def quiet():
    start.wait()
    for _ in range(200):
        with quiet_native_logs():
            pass

threads = [threading.Thread(target=quiet) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print("bare", still_stderr())
perceiver = Perceiver("detect+tiles@0.2+person", FrameEncoder(runtime="torch").backbone)
start = threading.Barrier(6)

def faces():
    start.wait()
    perceiver.faces

threads = [threading.Thread(target=faces) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
print("faces", still_stderr(), len({id(perceiver.faces)}))
print("said on stderr", file=sys.stderr)
"""


def test_stderr_survives_threads_quieting_it_at_once():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["bare True", "faces True 1"]
    assert "said on stderr" in done.stderr
