"""Gradio chat beside a playing video, with a live memory graph. Depends on `streaming` (never the reverse)."""

import streaming.offline  # noqa: F401  (first: gradio_client and the hub client read its switches when they load)
