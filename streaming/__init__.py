"""Frame sources, the turn engine and `stream-qa`. Depends on `models`."""

import os

from . import offline  # noqa: F401  (the libraries' own calls out switched off before they load)

# OpenMP (libgomp, under torch) spins each worker after every parallel region, throttled only while
# more threads than cores are in its teams. Once the ingest thread's team is gone the model thread's
# workers spin at full length (~10 ms after each region), and on a machine whose cores are busy with
# other work the time to first token grew 5-10x. Purely passive waiting puts every worker to sleep
# between the hundreds of matrix products of one prefill, and waking them made an isolated clip turn's
# prefill ~30% slower (`python -m benchmarks prefill`). So: passive, with a short spin first (3,000
# turns, ~0.25 ms; `python -m jetson ompspin` measures all three). Set before torch loads OpenMP, so
# here, where every entry point passes first; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what is set here; a run meant to set its own unsets both
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from .memory import limit_malloc_arenas  # noqa: E402  (after the line above; loads no torch)

limit_malloc_arenas()
