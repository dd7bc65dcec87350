"""Watches on the server: set with a session or added later, alerts delivered as server-sent events (one session's and
the whole server's) and kept in the session, Prometheus counting them; every bad watch request refused in one line.
A real `python -m serve` on loopback, real httpx clients, the real detector on real frames."""

import json
import threading
import time

import cv2
import httpx
import pytest

from jetson.reliability.serving import TOKEN, serving
from streaming.sources import FileSource, bundled_clip

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def receiver():
    from tests.webhook_receiver import Receiver

    hook = Receiver()
    yield hook
    hook.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    """A server whose operator named a webhook: a real loopback receiver (allowed by --allow-url-host 127.0.0.1)."""
    with serving(tmp_path_factory.mktemp("serve_watch"), "--webhook", f"{receiver.url}/alerts") as running:
        yield running


class Listener(threading.Thread):
    """An SSE client on its own thread: every (event, data) it receives, until `stop` or the stream ends."""

    def __init__(self, url: str, headers=AUTH):
        super().__init__(daemon=True)
        self.url, self.headers, self.events, self.status = url, headers, [], None
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self):
        try:
            self._listen()
        except httpx.HTTPError:  # the server stopped with the stream open: the events so far are kept
            self.ready.set()

    def _listen(self):
        with httpx.stream("GET", self.url, headers=self.headers, timeout=httpx.Timeout(60, read=120)) as response:
            self.status = response.status_code
            self.ready.set()
            kind = None
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    self.events.append((kind, json.loads(line[6:])))

    def of(self, kind: str) -> list[dict]:
        return [data for k, data in self.events if k == kind]


def jpeg(rgb) -> bytes:
    return cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))[1].tobytes()


def test_a_watch_set_with_a_session_alerts_its_listeners_and_is_kept_with_the_session(server, receiver):
    url, _, _ = server
    http = httpx.Client(base_url=url, headers=AUTH, timeout=120)
    opened = http.post("/v1/sessions", json={"budget": "256", "clip_seconds": 2.0, "watches": ["a person"]})
    assert opened.status_code == 201, opened.text
    sid = opened.json()["id"]
    own, everyone = Listener(f"{url}/v1/sessions/{sid}/events"), Listener(f"{url}/v1/events")
    for listener in (own, everyone):
        listener.start()
        assert listener.ready.wait(30) and listener.status == 200
    try:
        added = http.post(f"/v1/sessions/{sid}/watches", json={"text": "the car leaves", "rearm_clips": 1})
        assert added.status_code == 201 and added.json()["id"] == 1 and added.json()["watching"] == "car leaves"
        asked = http.post(f"/v1/sessions/{sid}/watches", json={"text": "a parking meter"})  # no detector counts one
        assert asked.status_code == 201 and asked.json()["judged_by"] == "model", asked.text
        for frame in FileSource(bundled_clip(), fps=1.0):  # 10 real frames of bikes.mp4, 0..9 s
            assert http.post(f"/v1/sessions/{sid}/frames", params={"t": frame.t}, content=jpeg(frame.rgb),
                             headers={"Content-Type": "image/jpeg"}).status_code == 202
        http.post(f"/v1/sessions/{sid}/end")
        answer = http.post(f"/v1/sessions/{sid}/questions", json={"text": "is there a bicycle now?", "stream": False})
        assert answer.status_code == 200, answer.text  # answered after every clip went in, and so after its alerts
        alerts = http.get(f"/v1/sessions/{sid}/alerts").json()
        clips = own.of("clip")
        first_person = next(c["clip"] for c in clips if c["objects"].get("person"))
        assert [(a["alert"], a["clip"]) for a in alerts if a["alert"] == "a person"] == [("a person", first_person)]
        # the model said yes after a clip whose words hold a parking meter (bikes.mp4's last seconds), and only there
        words = {c["clip"]: c["seen"] for c in clips}
        metered = [a for a in alerts if a["watch_id"] == 2]
        assert metered and all("parking meter" in words[a["clip"]] and a["evidence"]["model"]["answer"] == "yes" and
                               a["provenance"] == f"the model's answer after clip {a['clip']}" for a in metered)
        assert "parking meter" not in " ".join(w for k, w in words.items() if k < metered[0]["clip"])
        assert all(a["session"] == sid and a["id"] and a["description"] for a in alerts)
        # and each watch's condition as it changes: the person on from the clip that fired, off once gone
        person = [(w["clip"], w["holds"]) for w in own.of("watch") if w["watch_id"] == 0]
        assert person[0] == (first_person, True) and [h for _, h in person] == [True, False][: len(person)]
        # each listener heard each alert once, after the clip that fired it
        for listener in (own, everyone):
            heard = listener.of("alert")
            assert [a["id"] for a in heard] == [a["id"] for a in alerts]
            kinds = [k for k, _ in listener.events]
            assert kinds.index("alert") > kinds.index("clip")
        assert {c["session"] for c in everyone.of("clip")} == {sid}
        watches = http.get(f"/v1/sessions/{sid}/watches").json()
        assert [(w["id"], w["text"], w["alerts"]) for w in watches] == \
            [(0, "a person", 1), (1, "the car leaves", sum(a["watch_id"] == 1 for a in alerts)),
             (2, "a parking meter", len(metered))]
        assert http.delete(f"/v1/sessions/{sid}/watches/1").json()["removed"] == 1
        assert [w["id"] for w in http.get(f"/v1/sessions/{sid}/watches").json()] == [0, 2]
        assert http.delete(f"/v1/sessions/{sid}/watches/1").status_code == 404
        metrics = http.get("/metrics").text
        assert f"stream_qa_alerts_total {float(len(alerts))}" in metrics
        # and POSTed to the operator's webhook, each once, its id as the Idempotency-Key
        deadline = time.monotonic() + 30
        while len(receiver.posts) < len(alerts) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(path, key, body["id"]) for path, key, body in receiver.posts] == \
            [("/alerts", a["id"], a["id"]) for a in alerts]
        assert 'stream_qa_webhook_alerts{outcome="delivered"} ' + f"{float(len(alerts))}" in http.get("/metrics").text
    finally:
        for listener in (own, everyone):
            listener.stop.set()
        http.delete(f"/v1/sessions/{sid}")
        http.close()


@pytest.mark.parametrize("body, status, said", [
    ({"text": ""}, 422, "text"),
    ({"text": "x" * 10_000}, 422, "text"),
    ({"text": "a person\u0007"}, 400, "a watch is words: it cannot hold control characters"),
    ({"text": "a person", "colour": "red"}, 422, "unknown field; known fields: text, cooldown_s, rearm_clips"),
    ({"text": "a person", "cooldown_s": -1}, 422, "cooldown_s"),
    ({"text": "a person", "rearm_clips": 0}, 422, "rearm_clips"),
    ({}, 422, "text"),
])
def test_a_bad_watch_request_is_refused_in_one_line_and_the_session_keeps_its_watches(server, body, status, said):
    url, _, _ = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"watches": ["a person"]}).json()["id"]
        try:
            refused = http.post(f"/v1/sessions/{sid}/watches", json=body)
            assert refused.status_code == status and said in refused.json()["error"], refused.text
            assert "\n" not in refused.json()["error"]
            assert [w["text"] for w in http.get(f"/v1/sessions/{sid}/watches").json()] == ["a person"]
        finally:
            http.delete(f"/v1/sessions/{sid}")


def test_a_webhook_or_broker_the_servers_rules_refuse_stops_it_before_it_loads_in_one_line():
    import subprocess
    import sys

    for flag, url, said in (("--webhook", "file:///etc/passwd", "http:// or https://"),
                            ("--webhook", "http://127.0.0.1:9/x", "a loopback address"),
                            ("--webhook", "http://[::1]:9/x", "a loopback address"),
                            ("--mqtt", "mqtt://127.0.0.1:1883", "a loopback address"),
                            ("--mqtt", "mqtt://10.0.0.5", "a private address"),
                            ("--mqtt", "tcp://broker.example", "an mqtt:// or mqtts:// URL")):
        out = subprocess.run([sys.executable, "-m", "serve", flag, url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_watches_are_bounded_and_the_event_feeds_need_the_token(server):
    url, _, _ = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        too_many = http.post("/v1/sessions", json={"watches": [f"{n} cars" for n in range(65)]})
        assert too_many.status_code == 422 and "watches" in too_many.json()["error"]
        # a watch only the model judges: its question would stay in the cache of a policy evicting while decoding
        unwatchable = http.post("/v1/sessions", json={"watches": ["is it raining?"], "policy": "h2o"})
        assert unwatchable.status_code == 400 and "needs the model's answer, and policy h2o" in \
            unwatchable.json()["error"]
        sid = http.post("/v1/sessions", json={"watches": [f"{n + 1} cars" for n in range(64)]}).json()["id"]
        try:
            full = http.post(f"/v1/sessions/{sid}/watches", json={"text": "a person"})
            assert full.status_code == 400 and "at most 64 watches" in full.json()["error"]
            assert http.post("/v1/sessions/nosuchsession0000/watches", json={"text": "a dog"}).status_code == 404
        finally:
            http.delete(f"/v1/sessions/{sid}")
        assert http.get("/healthz").json()["sessions"] == 0  # the refused opens left nothing behind
    for path in ("/v1/events", "/v1/sessions/x/events", "/v1/sessions/x/watches", "/v1/sessions/x/alerts"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 401


def test_the_official_client_gets_a_proactive_answer_over_realtime_when_a_watch_fires(server):
    """`session.stream_qa.watches` in a session.update, then frames only: the unmodified `openai` client receives a
    whole `response.*` sequence with the alert, having sent no response.create; a question asked after it is answered
    as ever."""
    import base64

    from openai import OpenAI

    url, _, _ = server
    frames = [jpeg(f.rgb) for f in FileSource(bundled_clip(), fps=1.0)]
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    with client.realtime.connect(model="tiny-vlm") as connection:
        session_id = connection.recv().session.id
        connection.session.update(session={"type": "realtime", "stream_qa": {"watches": ["a person"]}})
        updated = connection.recv()
        assert updated.type == "session.updated", updated
        assert updated.session.model_extra["stream_qa"]["watches"] == ["a person"]
        for frame in frames:
            connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/jpeg;base64," + base64.b64encode(frame).decode()}]})
        kinds, done = [], None
        for event in connection:
            assert event.type != "error", event
            kinds.append(event.type)
            if event.type == "response.done":
                done = event.response
                break
        unasked = [k for k in kinds if k.startswith("response.")]
        assert unasked == ["response.created", "response.output_item.added", "response.content_part.added",
                           "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                           "response.output_item.done", "response.done"]
        alert = done.model_extra["stream_qa"]["alert"]
        assert done.status == "completed" and done.metadata["stream_qa_alert_id"] == alert["id"]
        assert alert["alert"] == "a person" and alert["session"] == session_id
        assert "a person" in done.output[0].content[0].text
        connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "is there a car?"}]})
        connection.response.create()
        for event in connection:
            assert event.type != "error", event
            if event.type == "response.done":
                assert event.response.usage.model_extra["stream_qa"]["question"] == "is there a car?"
                break


@pytest.mark.slow
def test_a_server_killed_and_restarted_continues_a_sessions_watches_and_keeps_its_alerts(tmp_path):
    """A real server with --sessions, killed with SIGKILL after bikes.mp4's first clips; a new server on the same
    folder resumes the session at its next request, its watches as they stood: the alert written before the kill is
    kept, the car seen on does not fire again, and the cyclist that comes after does."""
    import signal

    sessions = tmp_path / "sessions"
    frames = list(FileSource(bundled_clip(), fps=1.0))

    def push(http, sid, part):
        for frame in part:
            assert http.post(f"/v1/sessions/{sid}/frames", params={"t": frame.t}, content=jpeg(frame.rgb),
                             headers={"Content-Type": "image/jpeg"}).status_code == 202

    with serving(tmp_path / "first", "--sessions", str(sessions)) as (url, _, process), \
            httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        opened = http.post("/v1/sessions", json={"budget": "256", "clip_seconds": 2.0,
                                                 "watches": ["a car", "a person"]})
        sid = opened.json()["id"]
        push(http, sid, frames[:4])  # 0..3 s: two clips with cars in, no one yet
        deadline = time.monotonic() + 60
        while not (before := http.get(f"/v1/sessions/{sid}/alerts").json()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [a["alert"] for a in before] == ["a car"]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    with serving(tmp_path / "second", "--sessions", str(sessions)) as (url, _, _), \
            httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        assert [w["text"] for w in http.get(f"/v1/sessions/{sid}/watches").json()] == ["a car", "a person"]
        push(http, sid, frames[4:])
        http.post(f"/v1/sessions/{sid}/end")
        assert http.post(f"/v1/sessions/{sid}/questions", json={"text": "is there a car?"}).status_code == 200
        after = http.get(f"/v1/sessions/{sid}/alerts").json()
    assert after[0] == before[0]  # kept, id and all
    assert [a["alert"] for a in after] == ["a car", "a person"]  # the car went on being seen: no second car alert
    assert len({a["id"] for a in after}) == len(after)
