"""Gradio chat beside a playing video, with a live memory graph. Depends on `streaming` (never the reverse)."""
