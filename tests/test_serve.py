"""The streaming-session server (serve/) as a client meets it: a real `python -m serve` on loopback, real HTTP
clients (httpx, and `stream-qa --server`), real video; the bad-request rows of the reliability table."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import httpx
import pytest

from jetson.reliability.server import run_rows
from jetson.reliability.serving import TOKEN, free_port, serving
from streaming.remote import Client, RemoteError
from streaming.sources import FileSource, bundled_clip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve")) as running:
        yield running


@pytest.fixture
def client(server):
    url, _, _ = server
    c = Client(url, token=TOKEN)
    yield c
    c.close()


@pytest.mark.slow  # ~126 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_every_bad_request_gets_its_status_in_one_json_line_and_the_server_stays_up(server):
    url, media, process = server
    rows = run_rows(url, media, pid=process.pid)
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) >= 150 and not bad, bad
    assert process.poll() is None


def test_pushed_frames_answer_as_server_sent_events_and_the_session_reports_itself(client, server):
    session = client.open(budget="256", clip_seconds=2.0)
    try:
        frames = list(FileSource(bundled_clip(), fps=1.0))  # 10 real frames, 0..9 s
        for frame in frames[:6]:
            assert session.push(frame.rgb, frame.t)["frames"] >= 1
        events = list(session.events("is there a bicycle now?", at=4.0))
        kinds = [e for e, _ in events]
        started = kinds.index("start")  # before it, only `waiting` (the video had not reached 4 s when asked)
        assert set(kinds[:started]) <= {"waiting"} and kinds[-1] == "answer" and set(kinds[started + 1:-1]) <= {"token"}
        assert all(d["needed"] == 4.0 and d["video_t"] < 4.0 for e, d in events if e == "waiting")
        record = events[-1][1]
        assert record["video_t"] == 4.0  # asked at 4 s: answered once every frame up to 4 s was in
        assert record["answer"] == "".join(d["text"] for e, d in events if e == "token").strip()
        assert record["kv_tokens"] > 0 and record["ttft_s"] > 0
        # the rest as one chunk of the video file, then the end: a question timed past the end says so; one asked
        # after the end, untimed, is answered about every frame pushed, at the last one's time
        data = Path(bundled_clip()).read_bytes()
        pushed = session.push_video(data, start=6.0)
        assert pushed["from"] == 6.0 and pushed["to"] == pytest.approx(15.0) and pushed["frames"] == 16
        asked = session.events("what is on screen?", at=100.0)
        session.end()
        with pytest.raises(RemoteError, match=r"ended at 16.0 s of video, before this question's time \(100 s\)"):
            list(asked)
        late = session.answer("what is on screen?")
        assert late["video_t"] == pytest.approx(15.0)
        state = session.state()
        # 0-1, 2-3, 4 (closed for the question at 4 s), 5-6, …, 13-14, 15
        assert state["telemetry"]["clips"] == 9 and state["telemetry"]["answers"] == 2
        assert state["memory"]["kv_tokens"] <= 256 + 50 and state["budget_tokens"] == 256  # + question, answer
        assert [a["question"] for a in session.transcript()] == ["is there a bicycle now?", "what is on screen?"]
        metrics = client.http.get("/metrics").text
        assert f'stream_qa_kv_bytes{{session="{session.id[:8]}"}}' in metrics
        assert "stream_qa_time_to_first_token_seconds_count" in metrics
    finally:
        session.close()
    with pytest.raises(RemoteError, match="no such session") as err:
        session.state()
    assert err.value.status == 404


def test_a_pulled_file_plays_inside_the_media_folder(client):
    session = client.open(budget="256", source={"file": "bikes.mp4", "realtime": False})
    try:
        record = session.answer("is there a bicycle now?", at=6.0)
        assert record["video_t"] == 6.0 and record["answer"]
        assert session.state()["source"] == {"kind": "file", "file": "bikes.mp4"}
    finally:
        session.close()


def _records(stdout: str) -> list[dict]:
    timing = {"ttft_s", "tokens_per_s", "rss_mb"}
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in stdout.splitlines()]


@pytest.mark.slow  # ~38 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_stream_qa_on_a_server_answers_what_it_answers_here(server):
    url, _, _ = server
    args = [sys.executable, "-m", "streaming.cli", "--fast", "--budget", "256", "--json"]
    env = dict(os.environ, STREAM_QA_TOKEN=TOKEN)
    remote = subprocess.run([*args, "--server", url], capture_output=True, text=True, timeout=300, env=env)
    here = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert remote.returncode == here.returncode == 0, remote.stderr
    assert _records(remote.stdout) == _records(here.stdout) and len(_records(here.stdout)) == 7
    wrong = subprocess.run([*args, "--server", url], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, STREAM_QA_TOKEN="nope"))
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines()[-1].startswith("stream-qa: server: a bearer")
    down = subprocess.run([*args, "--server", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=300)
    assert down.returncode == 2 and "Traceback" not in down.stderr and "ConnectError" in down.stderr


def test_the_server_refuses_bad_options_in_one_line(tmp_path):
    for argv, why in ((["--media", str(tmp_path / "none")], "no such folder"), (["--max-sessions", "0"], "above 0")):
        out = subprocess.run([sys.executable, "-m", "serve", *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_openapi_docs_are_served(server):
    url, _, _ = server
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/sessions", "/v1/sessions/{session_id}/frames", "/v1/sessions/{session_id}/questions",
            "/healthz", "/metrics"} <= set(spec["paths"])
    assert httpx.get(f"{url}/docs").status_code == 200


@pytest.mark.slow  # ~31 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_a_session_with_a_folder_continues_in_a_new_server_after_a_kill(tmp_path):
    """kill -9 mid-stream: every answer delivered and every clip stored is there when the next server process
    continues the session at its next request; the client's next frames and questions go on."""
    folders = tmp_path / "sessions"
    frames = list(FileSource(bundled_clip(), fps=1.0))
    with serving(tmp_path / "one", "--sessions", str(folders)) as (url, _, process):
        client = Client(url, token=TOKEN)
        session = client.open(budget="256", clip_seconds=2.0)
        for frame in frames[:7]:
            session.push(frame.rgb, frame.t)
        first = session.answer("is there a bicycle now?", at=4.0)
        stored = session.state()["telemetry"]["clips"]
        process.kill()
        process.wait()
    assert stored >= 2 and (folders / session.id / "transcript.jsonl").read_text().count("\n") == 1
    with serving(tmp_path / "two", "--sessions", str(folders)) as (url, _, _):
        client = Client(url, token=TOKEN)
        session.client = client  # the same session id, on the new process
        assert session.transcript() == [first]  # delivered before the kill: kept
        for frame in frames[7:]:
            session.push(frame.rgb, frame.t)  # frame 6 went to the killed process unstored: lost
        session.end()
        late = session.answer("what was on screen at the start?", at=10.0)  # the video's end (frames 0-9 s)
        assert late["video_t"] >= 10.0 and late["answer"]
        assert "clip 1" in late["looked_up"]  # the first clip, stored before the kill, answers it
        assert [a["question"] for a in session.transcript()] == ["is there a bicycle now?",
                                                                 "what was on screen at the start?"]
        session.close()
        with pytest.raises(RemoteError, match="no such session"):
            session.state()  # closed by its client: never continued again


@pytest.mark.slow  # ~26 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_at_twice_its_capacity_every_request_is_answered_or_refused_with_429(server):
    """A bounded load: 8 clients at once against 4 sessions (and 2 questions in flight), each opening, pushing the
    clip, asking three questions and closing; then the server is still up and holds none of theirs."""
    from benchmarks.serve import load

    url, _, process = server
    held = httpx.get(f"{url}/healthz").json()["sessions"]  # the module's server: an earlier test's may still be open
    records = {(r["policy"], r["metric"]): r["value"]
               for r in load(url, process.pid, clients=8, waves=1, headers={"Authorization": f"Bearer {TOKEN}"})}
    assert records[("load", "errors")] == 0 and records[("load", "refused")] > 0
    assert records[("load answered", "requests")] >= 4 * 13  # the first 4 clients: open, 10 frames, end, close
    assert records[("load", "kv_tokens")] <= 256 + 50  # every session within its budget (+ question and answer)
    assert httpx.get(f"{url}/healthz").json()["sessions"] == held and process.poll() is None  # its 8 all released


SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, with PyGObject: GStreamer's RTSP server is a GObject library


def rtsp_server_here() -> bool:
    probe = ("import gi; gi.require_version('GstRtspServer', '1.0'); gi.require_version('Gst', '1.0'); "
             "from gi.repository import Gst, GstRtspServer; Gst.init(None); "
             "assert Gst.ElementFactory.find('rtpjpegpay')")
    return os.path.exists(SYSTEM_PYTHON) and subprocess.run([SYSTEM_PYTHON, "-c", probe],
                                                            capture_output=True).returncode == 0


@contextlib.contextmanager
def rtsp_camera(folder: Path):
    """The bundled clip's frames served over RTSP on loopback at 25 fps, paced as a camera (tests/rtsp_server.py)."""
    frames = folder / "frames"
    frames.mkdir()
    capture, n, (height, width) = cv2.VideoCapture(bundled_clip()), 0, (0, 0)
    while True:
        ok, bgr = capture.read()
        if not ok:
            break
        cv2.imwrite(str(frames / f"{n:04d}.jpg"), bgr)
        n, (height, width) = n + 1, bgr.shape[:2]
    capture.release()
    script = Path(__file__).parent / "rtsp_server.py"
    process = subprocess.Popen([SYSTEM_PYTHON, str(script), str(frames), str(free_port()), str(width), str(height),
                                "25"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("ready "), line + process.stdout.read()
        yield line.split()[1]
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.slow  # the camera plays its 10 s twice (server, then stream-qa)
@pytest.mark.skipif(not rtsp_server_here(), reason="needs Debian's GStreamer RTSP server: make rtsp installs it")
def test_an_rtsp_camera_on_loopback_is_pulled_by_the_server_and_by_stream_qa(client, tmp_path):
    with rtsp_camera(tmp_path) as url:
        session = client.open(budget="256", clip_seconds=2.0, source={"url": url})
        try:
            record = session.answer("is there a bicycle now?", at=4.0)
            # a live source's clips end where the wall clock cut them: the answer comes at the turn boundary that
            # reaches 4 s, after the clips before it (its video_t: the video the model had seen)
            assert record["video_t"] > 0 and record["answer"] and record["kv_tokens"] > 0
            state = session.state()
            assert state["source"] == {"kind": "url", "url": url} and state["telemetry"]["clips"] >= 2
        finally:
            session.close()
        run = subprocess.run([sys.executable, "-m", "streaming.cli", "--url", url, "--budget", "256", "--json",
                              "--ask", "is there a bicycle? @4s"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1 and answers[0]["video_t"] > 0 and answers[0]["answer"], run.stdout


def test_one_cap_a_servers_max_sessions_is_what_its_model_pools_admit():
    """The server's count and the pool's admission are one number: `--max-sessions`, set at the app's creation on
    the host's pools already open (and on those opened after it, `Host.limit_streams`)."""
    from serve.api import create_app
    from serve.limits import ServerConfig
    from streaming.hosted import Host

    host = Host()
    pool = host.pool("tiny-vlm")
    app = create_app(ServerConfig(max_sessions=3, preload=()), host=host)
    assert pool.admission.max_streams == 3 and host.pool("tiny-vlm") is pool and app.state.server.host is host
    assert Host().max_streams == 64  # another process's host (or another server's) has its own cap
    pool.close()
