"""Prometheus figures of one server: its sessions, each session's KV bytes, and how fast it answers and ingests."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("stream_qa_sessions", "Sessions open", registry=r)
        self.pool_streams = Gauge("stream_qa_pool_streams", "Streams holding room in the model pools (a closed "
                                  "session's until its model thread has ended)", registry=r)
        self.kv_bytes = Gauge("stream_qa_kv_bytes", "KV cache bytes held by a session (first 8 characters of its id)",
                              ["session"], registry=r)
        self.ttft = Histogram("stream_qa_time_to_first_token_seconds", "Time from a question's turn to its first "
                              "token", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.ingest = Histogram("stream_qa_ingest_speed", "Video seconds ingested per second of ingest work, per "
                                "answer (>= 1 keeps up with real time)",
                                buckets=(0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=r)
        self.questions = Counter("stream_qa_questions", "Questions answered", registry=r)
        self.realtime_connections = Gauge("stream_qa_realtime_connections", "Realtime WebSocket connections open",
                                          registry=r)
        self.realtime_events = Counter("stream_qa_realtime_events", "Realtime client events received, by type "
                                       "(a type the protocol lacks: other)", ["type"], registry=r)
        self.realtime_frames = Counter("stream_qa_realtime_frames", "Frames pushed over Realtime connections",
                                       registry=r)
        self.alerts = Counter("stream_qa_alerts", "Alerts fired by sessions' watches", registry=r)
        self.events_dropped = Counter("stream_qa_events_dropped", "Session events an SSE receiver was too far behind "
                                      "to be given", registry=r)
        self.webhook_gauge = Gauge("stream_qa_webhook_alerts", "Alerts by what became of their webhook POSTs "
                                   "(delivered, retried attempts, failed, dropped: the queue was full)", ["outcome"],
                                   registry=r)
        self.webhooks: dict = {}  # the server's webhooks' counts (streaming.webhooks.Webhooks.counts)
        self.mqtt_gauge = Gauge("stream_qa_mqtt_messages", "Alert messages for the MQTT broker, by what became of them "
                                "(queued for it, delivered: acknowledged, dropped: the broker away too long)",
                                ["outcome"], registry=r)
        self.mqtt: dict = {}  # the server's broker's counts (streaming.mqtt.Mqtt.counts)
        self.refused = Counter("stream_qa_refused", "Requests refused with 429", ["reason"], registry=r)

    def answered(self, answer, telemetry: dict) -> None:
        self.questions.inc()
        self.ttft.observe(answer.ttft_s)
        if telemetry.get("ingest_speed"):
            self.ingest.observe(telemetry["ingest_speed"])

    def render(self, sessions, pool_streams: int) -> bytes:
        """The text exposition, session gauges read now."""
        self.sessions.set(len(sessions))
        self.pool_streams.set(pool_streams)
        for outcome, n in self.webhooks.items():
            self.webhook_gauge.labels(outcome).set(n)
        for outcome, n in self.mqtt.items():
            self.mqtt_gauge.labels(outcome).set(n)
        self.kv_bytes.clear()
        for hosted in sessions:
            live = hosted.live.session
            if live is not None:
                self.kv_bytes.labels(hosted.id[:8]).set(live.kv_bytes)
        return generate_latest(self.registry)
