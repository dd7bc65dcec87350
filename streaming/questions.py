"""When questions are asked: at a video time (`"what is it? @30s"`), every N seconds, or as soon as typed.

A question at video time t is answered once every frame at or before t has gone in (the clip open at t is
closed there for it), and its answer is stamped t; a question without a time is answered at the next turn
boundary (a live front end first gives it the time it was asked: `LiveSession.ask`).
"""

import re
from dataclasses import dataclass
from pathlib import Path

from models.intent import seconds

from .errors import UserError

# a typical question: what a budget must hold besides a clip turn is sized with it
SAMPLE_QUESTION = "what is the color of the shape?"

MAX_QUESTION_CHARS = 2000  # ~500 tokens: a question's prefill stays well under a second on a CPU


class QuestionError(UserError):
    """A question or schedule the user wrote cannot be read; one line for the user."""


@dataclass(frozen=True)
class Question:
    text: str
    at: float | None = None  # video seconds; None: at the next turn boundary


def parse_time(text: str) -> float:
    """Seconds from "90", "90s", "1m30s", "1h", "1:30" or "1:02:03"."""
    try:
        return seconds(text)
    except ValueError as err:
        raise QuestionError(str(err)) from None


def parse_ask(text: str) -> Question:
    """"question" or "question @time". A trailing "@word" is meant as a time: one that is not ("@banana") is refused
    rather than asked as part of the question; an "@" followed by a space and a word is part of the question."""
    body, at, after = text.rpartition("@")
    when = after.strip()
    if not (at and body.strip() and when) or any(c.isspace() for c in when):
        return Question(_clean(text))
    if re.match(r"-\s*\d", when):
        raise QuestionError(f"a video time cannot be negative: @{when}")
    if not when[:1].isdigit() and after[:1].isspace():  # "email me @ home"
        return Question(_clean(text))
    try:
        return Question(_clean(body), parse_time(when))
    except QuestionError:
        raise QuestionError(f"@{when[:40]} is not a video time: end a question with one as @30s, @1m30s or @1:30 "
                            "(an @ followed by a space is part of the question)") from None


def _clean(text: str) -> str:
    text = text.strip()
    if not text:
        raise QuestionError("empty question")
    if len(text) > MAX_QUESTION_CHARS:
        raise QuestionError(f"a question of {len(text):,} characters is too long: at most {MAX_QUESTION_CHARS:,}")
    return text


def check_times(questions: list[Question], end: float | None) -> None:
    """A question timed after the end of a file would never be asked at its time: say so now."""
    if end is None:
        return
    for q in questions:
        if q.at is not None and q.at > end:
            raise QuestionError(f"{q.text[:40]!r} is asked at {q.at:g} s but the video ends at {end:g} s")


def every(interval: str | float, text: str, until: float) -> list[Question]:
    """The same question at interval, 2·interval, … up to video time `until`."""
    step = parse_time(interval) if isinstance(interval, str) else float(interval)
    if step <= 0:
        raise QuestionError(f"--every must be a positive time, got {interval!r}")
    n = int(until // step)
    return [Question(_clean(text), step * k) for k in range(1, n + 1)]


def read_file(path) -> list[Question]:
    """One question per line, optionally ending in "@time"; blank lines and # comments are skipped."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise QuestionError(f"cannot read question file {path}: {err.strerror}") from err
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise QuestionError(f"question file {path} is not UTF-8 text (byte {err.start})") from err
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out.append(parse_ask(line))
        except QuestionError as err:
            raise QuestionError(f"{path}:{n}: {err}") from err
    if not out:
        raise QuestionError(f"question file {path} holds no questions")
    return out


class Schedule:
    """Timed questions in video-time order, popped as the video reaches them."""

    def __init__(self, questions: list[Question]):
        self.timed = sorted((q for q in questions if q.at is not None), key=lambda q: q.at)
        self.now = [q for q in questions if q.at is None]

    def due(self, video_t: float) -> list[Question]:
        out, self.now = self.now, []
        while self.timed and self.timed[0].at <= video_t:
            out.append(self.timed.pop(0))
        return out

    def add(self, question: Question) -> None:
        if question.at is None:
            self.now.append(question)
        else:
            self.timed.append(question)
            self.timed.sort(key=lambda q: q.at)

    def rest(self) -> list[Question]:
        out, self.now, self.timed = self.now + self.timed, [], []
        return out

    def times(self) -> list[float]:
        """When the timed questions are asked: ingest closes a clip at each (`clips.Cuts`)."""
        return [q.at for q in self.timed]
