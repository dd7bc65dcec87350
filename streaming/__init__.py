"""Frame sources, the turn engine and `stream-qa`. Depends on `models`."""

import os

# OpenMP (libgomp, under torch) spins each worker after every parallel region, throttled only while
# more threads than cores are in its teams. Once the ingest thread's team is gone the model thread's
# workers spin at full length, and on a machine whose cores are busy with other work the time to
# first token grew 5-10x (measured: `python -m jetson ompspin`). Passive waiting costs nothing here.
# It must be set before torch loads OpenMP, so here, where every entry point passes first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .memory import limit_malloc_arenas  # noqa: E402  (after the line above; loads no torch)

limit_malloc_arenas()
