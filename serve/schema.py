"""What a client may send: the request bodies, each refusing a field it does not know (pydantic, `extra="forbid"`)."""

from dataclasses import fields
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from models.watch import MAX_CHARS
from streaming.questions import MAX_QUESTION_CHARS
from streaming.settings import BOUNDS, Settings
from streaming.watches import COOLDOWN_S, MAX_WATCHES, REARM_CLIPS

STRICT = ConfigDict(extra="forbid")  # a misspelt field is refused with the known ones, never silently defaulted


class SourceSpec(BaseModel):
    model_config = STRICT
    file: str | None = Field(None, min_length=1, max_length=1024, description="a file inside the server's media folder")
    url: str | None = Field(None, min_length=1, max_length=2048, description="an RTSP or HTTP(S) stream on an allowed "
                            "host")
    realtime: bool = Field(True, description="play a file at its own speed (false: as fast as the model takes it)")
    loops: int = Field(1, ge=1, le=1000)

    @model_validator(mode="after")
    def _names_something(self):
        """A source that names nothing would open a pushed-frames session the client did not ask for."""
        if self.file is None and self.url is None:
            raise PydanticCustomError("source_empty", "names neither a file nor a url (leave source out to push "
                                                      "frames)")
        return self


# what a server takes at most, on top of what a setting needs to work at all (`Settings`' own bounds)
SERVER_LIMITS = {"fps": {"le": 30}, "clip_seconds": {"le": 600}, "window": {"le": 1_000_000},
                 "max_new_tokens": {"le": 512}}


def _field(f):
    """A setting's field as pydantic's: its default, meaning and bounds, within the server's limits."""
    bounds = {k: v for k, v in f.metadata.items() if k in BOUNDS} | SERVER_LIMITS.get(f.name, {})
    return Field(f.default, description=f.metadata["description"], **bounds)


def _from_settings(name: str, **more):
    """A request model whose fields are `streaming.settings.Settings`' own (defaults, bounds, descriptions) within
    the server's limits, and `more`."""
    own = {f.name: (f.type, _field(f)) for f in fields(Settings)}
    return create_model(name, __config__=STRICT, **own, **more)


WatchText = Annotated[str, Field(min_length=1, max_length=MAX_CHARS)]
OpenRequest = _from_settings("OpenRequest", source=(SourceSpec | None, Field(
    None, description="none: the client pushes frames")), watches=(list[WatchText], Field(
        [], max_length=MAX_WATCHES, description="standing conditions in plain words (\"a person\", \"more than 2 "
                                                "cars\", \"the car leaves\"), judged on every clip")))


class WatchRequest(BaseModel):
    model_config = STRICT
    text: WatchText = Field(description="what to watch for, in plain words (\"… @once\": only the first time)")
    cooldown_s: float = Field(COOLDOWN_S, ge=0, le=86_400, allow_inf_nan=False,
                              description="video seconds after an alert before this watch fires again")
    rearm_clips: int = Field(REARM_CLIPS, ge=1, le=1000,
                             description="clips in a row without the condition before this watch fires again")


class AskRequest(BaseModel):
    model_config = STRICT
    text: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    at: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False,
                             description="answer about every frame at or before this video time (seconds), as "
                                         "'… @30s'; without it: about every frame pushed so far (or, for a file or "
                                         "URL the server pulls, up to the time it has played to)")
    stream: bool = Field(True, description="server-sent events (start, token…, answer); false: the record as JSON")


SessionSettings = _from_settings("SessionSettings")  # the settings alone (a Realtime session.update's stream_qa)
MODELS_OF = {"source": SourceSpec, "": OpenRequest}  # where an unknown field sits → the model it does not belong to
