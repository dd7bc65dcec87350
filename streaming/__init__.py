"""Frame sources, the turn engine and `stream-qa`. Depends on `models`."""

import os

# OpenMP (libgomp, under torch) spins each worker after every parallel region, throttled only while
# more threads than cores are in its teams. Once the ingest thread's team is gone the model thread's
# workers spin at full length, and on a machine whose cores are busy with other work the time to
# first token grew 5-10x (measured: `python -m jetson ompspin`). Passive waiting costs nothing here.
# It must be set before torch loads OpenMP, so here, where every entry point passes first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _limit_malloc_arenas(count: int = 2) -> None:
    """glibc gives new threads new malloc arenas (up to 8 per core), and an arena keeps what its thread
    freed: with an ingest thread per engine, RSS grew 58 MB over 80 engines in one run of five
    (`test_100_engines_…`), and 3-10 MB with two arenas. A user's MALLOC_ARENA_MAX wins."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return
    mallopt = getattr(libc, "mallopt", None)  # glibc only
    if mallopt is not None:
        m_arena_max = -8
        mallopt(m_arena_max, count)


_limit_malloc_arenas()
