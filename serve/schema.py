"""What a client may send: the request bodies, each refusing a field it does not know (pydantic, `extra="forbid"`)."""

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid")  # a misspelt field is refused with the known ones, never silently defaulted


class SourceSpec(BaseModel):
    model_config = STRICT
    file: str | None = Field(None, max_length=1024, description="a file inside the server's media folder")
    url: str | None = Field(None, max_length=2048, description="an RTSP or HTTP(S) stream on an allowed host")
    realtime: bool = Field(True, description="play a file at its own speed (false: as fast as the model takes it)")
    loops: int = Field(1, ge=1, le=1000)


class OpenRequest(BaseModel):
    model_config = STRICT
    model: str = Field("tiny-vlm", max_length=200)
    policy: str = Field("inf_mllm+recall", max_length=200, description="as stream-qa --policy")
    budget: str = Field("256", max_length=32, description="as stream-qa --budget: tokens a layer, or a size: 64MB")
    bias: float | None = Field(None, allow_inf_nan=False)
    window: int | None = Field(None, ge=1, le=1_000_000)
    fps: float = Field(1.0, gt=0, le=30, allow_inf_nan=False)
    clip_seconds: float = Field(2.0, gt=0, le=600, allow_inf_nan=False)
    max_new_tokens: int = Field(16, ge=1, le=512)
    source: SourceSpec | None = Field(None, description="none: the client pushes frames")


class AskRequest(BaseModel):
    model_config = STRICT
    text: str = Field(min_length=1, max_length=2000)
    at: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False,
                             description="answer at this video time (seconds), as '… @30s'")
    stream: bool = Field(True, description="server-sent events (start, token…, answer); false: the record as JSON")


MODELS_OF = {"source": SourceSpec, "": OpenRequest}  # where an unknown field sits → the model it does not belong to
