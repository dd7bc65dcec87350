"""The streaming-session server (issue 47): what HTTP costs a question, and the server at twice its capacity.

overhead: tiny-vlm, budget 256, N = 1, 2, 4 sessions, each having played the bundled clip (10 s, 1 fps, 2 s clips,
read as fast as the model takes it), then asked four plain questions in turn, the N sessions at once, for 6 rounds.
In-process: `HostedSession`s in this process (the server's own session class, no HTTP). Embedded: N sessions on a
`python -m serve` on loopback (SSE read with httpx). The modes alternate question by question in the same run, on
sessions in the same state, so each embedded answer has an in-process twin. Per mode and N: each question's time to
first token and to its whole answer (p50, p95, measured by the asker), questions answered per second (over the
time the rounds took), and the server's added time per question: the median of embedded minus its twin.

load: a server holding `CAPACITY` sessions, 2 x `CAPACITY` clients at once, in `WAVES` waves: each opens a session
(201, or 429 and stops), pushes the clip's frames as JPEG, asks three questions, ends and closes. Counted: every
request's status (answered, refused with 429, server errors), the most KV tokens any session held, and the server's
RSS after each wave and its growth per wave after the first (a least-squares slope; flat: each wave's sessions live
in the memory the ones before them gave back).
"""

import base64
import contextlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm

from streaming.events import Handler, Token

from .common import print_table, record, write

BUDGET = 256
QUESTIONS = ["what is on screen?", "is there a bicycle now?", "did you see a person?", "is there a car?"]
CAPACITY = 4
WAVES = 8
SSE_BATCH_MS = 50  # Ray's tokens after an answer's first go out in chunks of 50 ms (serve/ray_config.yaml's setting)


def run(args):
    from jetson.reliability.serving import serving

    counts = [1, 2] if args.quick else [1, 2, 4]
    rounds = 2 if args.quick else 6
    if args.policies == ["realtime"]:  # the Realtime route alone
        with tempfile.TemporaryDirectory() as tmp, \
                serving(Path(tmp), token=None, max_sessions=16, max_questions=64) as (url, _, _):
            records = realtime(url, counts, rounds)
        print_table(records, sorted({r["metric"] for r in records}))
        write(args.out, "serve_realtime", records, ["answer_s", "ttft_s"], x_label="connections")
        return
    records = []
    with tempfile.TemporaryDirectory() as tmp, \
            serving(Path(tmp) / "a", token=None, max_sessions=16, max_questions=64) as (url, media, _), \
            ray_serving(Path(tmp) / "ray", media) as ray_url:
        for n in tqdm(counts, desc="sessions"):
            result = paired(media / "bikes.mp4", {"embedded": url, "ray": ray_url}, n, rounds)
            for mode, r in result.items():
                records += [record("serve", mode, BUDGET, metric, round(value, 4), n) for metric, value in (
                    ("ttft_s", _p(r["ttft"], 50)), ("ttft_p95_s", _p(r["ttft"], 95)),
                    ("answer_s", _p(r["total"], 50)), ("answer_p95_s", _p(r["total"], 95)),
                    ("questions_per_s", len(r["total"]) / r["wall"]))]
            for mode, over in (("embedded", "in-process"), ("ray", "embedded")):
                added = [a - b for a, b in zip(result[mode]["total"], result[over]["total"], strict=True)]
                records.append(record("serve", f"{mode} over {over} (paired)", BUDGET, "overhead_ms",
                                      round(statistics.median(added) * 1e3, 2), n))
        records += realtime(url, counts, rounds)
        records += failover(Path(tmp) / "ray", ray_url, tries=1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        with serving(Path(tmp), token=None, max_sessions=CAPACITY, max_questions=64) as (url, _, process):
            records += load(url, process.pid, clients=2 * CAPACITY, waves=2 if args.quick else WAVES)
    print_table(records, sorted({r["metric"] for r in records}))
    write(args.out, "serve", records, ["answer_s", "ttft_s"], x_label="sessions")


@contextlib.contextmanager
def ray_serving(folders: Path, media: Path):
    """A local Ray cluster (this machine's cores) with the deployment of serve/ray_app.py: one replica with both
    cores for the latency rounds, as the embedded server has them; yields its URL."""
    from serve.ray_app import local_cluster

    app = {"replicas": 1, "replica_cpus": 2, "sessions": str(folders), "media": str(media), "max_sessions": 16,
           "max_questions": 64, "sse_batch_ms": SSE_BATCH_MS}
    with local_cluster(app) as (*_, url):
        yield url


def failover(folders: Path, url: str, tries: int) -> list[dict]:
    """Two replicas (a core each); a session on one, asked, its replica killed with `ray.kill`: seconds until the
    session answers again from the other, continued from its folder. Each try waits for the killed replica's
    replacement to load before the next."""
    import ray
    from ray import serve

    from serve.ray_app import build
    from streaming.remote import Client
    from streaming.sources import FileSource, bundled_clip

    serve.delete("stream-qa")  # its one replica holds both cores: the two below could not start beside it
    serve.run(build({"replicas": 2, "sessions": str(folders), "max_sessions": 16}), name="stream-qa",
              route_prefix="/")
    frames = list(FileSource(bundled_clip(), fps=1.0))
    client, out = Client(url), []
    for i in range(tries):
        session = client.open(budget=str(BUDGET), clip_seconds=2.0)
        for frame in frames[:7]:
            session.push(frame.rgb, frame.t)
        session.answer(QUESTIONS[0], at=4.0)
        holder = session.state()["replica"]
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(holder))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        t0 = time.perf_counter()
        session.answer(QUESTIONS[1])
        out.append(record("serve", "ray failover", BUDGET, "first_answer_s", round(time.perf_counter() - t0, 3),
                          i + 1))
        session.close()
        deadline = time.monotonic() + 300  # the replacement replica loads its model before the next try
        while time.monotonic() < deadline and _running(serve) < 2:
            time.sleep(1)
    client.close()
    return out


def _running(serve) -> int:
    """Replicas of the deployment up and serving."""
    states = serve.status().applications["stream-qa"].deployments["StreamServer"].replica_states
    return sum(count for state, count in states.items() if str(getattr(state, "value", state)) == "RUNNING")


def _p(values, q) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def paired(clip: Path, urls: dict, n: int, rounds: int) -> dict:
    """n sessions in this process and n on each server, each having played the clip; then, question by question,
    all n in-process sessions asked at once, then all n on each server in turn: the modes alternate, so a drift
    of the machine's speed reaches them all."""
    from streaming.hosted import HostedSession, Settings
    from streaming.remote import Client
    from streaming.sources import FileSource

    clients = {mode: Client(url) for mode, url in urls.items()}
    remote = {mode: [c.open(budget=str(BUDGET), clip_seconds=2.0, source={"file": "bikes.mp4", "realtime": False})
                     for _ in range(n)] for mode, c in clients.items()}
    settings = Settings(budget=str(BUDGET), clip_seconds=2.0)
    local = [HostedSession(settings, lambda stop: FileSource(clip, fps=1.0), "bench", answers_after_end=True)
             for _ in range(n)]
    modes = [("in-process", local, _ask_here)] + [(mode, sessions, _ask_there) for mode, sessions in remote.items()]
    out = {mode: {"ttft": [], "total": [], "wall": 0.0} for mode, _, _ in modes}
    try:
        for s in local:
            s.source_ended.wait(300)
        for sessions in remote.values():
            for s in sessions:
                while not s.state()["ended"]:
                    time.sleep(0.05)
        for _ in range(rounds):
            for text in QUESTIONS:
                for mode, sessions, ask in modes:
                    times, wall = _at_once([lambda s=s, ask=ask, text=text: ask(s, text) for s in sessions])
                    out[mode]["wall"] += wall
                    for first, total, *_ in times:
                        out[mode]["ttft"].append(first)
                        out[mode]["total"].append(total)
    finally:
        for s in local:
            s.close()
        for sessions in remote.values():
            for s in sessions:
                s.close()
        for c in clients.values():
            c.close()
    return out


def realtime(url: str, counts: list[int], rounds: int) -> list[dict]:
    """/v1/realtime beside the native routes on one server: per N, N pushed-frames sessions of each, paired
    question by question; the Realtime route's added time per question, and its p95 time to first token with N
    connections over one's."""
    records, one, alone = [], None, None
    for n in tqdm(counts, desc="realtime connections"):
        result = realtime_paired(url, n, rounds)
        answers = dict(result["realtime"]["answers"])  # n connections, the same frames: one answer a question
        alone = alone or answers
        same = [a == alone[q] for q, a in result["realtime"]["answers"] + result["native (pushed)"]["answers"]]
        records.append(record("serve", "realtime and native answers equal one connection's", BUDGET, "rate",
                              round(sum(same) / len(same), 4), n))
        for mode, r in result.items():
            records += [record("serve", mode, BUDGET, metric, round(value, 4), n) for metric, value in (
                ("ttft_s", _p(r["ttft"], 50)), ("ttft_p95_s", _p(r["ttft"], 95)),
                ("answer_s", _p(r["total"], 50)), ("answer_p95_s", _p(r["total"], 95)))]
        added = [a - b for a, b in zip(result["realtime"]["total"], result["native (pushed)"]["total"], strict=True)]
        records.append(record("serve", "realtime over native (paired)", BUDGET, "overhead_ms",
                              round(statistics.median(added) * 1e3, 2), n))
        one = one or _p(result["realtime"]["ttft"], 95)
        records.append(record("serve", "realtime p95 ttft over one connection's", BUDGET, "ratio",
                              round(_p(result["realtime"]["ttft"], 95) / one, 3), n))
    return records


def realtime_paired(url: str, n: int, rounds: int) -> dict:
    """n native sessions and n Realtime connections, each pushed the bundled clip's frames (PNG, 0-10 s: the last
    closes the 8-10 s clip) and asked once to warm; then question by question all n native sessions at once (SSE),
    then all n connections (raw WebSocket frames: the route's cost, not a client library's)."""
    from websockets.sync.client import connect

    from streaming.remote import Client, encoded
    from streaming.sources import FileSource, bundled_clip

    frames = [encoded(f.rgb, "PNG") for f in FileSource(bundled_clip(), fps=1.0)]
    frames.append(frames[-1])
    client = Client(url)
    native = [client.open(budget=str(BUDGET), clip_seconds=2.0) for _ in range(n)]
    sockets = [connect(url.replace("http://", "ws://") + "/v1/realtime?model=tiny-vlm", max_size=None)
               for _ in range(n)]
    out = {mode: {"ttft": [], "total": [], "answers": []} for mode in ("native (pushed)", "realtime")}
    try:
        for session, ws in zip(native, sockets, strict=True):
            _until(ws, "session.created")
            for t, frame in enumerate(frames):
                session.push(frame, float(t))
                ws.send(json.dumps({"type": "conversation.item.create", "item": _item("input_image", frame, t)}))
            _ask_there(session, QUESTIONS[0])
            _ask_realtime(ws, QUESTIONS[0])
        for _ in range(rounds):
            for text in QUESTIONS:
                for mode, asks in (("native (pushed)", [lambda s=s, q=text: _ask_there(s, q) for s in native]),
                                   ("realtime", [lambda ws=ws, q=text: _ask_realtime(ws, q) for ws in sockets])):
                    for first, total, answer in _at_once(asks)[0]:
                        out[mode]["ttft"].append(first)
                        out[mode]["total"].append(total)
                        out[mode]["answers"].append((text, answer))
    finally:
        for ws in sockets:
            ws.close()
        for session in native:
            session.close()
        client.close()
    return out


def _item(kind: str, value, t: float | None = None) -> dict:
    part = ({"type": "input_text", "text": value} if kind == "input_text" else
            {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(value).decode(), "t": t})
    return {"type": "message", "role": "user", "content": [part]}


def _until(ws, kind: str) -> tuple[dict, float | None]:
    """The next event of `kind`; and when a text delta came before it (None: none did)."""
    first = None
    while True:
        event = json.loads(ws.recv(timeout=300))
        if event["type"] == "response.output_text.delta" and first is None:
            first = time.perf_counter()
        if event["type"] == "error":
            raise RuntimeError(f"realtime: {event['error']['message']}")
        if event["type"] == kind:
            return event, first


def _ask_realtime(ws, text) -> tuple[float, float, str]:
    """The same over /v1/realtime: the question's item and response.create sent, events read to response.done."""
    t0 = time.perf_counter()
    ws.send(json.dumps({"type": "conversation.item.create", "item": _item("input_text", text)}))
    ws.send(json.dumps({"type": "response.create"}))
    done, first = _until(ws, "response.done")
    end = time.perf_counter()
    return (first or end) - t0, end - t0, done["response"]["output"][0]["content"][0]["text"]


def _at_once(calls) -> tuple[list, float]:
    """Every call on its own thread, started together: (their results, wall seconds)."""
    results = [None] * len(calls)

    def one(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - t0


class _FirstToken(Handler):
    def on_token(self, event: Token) -> bool:
        return True


_FIRST_TOKEN = _FirstToken()


def _ask_here(session, text) -> tuple[float, float]:
    """(time to first token, time to the whole answer) of a question asked of a live session in this process."""
    t0, first = time.perf_counter(), None
    events = session.ask(text)
    while not (event := events.get()).final:
        if first is None and event.to(_FIRST_TOKEN):
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0


def _ask_there(session, text) -> tuple[float, float, str]:
    """The same through the server: the request sent, its server-sent events read to the answer's record; and the
    answer."""
    t0, first, answer = time.perf_counter(), None, None
    for event, data in session.events(text):
        if event == "token" and first is None:
            first = time.perf_counter()
        if event == "answer":
            answer = data["answer"]
    end = time.perf_counter()
    return (first or end) - t0, end - t0, answer


def load(url: str, pid: int, clients: int, waves: int, headers: dict | None = None) -> list[dict]:
    """`clients` at once against a server of CAPACITY sessions, `waves` times; see the module's docstring."""
    from streaming.remote import encoded
    from streaming.sources import FileSource, bundled_clip

    frames = [(f.t, encoded(f.rgb)) for f in FileSource(bundled_clip(), fps=1.0)]
    server = psutil.Process(pid)
    statuses, kv_max, rss = [], [0], []

    def one(http: httpx.Client):
        opened = http.post("/v1/sessions", json={"budget": str(BUDGET), "clip_seconds": 2.0})
        statuses.append(opened.status_code)
        if opened.status_code != 201:
            return
        sid = opened.json()["id"]
        try:
            for t, data in frames:
                statuses.append(http.post(f"/v1/sessions/{sid}/frames", params={"t": t}, content=data,
                                          headers={"content-type": "image/jpeg"}).status_code)
            for text in QUESTIONS[:3]:
                statuses.append(http.post(f"/v1/sessions/{sid}/questions",
                                          json={"text": text, "stream": False}).status_code)
                state = http.get(f"/v1/sessions/{sid}")
                statuses.append(state.status_code)
                kv_max[0] = max(kv_max[0], state.json()["memory"]["kv_tokens"])
            statuses.append(http.post(f"/v1/sessions/{sid}/end").status_code)
        finally:
            statuses.append(http.delete(f"/v1/sessions/{sid}").status_code)

    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300, headers=headers) as http:
        for _ in range(waves):
            threads = [threading.Thread(target=one, args=(http,)) for _ in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rss.append(server.memory_info().rss / 2**20)
    wall = time.perf_counter() - t0
    ok = sum(200 <= s < 300 for s in statuses)
    refused = statuses.count(429)
    errors = sum(s >= 500 for s in statuses) + sum(400 <= s < 500 and s != 429 for s in statuses)
    out = [record("serve", "load", BUDGET, "requests", len(statuses), clients),
           record("serve", "load answered", BUDGET, "requests", ok, clients),
           record("serve", "load", BUDGET, "refused", refused, clients),
           record("serve", "load", BUDGET, "errors", errors, clients),
           record("serve", "load", BUDGET, "kv_tokens", kv_max[0], clients),
           record("serve", "load", BUDGET, "wall_s", round(wall, 2), clients)]
    out += [record("serve", f"load wave {i + 1}", BUDGET, "rss_mb", round(m, 1), clients) for i, m in enumerate(rss)]
    if len(rss) >= 3:
        slope = statistics.linear_regression(range(len(rss) - 1), rss[1:]).slope
        out.append(record("serve", "load after wave 1", BUDGET, "rss_slope_mb_per_round", round(slope, 2), clients))
    return out
