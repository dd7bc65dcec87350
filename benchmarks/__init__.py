"""The benchmarks (`python -m benchmarks NAME`). `streaming` is imported first for its OpenMP setting
(passive waiting, set before torch loads): without it, timings on a busy machine measured spinning."""

import streaming  # noqa: F401
