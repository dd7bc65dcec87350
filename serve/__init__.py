"""The streaming-session HTTP server: FastAPI on uvicorn over the session pools of streaming/hosted.py.
Depends on `streaming`; nothing depends on it."""
