"""Fault injection: the real model made to fail inside a chosen clip turn's prefill.

A fault is raised from a decoder layer halfway through the forward pass, so the layers before it have
already written their keys and values: what the session must roll back is really there. Kinds:
`error` (a RuntimeError, once), `oom` (a simulated `torch.OutOfMemoryError`, on `times` attempts in a
row: each retry is an attempt), and `bug` (a RuntimeError on every clip from the chosen one on).
Disk kinds strike the session folder instead (`inf_mllm.diskio.hook`): `enospc` (the disk fills) and
`erofs` (it turns read-only), from its AT-th write on (1-based; 1: from the start).

`python -m jetson.faults KIND AT [TIMES] -- STREAM-QA ARGS` runs `stream-qa` with the fault in place
(the reliability table does this, one process per case).
"""

import errno
import os
import sys
from contextlib import contextmanager

from inf_mllm import diskio
from streaming.cli import main as stream_qa

DISK_KINDS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}
KINDS = ("error", "oom", "bug", *DISK_KINDS)


class InjectedFault(RuntimeError):
    """Raised where a real prefill would fail; not a user error, so it is treated as a fault."""


@contextmanager
def inject(adapter, kind: str, at: int, times: int = 1):
    """Fail the `at`-th call of `adapter.append_clip` (1-based) and, for `oom`, the next `times - 1` calls."""
    import torch  # not at the top: `main` answers a bad usage before torch loads (the adapter has loaded it by now)

    if kind not in KINDS:
        raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in DISK_KINDS:
        with disk_fault(DISK_KINDS[kind], at) as state:
            yield state
        return
    layers = adapter.model.model.layers
    state = {"calls": 0, "armed": False, "raised": 0}

    def fail_here(module, args):
        if state["armed"]:
            state["armed"] = False
            state["raised"] += 1
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            raise InjectedFault(f"injected fault in clip turn {state['calls']}'s prefill")

    real = adapter.append_clip

    def append_clip(*args, **kwargs):
        state["calls"] += 1
        n = state["calls"]
        state["armed"] = n >= at if kind == "bug" else at <= n < at + (times if kind == "oom" else 1)
        try:
            return real(*args, **kwargs)
        finally:
            state["armed"] = False

    hook = layers[len(layers) // 2].register_forward_pre_hook(fail_here)
    adapter.append_clip = append_clip  # the instance attribute shadows the method
    try:
        yield state
    finally:
        hook.remove()
        del adapter.append_clip


@contextmanager
def disk_fault(code: int, at: int):
    """Every write of the session folder from the `at`-th on (1-based) fails with `code` (ENOSPC, EROFS)."""
    state = {"calls": 0, "raised": 0}

    def hook(op, path, fd, data):
        state["calls"] += 1
        if state["calls"] >= at:
            state["raised"] += 1
            raise OSError(code, os.strerror(code), path)

    previous, diskio.hook = diskio.hook, hook
    try:
        yield state
    finally:
        diskio.hook = previous


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or len(argv[:argv.index("--")]) not in (2, 3):
        print(f"usage: python -m jetson.faults {'|'.join(KINDS)} AT [TIMES] -- STREAM-QA ARGS", file=sys.stderr)
        return 2
    head, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    kind, at, times = head[0], int(head[1]), int(head[2]) if len(head) == 3 else 1
    if kind in DISK_KINDS:  # the disk is faulty from the start: the session folder is opened before the model loads
        with disk_fault(DISK_KINDS[kind], at):
            return stream_qa(rest)
    import models  # loads torch: only once the usage is right

    real = models.load_adapter
    faults = []

    def load(name, path=None, device="cpu"):
        adapter = real(name, path, device=device)
        faults.append(inject(adapter, kind, at, times))
        faults[-1].__enter__()
        return adapter

    models.load_adapter = load
    return stream_qa(rest)


if __name__ == "__main__":
    raise SystemExit(main())
