"""The server's OpenAI-compatible routes as an OpenAI user meets them: a real `python -m serve` on loopback, the
official `openai` package as a user writes it (no mock), real frames of the bundled clip; the answers compared with
the native routes' for the same frames and question."""

import base64

import httpx
import pytest
from openai import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    OpenAI,
    UnprocessableEntityError,
)

from jetson.reliability.serving import TOKEN, serving
from streaming.remote import Client, encoded
from streaming.sources import FileSource, bundled_clip

QUESTION = "what is on screen?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve_openai"), max_upload_mb=4.0) as running:
        yield running


@pytest.fixture(scope="module")
def frames():
    """The bundled clip's 10 s at 1 fps, as JPEG bytes (what both routes get)."""
    return [encoded(f.rgb) for f in FileSource(bundled_clip(), fps=1.0)]


def content(frames, text=QUESTION, times=None):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(f).decode()}
              | ({} if times is None else {"t": times[i]})} for i, f in enumerate(frames)]
    return parts + [{"type": "text", "text": text}]


def sessions_open(url) -> float:
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("stream_qa_sessions ")))


def native_answer(url, frames, times, question=QUESTION, at=None) -> dict:
    """The native routes' answer about the same frames: pushed at `times`, asked `at` (None: after them)."""
    native = Client(url, token=TOKEN)
    session = native.open()
    try:
        for t, frame in zip(times, frames, strict=True):
            session.push(frame, float(t))
        return session.answer(question, at=at)
    finally:
        session.close()
        native.close()


def test_the_official_client_gets_an_answer_about_every_frame_it_sent_whole_and_streamed(server, frames):
    """Ten 1-fps frames: the answer comes once all ten are in, at the last one's time (9 s), as the native route
    answers asked `at` it, or asked without `at` after pushing them (it used to be answered at 2 s, whatever was in)."""
    url, _, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    assert "tiny-vlm" in [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": content(frames)}]
    whole = client.chat.completions.create(model="tiny-vlm", messages=messages)
    streamed = list(client.chat.completions.create(model="tiny-vlm", messages=messages, stream=True,
                                                   stream_options={"include_usage": True}))
    times = list(range(len(frames)))
    at_last, after = native_answer(url, frames, times, at=9.0), native_answer(url, frames, times)
    answer = whole.choices[0].message.content
    assert answer and answer == at_last["answer"] == after["answer"]  # greedy, same settings, same frames
    assert whole.choices[0].finish_reason == "stop" and whole.object == "chat.completion"
    record = whole.usage.model_extra["stream_qa"]
    assert record["video_t"] == at_last["video_t"] == after["video_t"] == 9.0
    assert record["decoding"] == "greedy" and 0 < record["kv_tokens"] <= 256 + 64  # budget + turn, answer
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens == record["kv_tokens"]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text.strip() == answer
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert streamed[-1].usage.model_extra["stream_qa"]["video_t"] == 9.0
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
    assert sessions_open(url) == 0  # each completion's session closed after it


def test_frames_late_in_the_video_and_a_tool_s_temperature_are_answered_about_those_frames(server, frames):
    """Frames 4-7 s alone, with their times: the answer is about them, at 7 s (it used to be at 2.0, about none of
    them); a tool's usual temperature 0.7 is taken and the answer says it was decoded greedily."""
    url, _, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
    late, times = frames[4:8], [4.0, 5.0, 6.0, 7.0]
    question = "is there a bicycle?"
    reply = client.chat.completions.create(model="tiny-vlm", temperature=0.7, top_p=1, messages=[
        {"role": "user", "content": content(late, question, times)}])
    record = reply.usage.model_extra["stream_qa"]
    assert record["video_t"] == 7.0 and record["decoding"] == "greedy (temperature 0.7 taken, not applied)"
    assert reply.choices[0].message.content == native_answer(url, late, times, question, at=7.0)["answer"]


def test_bad_requests_through_the_official_client_are_its_errors_and_the_server_keeps_answering(server, frames):
    url, _, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
    one = content(frames[:2])
    hi = {"type": "text", "text": "hi"}
    cases = [
        (BadRequestError, "fetches no URL", dict(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.2/cam.jpg"}}, hi]}])),
        (BadRequestError, "no frames", dict(messages=[{"role": "user", "content": QUESTION}])),
        (BadRequestError, "no question", dict(messages=[{"role": "user", "content": content(frames[:2], "")[:-1]}])),
        (BadRequestError, "does not decode", dict(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, hi]}])),
        (NotFoundError, "unknown model", dict(model="gpt-4o", messages=[{"role": "user", "content": one}])),
        (UnprocessableEntityError, "temperature", dict(messages=[{"role": "user", "content": one}], temperature=3)),
        (UnprocessableEntityError, "n", dict(messages=[{"role": "user", "content": one}], n=2)),
        (UnprocessableEntityError, "audio", dict(messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])),
    ]
    for error, said, kwargs in cases:
        with pytest.raises(error) as caught:
            client.chat.completions.create(**({"model": "tiny-vlm"} | kwargs))
        assert said in str(caught.value), (said, str(caught.value))
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    reply = client.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": one}])
    assert reply.choices[0].message.content  # still answering
    assert sessions_open(url) == 0
