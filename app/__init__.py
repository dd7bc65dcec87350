"""Gradio chat with a live memory graph (planned: the app issue). Depends on `streaming`."""
