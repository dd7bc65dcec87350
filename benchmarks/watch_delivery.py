"""Alerts handed to receivers that are slow or gone, and the stream's own pace: `python -m benchmarks watch_delivery`.

A camera's stream must not wait for whoever it tells. Three streams take the same clips of `watch`'s montage through
the real `TurnEngine` with tiny-vlm and three watches that fire often (re-arm after 1 clip, no cooldown), their alerts
and watch states handed on as `stream-qa` hands them (`Printed`: on the model thread): one to nobody, one to a webhook
receiver on loopback that takes 10 s to answer each POST, one to an MQTT broker that is not there (a closed loopback
port). Fed in turns of 30 clips each, interleaved, so the machine's load falls on all three alike; each clip's turn,
its judging and the hand-over are timed. Scored: the median and p95 of a clip's time, and each p95 against the stream
with no receiver (the goal: ≤ 1.1×). Writes `watch_delivery.json`.
"""

import http.server
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from models.tiny_vlm.model import TinyVLM
from streaming.engine import Clip, TurnEngine
from streaming.mqtt import Mqtt
from streaming.urls import LOCAL
from streaming.watches import Watches, read_watches
from streaming.webhooks import Webhooks

from .common import machine, print_table, record, write
from .natural import CLIP_S, compose, encode_pieces
from .watch import BUDGET

WATCHES = ["a person", "a car", "a bicycle"]
ROUND = 30  # clips a stream takes before the next one's turn
SLOW_S = 10.0


class _Slow(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(SLOW_S)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        """Quiet: the benchmark prints its own table, not a line per request."""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args):
    clips = int(args.tokens) if getattr(args, "tokens", None) else (60 if args.quick else 300)
    order = compose(random.Random(1), clips)
    vlm = TinyVLM()
    visual = encode_pieces(vlm, set(order))
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    hook = Webhooks([f"http://127.0.0.1:{slow.server_address[1]}/alerts"], LOCAL, timeout_s=30.0)
    broker = Mqtt(f"mqtt://127.0.0.1:{_closed_port()}", LOCAL)
    receivers = {"no receiver": None, f"webhook answering in {SLOW_S:g} s": hook, "MQTT broker gone": broker}
    engines = {}
    for name in receivers:
        engines[name] = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=BUDGET), clip_seconds=CLIP_S)
        engines[name].watches = Watches(read_watches(WATCHES, 1, 0.0), name)
    spent = {name: [] for name in receivers}
    handed = dict.fromkeys(receivers, 0)
    with torch.inference_mode(), tqdm(total=clips * len(receivers), desc="streaming", unit="clip") as bar:
        for start in range(0, clips, ROUND):
            for name, receiver in receivers.items():
                engine = engines[name]
                for k in range(start, min(start + ROUND, clips)):
                    t0 = time.perf_counter()
                    engine.feed(Clip(k + 1, k * CLIP_S, (k + 1) * CLIP_S, visual[order[k]], 0.0))
                    for event in engine.clip_events()[1:] if receiver is not None else ():
                        receiver.put(event)  # as `Printed` hands them on, on the model thread
                        handed[name] += 1
                    spent[name].append(time.perf_counter() - t0)
                    bar.update()
    hook.close(wait_s=0.0)
    broker.close(wait_s=0.0)
    slow.shutdown()
    base = _p95(spent["no receiver"])
    recs = []
    for name, times in spent.items():
        recs += [record("watch_delivery", name, BUDGET, "turn_s", statistics.median(times), "median clip"),
                 record("watch_delivery", name, BUDGET, "answer_p95_s", _p95(times), "p95 of a clip"),
                 record("watch_delivery", name, BUDGET, "ratio", _p95(times) / base, "p95 / no receiver's"),
                 record("watch_delivery", name, BUDGET, "alerts", handed[name], "events handed to the receiver")]
    recs += [record("watch_delivery", "webhook", BUDGET, "requests", hook.counts["delivered"] + hook.counts["failed"],
                    f"POSTs answered or given up in the run ({hook.counts})"),
             record("watch_delivery", "MQTT broker gone", BUDGET, "dropped", broker.counts["dropped"],
                    f"messages past the kept {broker.max_queued} ({broker.counts})")]
    write(Path(args.out), "watch_delivery", recs, [])
    print(f"watch_delivery: {clips} clips a stream, {machine().get('cpu')}")
    print_table(recs, ["turn_s", "answer_p95_s", "ratio", "alerts", "requests", "dropped"])


def _p95(values) -> float:
    return statistics.quantiles(values, n=20)[-1]
