"""What a stream says, as typed events: one family for every front end.

A question's queue (`LiveSession.ask`) receives `Started`, then `Token`s, then `Done` or `Unanswered`; a stream's
subscribers (`LiveSession.subscribe`) receive `ClipSeen`, `Alert`, `WatchState` and `Dropped`. A consumer (the CLI, the
server's SSE, Realtime, chat completions, the app, the benchmarks) is a `Handler`: `event.to(handler)` calls the one
method for the event's kind, so each consumer dispatches once, and a new kind of event (an alert) is one class here
and one default method on `Handler`, never an `isinstance` ladder in the consumers. Light: nothing here loads torch.
"""

from dataclasses import dataclass
from typing import Any


class Handler:
    """What a consumer does with each kind of event; the defaults ignore it (a consumer handles what it shows).
    Each method may return a value, which `event.to(handler)` returns (an SSE chunk, a page update)."""

    def on_started(self, event: "Started") -> Any:
        return None

    def on_token(self, event: "Token") -> Any:
        return None

    def on_done(self, event: "Done") -> Any:
        return None

    def on_unanswered(self, event: "Unanswered") -> Any:
        return None

    def on_clip_seen(self, event: "ClipSeen") -> Any:
        return None

    def on_dropped(self, event: "Dropped") -> Any:
        return None

    def on_alert(self, event: "Alert") -> Any:
        return None

    def on_watch_state(self, event: "WatchState") -> Any:
        return None


class Event:
    """The base of every event: `to(handler)` calls the handler's method for the event's `kind` (`on_<kind>`), the
    one dispatch of every consumer."""

    kind = ""  # each event class names its kind; `Handler` has an `on_<kind>` for it
    final = False  # the last event a question's queue receives

    def to(self, handler: Handler) -> Any:
        return getattr(handler, f"on_{self.kind}")(self)


@dataclass(frozen=True)
class Started(Event):
    """The question's turn has come: its answer is about the video up to `video_t` seconds."""

    kind = "started"
    video_t: float
    question: str = ""


@dataclass(frozen=True)
class Token(Event):
    """A piece of the answer's text, as the model gave it (or the whole of an answer read off the clip log)."""

    kind = "token"
    text: str


@dataclass(frozen=True)
class Done(Event):
    """The answer's record (`streaming.engine.Answer`); `finish_reason` as OpenAI's: "stop" (the model ended it, or
    the clip log answered) or "length" (it used every token it was allowed)."""

    kind = "done"
    answer: Any
    finish_reason: str = "stop"
    final = True


@dataclass(frozen=True)
class Unanswered(Event):
    """The question will not be answered: the stream ended first, or never reached its time (`reason` says which
    when the session knows; empty when it does not)."""

    kind = "unanswered"
    reason: str = ""
    final = True


@dataclass(frozen=True)
class ClipSeen(Event):
    """A clip went into the cache: its clip-log record (index, video span, words, counts, boxes)."""

    kind = "clip_seen"
    clip: dict


@dataclass(frozen=True)
class Dropped(Event):
    """Frames a live source delivered that ingest could not keep up with (`frames` so far in this stream)."""

    kind = "dropped"
    frames: int



@dataclass(frozen=True)
class Alert(Event):
    """A watch fired on a clip (`streaming.watches.alert_record`: its id, watch, clip, evidence, description, snapshot),
    already in the session folder when this is said."""

    kind = "alert"
    alert: dict


@dataclass(frozen=True)
class WatchState(Event):
    """A watch's condition changed on a clip: `state` (`streaming.watches.Watches.judge`: its session, watch id and
    words, `holds`, the clip and its video time). It holds while its condition does (an alert is its rising edge when
    armed); a home-automation sensor follows it."""

    kind = "watch_state"
    state: dict
