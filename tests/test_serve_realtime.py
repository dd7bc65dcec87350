"""`/v1/realtime` as its users meet it: a real `python -m serve` on loopback; the official `openai` package as a user
writes it (no mock) streaming the bundled clip's frames and asking, its answers compared with the native routes';
raw WebSocket frames for what no official client sends (bad events, a full server, a client that leaves mid-answer,
200 connections in a row)."""

import base64
import json
import time

import httpx
import psutil
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from jetson.reliability.hostile import png_announcing
from jetson.reliability.serving import TOKEN, serving
from streaming.remote import Client, encoded
from streaming.sources import FileSource, bundled_clip

QUESTIONS = ["what is on screen?", "is there a car?", "how many people are there?", "what did you see?",
             "what is on screen now?"]
EVERY = 12  # frames between questions: 60 frames, 5 questions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_realtime")
    with serving(tmp, "--sessions", str(tmp / "sessions"), max_upload_mb=1.0) as running:
        yield running


@pytest.fixture(scope="module")
def frames():
    """The bundled clip at 1 fps as JPEG bytes (10 frames; looped for longer video)."""
    return [encoded(f.rgb) for f in FileSource(bundled_clip(), fps=1.0)]


def data_url(data: bytes, kind: str = "jpeg") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_item(data: bytes, t: float | None = None) -> dict:
    part = {"type": "input_image", "image_url": data_url(data)} | ({} if t is None else {"t": t})
    return {"type": "message", "role": "user", "content": [part]}


def text_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.slow  # a minute of video through both routes: ~70 s
def test_the_official_client_streams_a_minute_of_video_and_gets_the_native_answers(server, frames):
    url, _, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    records, deltas = [], []
    with client.realtime.connect(model="tiny-vlm") as connection:
        created = connection.recv()
        assert created.type == "session.created" and created.session.id
        for i, question in enumerate(QUESTIONS):
            for t in range(i * EVERY, (i + 1) * EVERY):
                connection.conversation.item.create(item=image_item(frames[t % len(frames)], float(t)))
            connection.conversation.item.create(item=text_item(question))
            connection.response.create()
            text = ""
            for event in connection:
                assert event.type != "error", event
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.done":
                    assert event.response.status == "completed"
                    records.append(event.response.usage.model_extra["stream_qa"])
                    break
            deltas.append(text.strip())
    native = Client(url, token=TOKEN)
    session = native.open()
    expected = []
    try:
        for i, question in enumerate(QUESTIONS):
            for t in range(i * EVERY, (i + 1) * EVERY):
                session.push(frames[t % len(frames)], float(t))
            # about every frame sent before it: asked at the last one's time
            expected.append(session.answer(question, at=float((i + 1) * EVERY - 1)))
        budget = session.state()["budget_tokens"]
    finally:
        session.close()
        native.close()
    assert [r["answer"] for r in records] == [e["answer"] for e in expected]  # greedy, same settings and frames
    assert [r["video_t"] for r in records] == [e["video_t"] for e in expected] == [11.0, 23.0, 35.0, 47.0, 59.0]
    assert deltas == [r["answer"] for r in records] and all(deltas)
    assert all(r["kv_tokens"] <= budget + 64 for r in records)  # the cache at its budget (+ the question's turn)
    assert metric(url, "stream_qa_realtime_frames_total") >= 60
    assert metric(url, "stream_qa_realtime_connections ") == 0


def test_a_burst_of_frames_without_times_and_a_question_are_answered_about_every_frame(server, frames):
    """The official client sends 8 frames as OpenAI's protocol has them (no `t`), at once, then a question and
    response.create: the frames are spaced at the session's rate (0-7 s at 1 fps), all 8 are taken, and the answer is
    about them, at the last one's time (it used to be an error: a burst never filled a clip)."""
    url, _, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    with client.realtime.connect(model="tiny-vlm") as connection:
        session_id = connection.recv().session.id
        for frame in frames[:8]:
            connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": data_url(frame)}]})
        connection.conversation.item.create(item=text_item("is there a car?"))
        connection.response.create()
        kept, done = [], None
        for event in connection:
            assert event.type != "error", event
            if event.type == "conversation.item.created":
                kept += [(p.model_extra["t"], p.model_extra["kept"]) for p in event.item.content
                         if p.type == "input_image"]
            if event.type == "response.done":
                done = event.response
                break
        state = httpx.get(f"{url}/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert kept == [(float(t), True) for t in range(8)]
    record = done.usage.model_extra["stream_qa"]
    assert done.status == "completed" and done.output[0].content[0].text and record["video_t"] == 7.0
    assert state["telemetry"]["clips"] == 4 and state["telemetry"]["video_s"] == 7.0  # every frame in: 0-1 … 6-7


def ws_url(url: str, query: str = "model=tiny-vlm") -> str:
    return url.replace("http://", "ws://") + "/v1/realtime?" + query


def opened(url: str, query: str = "model=tiny-vlm", token: str = TOKEN):
    return connect(ws_url(url, query), additional_headers={"Authorization": f"Bearer {token}"}, max_size=None,
                   open_timeout=60)


def until(ws, *kinds: str, timeout: float = 120) -> dict:
    """The next event of one of `kinds` (others passed over)."""
    while True:
        event = json.loads(ws.recv(timeout=timeout))
        if event["type"] in kinds:
            return event


def bad_rows(frame: bytes) -> list[tuple[str, object, str]]:
    """(what, message, the error code it gets) for a connection with no frames yet."""
    session = {"type": "session.update", "session": {"type": "realtime"}}

    def update(**more):
        return {"type": "session.update", "session": {"type": "realtime", **more}}

    def item(*parts, **more):
        return {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                             "content": list(parts)} | more}

    image = {"type": "input_image", "image_url": data_url(frame)}
    return [
        ("not JSON", "hello", "invalid_json"), ("half an object", '{"type": ', "invalid_json"),
        ("a list", "[]", "invalid_event"), ("a string", '"x"', "invalid_event"),
        ("a numeric type", '{"type": 5}', "invalid_event"), ("no type", '{"event_id": "e1"}', "invalid_event"),
        ("binary", b"\x00\x01\x02", "invalid_event"), ("deep nesting", "[" * 100_000 + "]" * 100_000, "invalid_json"),
        ("unknown type", {"type": "session.create"}, "unknown_event"),
        ("a long unknown type", {"type": "x" * 10_000}, "unknown_event"),
        ("cancel", {"type": "response.cancel"}, "unsupported_event"),
        ("delete", {"type": "conversation.item.delete", "item_id": "i"}, "unsupported_event"),
        ("truncate", {"type": "conversation.item.truncate"}, "unsupported_event"),
        ("retrieve", {"type": "conversation.item.retrieve"}, "unsupported_event"),
        ("audio append", {"type": "input_audio_buffer.append", "audio": "AAAA"}, "audio_not_supported"),
        ("audio commit", {"type": "input_audio_buffer.commit"}, "audio_not_supported"),
        ("audio clear", {"type": "input_audio_buffer.clear"}, "audio_not_supported"),
        ("output audio clear", {"type": "output_audio_buffer.clear"}, "audio_not_supported"),
        ("audio out", update(output_modalities=["audio"]), "audio_not_supported"),
        ("audio config", update(audio={"input": {"format": {"type": "audio/pcm"}}}), "audio_not_supported"),
        ("an audio part", item({"type": "input_audio", "audio": "AAAA"}), "audio_not_supported"),
        ("audio answer", {"type": "response.create", "response": {"output_modalities": ["audio"]}},
         "audio_not_supported"),
        ("no session object", {"type": "session.update", "session": "x"}, "invalid_event"),
        ("an unknown session field", update(voices=1), "unknown_parameter"),
        ("a misspelt setting", update(stream_qa={"bugdet": "64"}), "unknown_parameter"),
        ("settings not an object", update(stream_qa=[1]), "invalid_value"),
        ("fps below 0", update(stream_qa={"fps": -1}), "invalid_value"),
        ("fps NaN", json.dumps(session | {"session": {"type": "realtime", "stream_qa": {"fps": float("nan")}}}),
         "invalid_value"),
        ("an unknown model", update(model="gpt-realtime"), "model_not_found"),
        ("tools", update(tools=[{"type": "function", "name": "f"}]), "tools_not_supported"),
        ("long instructions", update(instructions="x" * 5000), "invalid_value"),
        ("too many output tokens", update(max_output_tokens=100_000), "invalid_value"),
        ("no item", {"type": "conversation.item.create"}, "invalid_item"),
        ("a function call", {"type": "conversation.item.create", "item": {"type": "function_call"}}, "invalid_item"),
        ("an assistant message", item({"type": "input_text", "text": "hi"}, role="assistant"), "invalid_item"),
        ("empty content", item(), "invalid_item"),
        ("content not a list", {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": "hi"}}, "invalid_item"),
        ("a chat-style part", item({"type": "image_url", "image_url": {"url": data_url(frame)}}), "invalid_item"),
        ("an image without its URL", item({"type": "input_image"}), "invalid_item"),
        ("an http URL (nothing fetched)", item({"type": "input_image", "image_url": "http://127.0.0.2/a.jpg"}),
         "invalid_image"),
        ("a text data URL", item({"type": "input_image", "image_url": "data:text/plain;base64,aGk="}),
         "invalid_image"),
        ("broken base64", item({"type": "input_image", "image_url": "data:image/png;base64,@@@"}), "invalid_image"),
        ("an oversized frame", item({"type": "input_image", "image_url": data_url(b"\xff" * (2**20 + 1024))}),
         "invalid_image"),
        ("a negative time", item(image | {"t": -1}), "invalid_value"),
        ("a time as text", item(image | {"t": "soon"}), "invalid_value"),
        ("empty text", item({"type": "input_text", "text": " "}), "invalid_item"),
        ("a long question", item({"type": "input_text", "text": "why " * 600}), "invalid_value"),
        ("65 parts", item(*[{"type": "input_text", "text": "a"}] * 65), "invalid_item"),
        ("nothing to answer", {"type": "response.create"}, "no_question"),
        ("a response that is not an object", {"type": "response.create", "response": 3}, "invalid_event"),
        ("a question with no frames", [item({"type": "input_text", "text": "what is on screen?"}),
                                        {"type": "response.create"}], "no_frame"),
        ("not an image", item({"type": "input_image", "image_url": data_url(b"\x89PNG\r\n\x1a\nrubbish", "png")}),
         "invalid_request_error"),
        ("a 20000x20000 PNG", item({"type": "input_image", "image_url": data_url(png_announcing(20000, 20000),
                                                                                 "png")}), "invalid_request_error"),
    ]


def send(ws, message) -> None:
    ws.send(message if isinstance(message, str | bytes) else json.dumps(message))


def test_bad_events_get_error_events_and_the_connection_still_answers(server, frames):
    url, _, process = server
    with opened(url) as ws:
        until(ws, "session.created")
        rows = bad_rows(frames[0])
        for what, message, code in rows:
            for one in message if isinstance(message, list) else [message]:
                send(ws, one)
            event = until(ws, "error")
            assert event["error"]["code"] == code, (what, event)
        for t in range(5):
            send(ws, {"type": "conversation.item.create", "item": image_item(frames[t], float(t))})
        later = [("settings after frames", {"type": "session.update", "session": {
            "type": "realtime", "stream_qa": {"budget": "64"}}}, "session_settings_locked"),
                 ("a time going back", {"type": "conversation.item.create", "item": image_item(frames[0], 1.0)},
                  "invalid_request_error")]
        for what, message, code in later:
            send(ws, message)
            assert until(ws, "error")["error"]["code"] == code, what
        send(ws, {"type": "response.create"})  # the question the no-frames row left waiting, now with its frames
        send(ws, {"type": "response.create"})  # while the first streams
        assert until(ws, "error")["error"]["code"] == "conversation_already_has_active_response"
        done = until(ws, "response.done")
        assert done["response"]["status"] == "completed" and done["response"]["output"][0]["content"][0]["text"]
    assert len(rows) + len(later) + 1 >= 40
    assert process.poll() is None and httpx.get(f"{url}/healthz").status_code == 200


def test_refused_connections_say_why_and_leave_nothing_open(server):
    url, _, _ = server
    for query, token, code in (("model=tiny-vlm", "wrong", 1008), ("model=gpt-4o", TOKEN, 1008),
                               ("session=nosuchsession0000000", TOKEN, 1008)):
        with opened(url, query, token) as ws:
            assert until(ws, "error")["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd.code == code and closed.value.rcvd.reason
    with opened(url) as ws:  # a message past the limit (a frame of the upload limit as base64, and room)
        until(ws, "session.created")
        ws.send("x" * (2 * 2**20))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1009
    for _ in range(600):  # the sessions above give their pool room back once their threads end: the pool empty first
        if metric(url, "stream_qa_pool_streams ") == 0:
            break
        time.sleep(0.1)
    held = [opened(url) for _ in range(4)]  # the server's max_sessions
    try:
        for ws in held:
            until(ws, "session.created")
        with opened(url) as ws:
            assert "retry" in until(ws, "error")["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd.code == 1013
    finally:
        for ws in held:
            ws.close()
    assert metric(url, "stream_qa_realtime_connections ") == 0


@pytest.mark.slow
def test_a_client_leaving_mid_answer_and_200_connections_in_a_row_leave_the_server_as_it_was(server, frames):
    url, _, process = server
    rss = psutil.Process(process.pid)
    with opened(url) as ws:  # warm: the model's first answers
        until(ws, "session.created")
        for t in range(6):
            send(ws, {"type": "conversation.item.create", "item": image_item(frames[t], float(t))})
        send(ws, {"type": "conversation.item.create", "item": text_item("what is on screen?")})
        send(ws, {"type": "response.create"})
        until(ws, "response.output_text.delta")  # gone before the answer is done
    baseline = rss.memory_info().rss
    for _ in range(200):
        with opened(url) as ws:
            until(ws, "session.created")
    with opened(url) as ws:
        until(ws, "session.created")
        for t in range(4):
            send(ws, {"type": "conversation.item.create", "item": image_item(frames[t], float(t))})
        send(ws, {"type": "conversation.item.create", "item": text_item("is there a car?")})
        send(ws, {"type": "response.create"})
        assert until(ws, "response.done")["response"]["status"] == "completed"
    grew_mb = (rss.memory_info().rss - baseline) / 2**20
    assert grew_mb < 100, grew_mb
    assert httpx.get(f"{url}/healthz").json()["sessions"] == 0


def test_a_session_continues_on_a_new_connection_from_its_folder(server, frames):
    url, _, _ = server
    with opened(url) as ws:
        session_id = until(ws, "session.created")["session"]["id"]
        for t in range(8):
            send(ws, {"type": "conversation.item.create", "item": image_item(frames[t], float(t))})
        send(ws, {"type": "conversation.item.create", "item": text_item("what is on screen?")})
        send(ws, {"type": "response.create"})
        first = until(ws, "response.done")["response"]
        with pytest.raises(ConnectionClosed) as closed, opened(url, f"session={session_id}") as second:
            until(second, "session.created")  # one connection per session while the first is open
        assert closed.value.rcvd.code == 1008 and "already has" in closed.value.rcvd.reason
    with opened(url, f"model=tiny-vlm&session={session_id}") as ws:  # at once: the last one may still be closing
        created = until(ws, "session.created")["session"]
        # 0-1, 2-3, 4-5, and 6-7: the question after frame 7 closed the last clip there
        assert created["id"] == session_id and created["stream_qa"]["stored_clips"] == 4
        send(ws, {"type": "conversation.item.create", "item": image_item(frames[0], 1.0)})  # before what is stored
        assert until(ws, "error")["error"]["code"] == "invalid_value"
        send(ws, {"type": "conversation.item.create", "item": text_item("what did you see?")})
        send(ws, {"type": "response.create"})
        again = until(ws, "response.done")["response"]
    assert first["status"] == again["status"] == "completed"
    assert again["usage"]["stream_qa"]["video_t"] >= first["usage"]["stream_qa"]["video_t"]
