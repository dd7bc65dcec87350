"""Alerts published to an MQTT broker, with Home Assistant's discovery, where camera users' home automation listens.

Frigate and the NVR tools publish to a broker the house already runs (Mosquitto beside Home Assistant); `Mqtt` does
the same for a stream's alerts. `mqtt://[user:password@]host[:port][/prefix]` (`mqtts://` over TLS; the prefix,
default `stream_qa`, heads every topic):
- `PREFIX/status`: `online` while connected, `offline` (retained, and the broker's will for a client that vanished);
- `PREFIX/SESSION/alerts`: each alert's record as JSON (QoS 1: at least once; its `id` de-duplicates);
- `PREFIX/SESSION/watch/WATCH_ID/state`: `ON` while the watch's condition holds, `OFF` once it does not (retained,
  QoS 1: `WatchState` events); `…/WATCH_ID/alert`: that watch's last alert record (the sensor's attributes);
- `homeassistant/binary_sensor/stream_qa_SESSION_WATCH_ID/config` (retained): the discovery of one binary sensor per
  watch, its name the watch's words, its attributes the last alert, published when the watch is announced
  (`stream-qa`'s at start) or at its first alert or change (a watch added on the server).

Never in the way of the stream: `put` hands the message to paho's own thread and returns; while the broker is away,
paho keeps up to `MAX_QUEUED` messages and sends them when it is back (past that, an alert is dropped for MQTT and
counted). The broker's URL is opened only under the URL rules of sources (`streaming/urls.py`), checked at start.
"""

import dataclasses
import json
import re
import threading
import time
from pathlib import PurePosixPath

from .events import Alert, Handler, WatchState
from .urls import UrlPolicy, UrlRefused, parse, redact

MAX_QUEUED = 1000  # messages paho holds while the broker is away, at most
PORTS = {"mqtt": 1883, "mqtts": 8883}
DISCOVERY = "homeassistant"


def topic_part(session: str) -> str:
    """A session's name as one level of a topic: a file's or a URL's last name without its suffix ("bikes" for
    `…/bikes.mp4`), in word characters (no `/`, `+`, `#`; Home Assistant's ids are word characters)."""
    name = str(session)
    if "/" in name:
        name = PurePosixPath(name.rstrip("/")).stem or name
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "_"


class Mqtt(Handler):
    def __init__(self, url: str, policy: UrlPolicy, warn=None, client_id: str | None = None,
                 max_queued: int = MAX_QUEUED):
        self.host, self.port, self.prefix = self.check(url, policy)
        parts = parse(url)
        self.url, self.warn = redact(url), warn or (lambda text: None)
        self.counts = {"queued": 0, "delivered": 0, "dropped": 0}  # handed to paho; acknowledged by the broker
        self._announced: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._waiting: set[int] = set()  # ids of the messages handed to paho and not yet acknowledged

        import paho.mqtt.client as paho

        self._paho = paho
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id or "")
        if parts.username is not None:
            self.client.username_pw_set(parts.username, parts.password)
        if parts.scheme.lower() == "mqtts":
            self.client.tls_set()
        self.max_queued = max_queued
        self.client.max_queued_messages_set(max_queued)
        self.client.reconnect_delay_set(0.5, 5)
        self.client.will_set(f"{self.prefix}/status", "offline", qos=1, retain=True)
        self.client.on_connect = self._connected
        self.client.on_connect_fail = self._unreachable
        self._away = False  # said once an outage that the broker cannot be reached
        self.client.on_publish = self._acknowledged
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()

    @staticmethod
    def check(url: str, policy: UrlPolicy) -> tuple[str, int, str]:
        """(the address to connect to, the port, the topic prefix) of a broker URL the policy opens (UrlRefused: one
        line)."""
        if not url.lower().startswith(("mqtt://", "mqtts://")):
            raise UrlRefused(f"broker {redact(url)}: an MQTT broker is an mqtt:// or mqtts:// URL")
        parts = parse(url)
        where = dataclasses.replace(policy, schemes=tuple(PORTS)).addresses(url)
        prefix = parts.path.strip("/") or "stream_qa"
        if any(c in prefix for c in "+#") or "//" in prefix:
            raise UrlRefused(f"broker {redact(url)}: its topic prefix {prefix!r} holds a wildcard or an empty level")
        return where[0], parts.port or PORTS[parts.scheme.lower()], prefix

    def announce(self, session: str, watchers) -> None:
        """Home Assistant's discovery for each of a stream's watches (`streaming.watches.Watcher`s), retained."""
        for w in watchers:
            self._discover(session, w.index, w.watch.text)

    def put(self, event, session: str | None = None) -> None:
        """From any thread: an alert published (other events are not MQTT's)."""
        event.to(self)

    def on_alert(self, event: Alert) -> None:
        alert = event.alert
        self._discover(alert["session"], alert["watch_id"], alert["alert"])
        base = f"{self.prefix}/{topic_part(alert['session'])}"
        record = json.dumps(alert)
        self._publish(f"{base}/alerts", record)
        self._publish(f"{base}/watch/{alert['watch_id']}/alert", record)

    def on_watch_state(self, event: WatchState) -> None:
        state = event.state
        self._discover(state["session"], state["watch_id"], state["watch"])
        self._publish(f"{self.prefix}/{topic_part(state['session'])}/watch/{state['watch_id']}/state",
                      "ON" if state["holds"] else "OFF", retain=True)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop once what is queued is published (or after `wait_s`), saying `offline` first."""
        deadline = time.monotonic() + wait_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.client.is_connected():
            self.client.publish(f"{self.prefix}/status", "offline", qos=1, retain=True).wait_for_publish(1.0)
        self.client.disconnect()
        self.client.loop_stop()

    def _connected(self, client, userdata, flags, reason, properties) -> None:
        if reason.is_failure:
            self.warn(f"MQTT broker {self.url}: refused the connection ({reason})")
            return
        self._away = False
        client.publish(f"{self.prefix}/status", "online", qos=1, retain=True)

    def _unreachable(self, client, userdata) -> None:
        if not self._away:
            self._away = True
            self.warn(f"MQTT broker {self.url}: cannot be reached; its alerts are kept (up to {self.max_queued} "
                      "messages) and sent when it is back")

    def _acknowledged(self, client, userdata, mid, reason, properties) -> None:
        with self._lock:
            if mid in self._waiting:
                self._waiting.discard(mid)
                self.counts["delivered"] += 1

    def _discover(self, session: str, watch_id: int, text: str) -> None:
        with self._lock:
            if (session, watch_id) in self._announced:
                return
            self._announced.add((session, watch_id))
        name = f"stream_qa_{topic_part(session)}_{watch_id}"
        base = f"{self.prefix}/{topic_part(session)}"
        config = {"name": text, "unique_id": name, "object_id": name, "state_topic": f"{base}/watch/{watch_id}/state",
                  "json_attributes_topic": f"{base}/watch/{watch_id}/alert", "device_class": "occupancy",
                  "availability_topic": f"{self.prefix}/status",
                  "device": {"identifiers": [f"stream_qa_{topic_part(session)}"], "name": f"stream-qa {session}",
                             "manufacturer": "stream-qa"}}
        self._publish(f"{DISCOVERY}/binary_sensor/{name}/config", json.dumps(config), retain=True)

    def _publish(self, topic: str, payload: str, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if info.rc == self._paho.MQTT_ERR_QUEUE_SIZE:
            self.counts["dropped"] += 1
            self.warn(f"MQTT broker {self.url}: away too long, a message dropped ({self.counts['dropped']} so far)")
            return
        with self._lock:
            self.counts["queued"] += 1
            self._waiting.add(info.mid)
