"""Answers about the frames that were sent and about now: `python -m benchmarks now [--old-tree DIR]`.

On the real bikes.mp4 (a cyclist rides in at 5 s) with the real tiny-vlm, through each front end a user meets:

- `stream-qa --fast`, and the app's path (a `LiveSession` over the player-driven source, asked without a time at the
  player's position), and the server's native route (frames pushed up to the first one past the question's time,
  asked `at` it): "is there a bicycle now?" at every half second from 4.5 to 7.5 s. Each answer's stamp, and whether
  it says yes exactly where the frames up to its time show the bicycle (the detector's clip log: its first clip
  with one). `--old-tree DIR` runs the `stream-qa` path on that checkout too.
- `/v1/chat/completions` through the official `openai` client: the bundled clip's 10 frames at 1 fps and "is there
  a bicycle?", 10 times: the stamp (`usage.stream_qa.video_t`) of each, the last frame's time being 9 s.
- `/v1/realtime` through the official client: 8 frames sent at once without times, a question, `response.create`:
  error events (0 wanted), the answer's stamp (7 s: the burst spaced at 1 fps) and clips taken.

Writes `now.json` (records: `video_s` the stamp, `accuracy` 1 when yes/no matched the frames, `errors`, `clips`) and
`now.png` (the stamps and the right answers against the time asked, per front end).
"""

import base64
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from streaming.records import plot, print_table, record, write

QUESTION = "is there a bicycle now?"
TIMES = [float(t) for t in np.arange(4.5, 7.75, 0.5)]


def asked(path: str, rows: list[tuple[float, float, str]], bicycle_from: float) -> list[dict]:
    out = []
    for t, stamp, answer in rows:
        said_yes = answer.strip().lower().startswith("yes")
        out += [record("now", path, None, "video_s", stamp, t),
                record("now", path, None, "accuracy", float(said_yes == (t >= bicycle_from)), t)]
    return out


def cli_path(tree: Path) -> tuple[list, float]:
    """`stream-qa --fast --json --clips` with the half-second questions, run in `tree`'s own process."""
    argv = [sys.executable, "-m", "streaming.cli", "--fast", "--json", "--clips", "--budget", "96",
            *[a for t in TIMES for a in ("--ask", f"{QUESTION} @{t:g}s")]]
    run = subprocess.run(argv, cwd=tree, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    answers = [d for d in lines if "answer" in d]
    first = min(d["start"] for d in lines if "clip" in d and "bicycle" in (d.get("objects") or {}))
    return [(t, a["video_t"], a["answer"]) for t, a in zip(TIMES, answers, strict=True)], first


def app_path() -> list:
    """The app's way: a live session over the player-driven source; each question asked without a time, at the
    position the player reports."""
    import threading

    from models import load_adapter
    from streaming.live import LiveSession
    from streaming.page_sources import PlaybackSource
    from streaming.sources import bundled_clip

    vlm, held = load_adapter("tiny-vlm"), {}

    def make(stop: threading.Event):
        held["player"] = PlaybackSource(bundled_clip(), stop, fps=1.0)
        held["player"].report(0.0)
        return held["player"]

    live = LiveSession(vlm, vlm.new_session("inf_mllm+recall", budget=96), make, "bikes.mp4", clip_seconds=4.0)
    rows = []
    try:
        for t in TIMES:
            held["player"].report(t)
            while (held["player"].yielded_t or 0) < int(t):  # the viewer asks once ingest is up with the player
                time.sleep(0.01)
            out = live.ask(QUESTION)
            got = _record(out)
            rows.append((t, got.video_t, got.answer))
    finally:
        live.close()
    return rows


def _record(out):
    """The answer's record off a question's queue: this tree's `Done` event, or the old tree's record itself."""
    for item in iter(partial(out.get, timeout=300), object()):
        if getattr(item, "final", False):  # this tree: `Done` holds the record, `Unanswered` says why not
            if not hasattr(item, "answer"):
                raise RuntimeError(f"unanswered: {item}")
            return item.answer
        if hasattr(item, "ttft_s"):  # the old tree put the record itself
            return item
    raise RuntimeError("the queue ended without an answer")


def served(tmp: Path) -> tuple[list, list, dict]:
    """The server's three ways on one real `python -m serve`: native `at`, chat completions, Realtime."""
    from openai import OpenAI

    from jetson.reliability.serving import TOKEN, serving
    from streaming.remote import Client, encoded
    from streaming.sources import FileSource, bundled_clip

    frames = [encoded(f.rgb) for f in FileSource(bundled_clip(), fps=1.0)]
    data = ["data:image/jpeg;base64," + base64.b64encode(f).decode() for f in frames]
    with serving(tmp) as (url, _, _):
        native, rows = Client(url, token=TOKEN), []
        for t in TIMES:
            session = native.open(budget="96", clip_seconds=4.0)
            for i, frame in enumerate(frames[:int(t) + 2]):  # up to the first frame past t
                session.push(frame, float(i))
            answer = session.answer(QUESTION, at=t)
            rows.append((t, answer["video_t"], answer["answer"]))
            session.close()
        native.close()
        client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
        content = [{"type": "image_url", "image_url": {"url": u}} for u in data]
        chat = []
        for _ in range(10):
            reply = client.chat.completions.create(model="tiny-vlm", messages=[
                {"role": "user", "content": content + [{"type": "text", "text": "is there a bicycle?"}]}])
            chat.append(reply.usage.model_extra["stream_qa"]["video_t"])
        with client.realtime.connect(model="tiny-vlm") as connection:
            session_id = connection.recv().session.id
            for u in data[:8]:
                connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_image", "image_url": u}]})
            connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "is there a bicycle?"}]})
            connection.response.create()
            errors = 0
            for event in connection:
                errors += event.type == "error"
                if event.type == "response.done":
                    record_ = event.response.usage.model_extra["stream_qa"]
                    break
            state = Client(url, token=TOKEN).http.get(f"/v1/sessions/{session_id}").json()
        realtime = {"errors": errors, "video_t": record_["video_t"], "clips": state["telemetry"]["clips"]}
    return rows, chat, realtime


def run(args) -> None:
    root = Path(__file__).resolve().parents[1]
    rows, bicycle_from = cli_path(root)
    records = asked("stream-qa", rows, bicycle_from)
    if args.old_tree:
        old, _ = cli_path(Path(args.old_tree))
        records += asked("stream-qa (old tree)", old, bicycle_from)
    records += asked("app", app_path(), bicycle_from)
    with tempfile.TemporaryDirectory() as tmp:
        native, chat, realtime = served(Path(tmp))
    records += asked("server at=T", native, bicycle_from)
    records += [record("now", "chat completions", None, "video_s", v, k) for k, v in enumerate(chat, start=1)]
    records += [record("now", "realtime burst", None, m, realtime[k], 8)
                for m, k in (("errors", "errors"), ("video_s", "video_t"), ("clips", "clips"))]
    halves = [r for r in records if r["policy"] not in ("chat completions", "realtime burst")]
    print_table(halves, ["video_s", "accuracy"])
    print(f"chat completions: stamps {sorted(set(chat))} over {len(chat)} runs (the last frame: 9.0 s); realtime "
          f"burst: {realtime}; the bicycle first in the frames at {bicycle_from:g} s")
    write(args.out, "now", records, [])
    plot(Path(args.out) / "now.png", "now", halves, ["video_s", "accuracy"], x_label="asked at (video seconds)")
