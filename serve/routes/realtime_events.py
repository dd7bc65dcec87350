"""What a Realtime client's events may carry (`routes/realtime.py`), read and checked before anything is done:
the session settings of a `session.update` and a user message's parts; and a question's events told back as the
protocol's `response.*` events (`Told`)."""

import uuid
from dataclasses import replace

from pydantic import ValidationError

from streaming.events import Done, Handler, Started, Token, Unanswered
from streaming.hosted import Settings, unknown_model

from ..schema import SessionSettings
from ..sessions import Refused
from .chat import image_bytes

MAX_PARTS = 64  # content parts of one item
MAX_INSTRUCTIONS = 4000
AUDIO_EVENTS = ("input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                "output_audio_buffer.clear")
NOT_HERE = {"conversation.item.delete", "conversation.item.retrieve", "conversation.item.truncate",
            "response.cancel", "transcription_session.update"}
HANDLED = ("session.update", "conversation.item.create", "response.create")
CLIENT_EVENTS = {*HANDLED, *AUDIO_EVENTS, *NOT_HERE}  # every type a metric counts by name (others: "other")
# OpenAI's session fields this server reads or can leave aside; any other is refused
SESSION_KEYS = {"type", "object", "id", "model", "instructions", "output_modalities", "max_output_tokens", "audio",
                "tools", "tool_choice", "include", "tracing", "truncation", "prompt", "reasoning",
                "parallel_tool_calls", "expires_at", "stream_qa"}


class BadEvent(Exception):
    """An event this connection answers with an `error` event: its code and one line."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def said(err: Refused) -> str:
    """A route's refusal as an `error` event says it: its line, and when to retry."""
    return err.message + (f"; retry in {err.retry_after:g} s" if err.retry_after else "")


def read_session(session, current: Settings, instructions: str, models: list[str]) -> tuple[Settings, str]:
    """A `session.update`'s session: (the settings it leaves, the instructions it leaves)."""
    if not isinstance(session, dict):
        raise BadEvent("invalid_event", "session.update needs a 'session' object", "session")
    unknown = sorted(set(session) - SESSION_KEYS)
    if unknown:
        raise BadEvent("unknown_parameter", f"session.{unknown[0][:60]}: unknown field; known: "
                                            f"{', '.join(sorted(SESSION_KEYS))}", f"session.{unknown[0][:60]}")
    text_only(session, "session")
    if session.get("tools"):
        raise BadEvent("tools_not_supported", "this server calls no tools", "session.tools")
    instructions = session.get("instructions", instructions)
    if not isinstance(instructions, str) or len(instructions) > MAX_INSTRUCTIONS:
        raise BadEvent("invalid_value", f"instructions: a string of at most {MAX_INSTRUCTIONS} characters",
                       "session.instructions")
    return _settings(session, current, models), instructions


def _settings(session: dict, current: Settings, models: list[str]) -> Settings:
    """The settings with what the update changes: `stream_qa`'s keys, `model`, `max_output_tokens`."""
    changes = session.get("stream_qa") or {}
    if not isinstance(changes, dict):
        raise BadEvent("invalid_value", "stream_qa: an object of session settings", "session.stream_qa")
    changes = dict(changes)
    if session.get("model") is not None:
        changes["model"] = session["model"]
    tokens = session.get("max_output_tokens")
    if tokens is not None and tokens != "inf":
        changes["max_new_tokens"] = tokens
    try:
        checked = SessionSettings.model_validate(current.as_dict() | changes)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise BadEvent("unknown_parameter", f"stream_qa.{where[:60]}: unknown setting; known: "
                                                f"{', '.join(SessionSettings.model_fields)}") from None
        raise BadEvent("invalid_value", f"stream_qa.{where}: {first['msg']}", f"session.stream_qa.{where}") from None
    if (why := unknown_model(checked.model, models)) is not None:
        raise BadEvent("model_not_found", why)
    return replace(current, **checked.model_dump())


def read_parts(content, max_bytes: int) -> tuple[list[tuple[bytes, float | None]], list[str]]:
    """(frames: bytes and given time, texts), every part checked before anything is pushed."""
    if not isinstance(content, list) or not content:
        raise BadEvent("invalid_item", "a message's content is a non-empty list of parts", "item.content")
    if len(content) > MAX_PARTS:
        raise BadEvent("invalid_item", f"{len(content)} parts in one item; at most {MAX_PARTS}", "item.content")
    frames, texts = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"item.content[{i}]"
        if kind == "input_image":
            url, t = part.get("image_url"), part.get("t")
            if not isinstance(url, str):
                raise BadEvent("invalid_item", "an input_image part needs its image_url", where)
            if t is not None and not (isinstance(t, int | float) and not isinstance(t, bool)
                                      and 0 <= t <= 1e9):
                raise BadEvent("invalid_value", "t: a video time in seconds, 0 to 1e9", f"{where}.t")
            try:
                frames.append((image_bytes(url, max_bytes), t))
            except Refused as err:
                raise BadEvent("invalid_image", err.message, where) from None
        elif kind == "input_text":
            if not isinstance(part.get("text"), str) or not part["text"].strip():
                raise BadEvent("invalid_item", "an input_text part needs its text", where)
            texts.append(part["text"].strip())
        elif kind == "input_audio":
            raise BadEvent("audio_not_supported", "this server takes images and text, not audio", where)
        else:
            raise BadEvent("invalid_item", f"part type {str(kind)[:40]!r}: this server takes input_image and "
                                           "input_text", where)
    return frames, texts


def text_only(fields: dict, where: str) -> None:
    """Audio asked for in a session or a response: refused in one line."""
    modalities = fields.get("output_modalities")
    if modalities is not None and modalities != ["text"]:
        raise BadEvent("audio_not_supported", "this server answers in text only: output_modalities ['text']",
                       f"{where}.output_modalities")
    if fields.get("audio"):
        raise BadEvent("audio_not_supported", "this server takes images and text, not audio", f"{where}.audio")


class Told(Handler):
    """A question's events as Realtime's `response.*` events (every method a coroutine: each sends)."""

    def __init__(self, connection, answering, where: dict, item: dict, response: dict):
        self.connection, self.answering, self.where, self.item, self.response = connection, answering, where, item, \
            response
        self.pieces = 0

    async def on_started(self, event: Started) -> None:
        return None

    async def on_token(self, event: Token) -> None:
        self.pieces += 1
        await self.connection.send("response.output_text.delta", **self.where, delta=event.text)

    async def on_done(self, event: Done) -> None:
        await self.connection.finish(self.answering.answered(event.answer), self.pieces, self.where, self.item,
                                     self.response)

    async def on_unanswered(self, event: Unanswered) -> None:  # the stream ended before the answer
        failed = {"type": "failed", "error": {"type": "server_error", "message": self.answering.unanswered()}}
        await self.connection.send("response.done", response=self.response | {"status": "failed", "output": [],
                                                                               "status_details": failed})
