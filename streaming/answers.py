"""What a question got: the answer's text and how it came (its time, speed, the cache's size, what was looked up)."""

from dataclasses import dataclass, field


@dataclass
class Answer:
    video_t: float
    question: str
    answer: str
    ttft_s: float
    tokens_per_s: float
    kv_tokens: int
    kv_mb: float
    rss_mb: float
    recalled: list = field(default_factory=list)  # stored clips linked back for this answer: {clip, start, end}
    looked_up: str = ""  # what the question was read as asking for, and which clip answers it (`intent.py`)
    source: str = "model"  # "model", or "clip log" for when/how-often answers read off the clip log
    # the question and answer as the cache took them (`inf_mllm.session.Exchange`): a session folder's transcript
    # keeps it, so a resumed session puts them back; not part of the record printed
    exchange: dict | None = None

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items() if k != "exchange"}
