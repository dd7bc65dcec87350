"""Alerts published to a real Mosquitto broker on loopback (`make mosquitto` installs Debian's), read back by a real
paho subscriber: `stream-qa --mqtt` with the real detector and tiny-vlm on bikes.mp4, Home Assistant's discovery
retained, and a broker stopped mid-run whose alerts arrive when it is back."""

import getpass
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import paho.mqtt.client as paho
import pytest

from streaming.events import Alert
from streaming.mqtt import Mqtt
from streaming.urls import LOCAL

pytestmark = pytest.mark.slow


class Broker:
    """Mosquitto on a free loopback port, its state kept on disk across a stop and a start (as a house's is)."""

    def __init__(self, folder, extra: str = "allow_anonymous true\n"):
        self.binary = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")
        if self.binary is None:
            pytest.fail("no mosquitto: run 'make mosquitto' (Debian's broker)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.config = folder / "mosquitto.conf"
        # `user`: mosquitto started as root drops to the user `mosquitto`, which cannot write a test's private folder,
        # so it kept no state across a restart and a subscriber's session was lost (it gets its own user's rights)
        self.config.write_text(f"listener {self.port} 127.0.0.1\n{extra}persistence true\n"
                               f"persistence_location {folder}/\nautosave_interval 1\nuser {getpass.getuser()}\n")
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([self.binary, "-c", str(self.config)], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("mosquitto did not start")

    def stop(self):
        self.proc.terminate()  # SIGTERM: mosquitto saves its sessions and retained messages first
        self.proc.wait(timeout=10)


class Subscriber:
    """A paho client keeping a persistent session (its QoS 1 messages wait at the broker while it is away)."""

    def __init__(self, port: int, name: str):
        self.got, self.lock = [], threading.Lock()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=name, clean_session=False)
        self.subscribed = threading.Event()
        self.resumed: list[bool] = []  # per connection: whether the broker still had this client's session
        self.client.on_connect = self._connected
        self.client.on_subscribe = lambda c, u, mid, codes, p: self.subscribed.set()
        self.client.on_message = self._message
        self.client.reconnect_delay_set(0.5, 5)  # back soon after a broker's restart, however long it was away
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        # subscribed before the test publishes, as a message sent before the broker has the subscription is not kept
        # for it (a loaded machine once published the minute test's first alert first)
        assert self.subscribed.wait(30), f"the subscriber {name!r} was not subscribed in 30 s"

    def _connected(self, client, userdata, flags, reason, properties):
        self.resumed.append(flags.session_present)
        client.subscribe("#", qos=1)

    def _message(self, client, userdata, message):
        with self.lock:
            self.got.append((message.topic, message.payload.decode(), message.retain))

    def topics(self, ending: str) -> list[tuple[str, str, bool]]:
        with self.lock:
            return [m for m in self.got if m[0].endswith(ending)]

    def wait(self, ending: str, n: int, timeout: float = 30) -> list:
        deadline = time.monotonic() + timeout
        while len(self.topics(ending)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.topics(ending)

    def alert_ids(self, n: int, timeout: float = 60) -> list[str]:
        """The ids of the first `n` distinct alerts heard, in order: QoS 1 is at least once, so a message the broker
        sent just before it stopped, and whose acknowledgement it did not read, comes again (its id de-duplicates)."""
        deadline, ids = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            ids = list(dict.fromkeys(json.loads(body)["id"] for _, body, _ in self.topics("door/alerts")))
            if len(ids) >= n:
                break
            time.sleep(0.05)
        return ids

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def broker(tmp_path):
    running = Broker(tmp_path)
    yield running
    running.stop()


def test_stream_qa_publishes_each_alert_its_state_and_home_assistants_discovery(broker):
    listener = Subscriber(broker.port, "listener")
    try:
        out = subprocess.run([sys.executable, "-m", "streaming.cli", "--fast", "--json", "--watch", "a car",
                              "--watch", "a person", "--mqtt", f"mqtt://127.0.0.1:{broker.port}/cams"],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        printed = [json.loads(line) for line in out.stdout.splitlines() if '"alert"' in line]
        assert [a["alert"] for a in printed] == ["a car", "a person"]  # bikes.mp4: cars from clip 1, the cyclist in 2
        heard = [json.loads(body) for _, body, _ in listener.wait("bikes/alerts", 2)]
        assert heard == printed  # each record as stream-qa printed it, on cams/bikes/alerts
        for a in printed:  # each watch's state: ON from its alert's clip, OFF at the last clip (it shows neither)
            assert [body for _, body, _ in listener.topics(f"bikes/watch/{a['watch_id']}/state")] == ["ON", "OFF"]
            assert json.loads(listener.topics(f"bikes/watch/{a['watch_id']}/alert")[0][1])["id"] == a["id"]
        assert [body for _, body, _ in listener.wait("cams/status", 2)] == ["online", "offline"]
    finally:
        listener.close()
    # what Home Assistant, starting later, reads: a retained discovery per watch and the status
    late = Subscriber(broker.port, "home-assistant")
    try:
        configs = {topic: json.loads(body) for topic, body, retained in late.wait("/config", 2) if retained}
        assert set(configs) == {f"homeassistant/binary_sensor/stream_qa_bikes_{i}/config" for i in (0, 1)}
        car = configs["homeassistant/binary_sensor/stream_qa_bikes_0/config"]
        assert (car["name"], car["state_topic"], car["availability_topic"], car["device_class"]) == \
            ("a car", "cams/bikes/watch/0/state", "cams/status", "occupancy")
        assert late.wait("cams/status", 1)[0][1:] == ("offline", True)
        assert [m[1:] for m in late.wait("/state", 2)] == [("OFF", True)] * 2
    finally:
        late.close()


def alert(k: int) -> Alert:
    return Alert({"id": f"alert{k}", "alert": "a person", "watch_id": 0, "session": "door", "clip": k})


def test_alerts_published_while_the_broker_is_away_arrive_once_it_is_back_and_overflow_is_counted(broker):
    listener = Subscriber(broker.port, "listener")
    said = []
    publisher = Mqtt(f"mqtt://127.0.0.1:{broker.port}", LOCAL, warn=said.append)
    try:
        publisher.put(alert(1))
        assert len(listener.wait("door/alerts", 1)) == 1
        broker.stop()
        t0 = time.perf_counter()
        for k in (2, 3, 4):
            publisher.put(alert(k))  # the broker is down: handed over at once, kept for it
        assert time.perf_counter() - t0 < 0.5
        time.sleep(2)
        broker.start()
        assert listener.alert_ids(4) == ["alert1", "alert2", "alert3", "alert4"]
        assert listener.resumed == [False, True]  # the broker kept the listener's session across its restart
        assert any("cannot be reached" in line for line in said)
    finally:
        publisher.close()
        listener.close()
    assert publisher.counts == {"queued": 9, "delivered": 9, "dropped": 0}  # a discovery, then 2 an alert
    # a broker away longer than the publisher keeps messages for: the overflow dropped, counted and said
    broker.stop()
    small = Mqtt(f"mqtt://127.0.0.1:{broker.port}", LOCAL, warn=said.append, max_queued=4)
    try:
        for k in range(3):
            small.put(alert(k))
        assert small.counts["dropped"] == 3 and small.counts["queued"] == 4
        assert any("a message dropped (3 so far)" in line for line in said)
    finally:
        small.close(wait_s=0.5)
        broker.start()


def test_a_broker_away_for_a_minute_gets_every_alert_of_that_minute_once_it_is_back(broker):
    """Issue 69's outage: the broker stopped for 60 s while an alert comes every 10 s; each is handed over at once,
    none is lost, each arrives once, in order, after the broker is back."""
    listener = Subscriber(broker.port, "minute")
    publisher = Mqtt(f"mqtt://127.0.0.1:{broker.port}", LOCAL, warn=lambda line: None)
    try:
        publisher.put(alert(0))
        assert len(listener.wait("door/alerts", 1)) == 1
        broker.stop()
        away, handed = time.monotonic(), []
        for k in range(1, 7):
            t0 = time.perf_counter()
            publisher.put(alert(k))
            handed.append(time.perf_counter() - t0)
            time.sleep(max(0.0, away + 10 * k - time.monotonic()))
        assert time.monotonic() - away >= 60 and max(handed) < 0.5
        broker.start()
        assert listener.alert_ids(7) == [f"alert{k}" for k in range(7)]
        assert listener.resumed == [False, True]
    finally:
        publisher.close()
        listener.close()
    assert publisher.counts["dropped"] == 0 and publisher.counts["delivered"] == publisher.counts["queued"]


def test_the_server_publishes_every_sessions_alerts_and_counts_them(broker, tmp_path):
    import cv2
    import httpx

    from jetson.reliability.serving import TOKEN, serving
    from streaming.sources import FileSource, bundled_clip

    listener = Subscriber(broker.port, "listener")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with serving(tmp_path / "srv", "--mqtt", f"mqtt://127.0.0.1:{broker.port}/srv") as (url, _, _), \
                httpx.Client(base_url=url, headers=auth, timeout=120) as http:
            opened = http.post("/v1/sessions", json={"budget": "256", "clip_seconds": 2.0, "watches": ["a car"]})
            sid = opened.json()["id"]
            for frame in FileSource(bundled_clip(), fps=1.0):
                image = cv2.imencode(".jpg", cv2.cvtColor(frame.rgb, cv2.COLOR_RGB2BGR))[1].tobytes()
                http.post(f"/v1/sessions/{sid}/frames", params={"t": frame.t}, content=image,
                          headers={"Content-Type": "image/jpeg"})
            http.post(f"/v1/sessions/{sid}/end")
            assert http.post(f"/v1/sessions/{sid}/questions", json={"text": "is there a car?"}).status_code == 200
            alerts = http.get(f"/v1/sessions/{sid}/alerts").json()
            assert alerts, "bikes.mp4's cars fire 'a car'"
            heard = [json.loads(body)["id"] for _, body, _ in listener.wait(f"srv/{sid}/alerts", len(alerts))]
            assert heard == [a["id"] for a in alerts]
            assert [topic for topic, _, _ in listener.topics("/config")] == \
                [f"homeassistant/binary_sensor/stream_qa_{sid}_0/config"]  # announced at its first change
            states = [body for _, body, _ in listener.wait(f"srv/{sid}/watch/0/state", 2)]
            assert states == ["ON", "OFF"]  # the cars of bikes.mp4's first seconds, gone by its end
            delivered = f'stream_qa_mqtt_messages{{outcome="delivered"}} {1.0 + 2 * len(alerts) + len(states)}'
            deadline = time.monotonic() + 10
            while delivered not in (metrics := http.get("/metrics").text) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert delivered in metrics
    finally:
        listener.close()


def test_a_broker_that_refuses_the_client_is_said_in_one_line_and_the_stream_is_not_held_up(tmp_path):
    closed = Broker(tmp_path, "allow_anonymous false\n")  # a house broker with passwords, and none given
    said = []
    try:
        publisher = Mqtt(f"mqtt://127.0.0.1:{closed.port}", LOCAL, warn=said.append)
        t0 = time.perf_counter()
        publisher.put(alert(1))
        assert time.perf_counter() - t0 < 0.5
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said and "refused the connection (Not authorized)" in said[0] and "\n" not in said[0]
        t0 = time.perf_counter()
        publisher.close(wait_s=1.0)
        assert time.perf_counter() - t0 < 3
    finally:
        closed.stop()
