"""The HTTP routes, one router a concern: health and metrics, sessions, media (frames, video, the stream's end),
questions, watches (and the events sessions say unasked), and what OpenAI-compatible clients speak (chat; realtime, a
WebSocket). A new route goes in the router of its concern (or a new one listed here)."""

from . import chat, health, media, questions, realtime, sessions, watches

ROUTERS = (health.router, sessions.router, media.router, questions.router, chat.router, realtime.router,
           watches.router)
