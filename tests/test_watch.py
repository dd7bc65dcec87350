"""Watches: standing conditions in plain words judged on each clip's clip-log entry, and the alerts they fire, on real
footage with the real detector and tiny-vlm (`stream-qa --watch`), kept in the session folder across a kill -9."""

import json
import signal
import subprocess
import sys
import time

import cv2
import pytest

from models.watch import judge, read_watch
from streaming.watches import Watcher, Watches, alert_line, read_watches

STREAM_QA = [sys.executable, "-m", "streaming.cli"]


@pytest.mark.parametrize("text, things, at_least, fewer, leaves, once", [
    ("a person", ("person",), 1, None, False, False),
    ("tell me when a person is at the door", ("person",), 1, None, False, False),
    ("Alert me if someone enters the garage", ("person",), 1, None, False, False),
    ("more than 2 people", ("person",), 3, None, False, False),
    ("if more than two people are in the room", ("person",), 3, None, False, False),
    ("at least three cars", ("car",), 3, None, False, False),
    ("two cars @once", ("car",), 2, None, False, True),
    ("fewer than 3 cars", ("car",), 1, 3, False, False),
    ("a bicycle and a person", ("bicycle", "person"), 1, None, False, False),
    ("the cyclist", ("bicycle",), 1, None, False, False),
    ("the car leaves", ("car",), 1, None, True, False),
    ("a truck drives off", ("truck",), 1, None, True, False),
    ("a dog appears", ("dog",), 1, None, False, False),
])
def test_a_watch_in_plain_words_names_the_detectors_things(text, things, at_least, fewer, leaves, once):
    watch = read_watch(text)
    assert (watch.things, watch.at_least, watch.fewer_than, watch.leaves, watch.once) == \
        (things, at_least, fewer, leaves, once)
    assert watch.judged_by == "detector"


@pytest.mark.parametrize("text, judged_by, question", [
    ("is the door open?", "model", "is the door open?"),
    ("Tell me when the garage door is open @once", "model", "is the garage door open?"),
    ("it is raining", "model", "is it raining?"),
    ("a parking meter", "model", "is there a parking meter?"),
    ("is someone lying on the floor?", "detector+model", "is someone lying on the floor?"),
    ("a dog on the sofa", "detector+model", "is there a dog on the sofa?"),
    ("a person at the door", "detector", "is there a person at the door?"),
])
def test_a_watch_naming_more_than_the_detector_counts_is_the_models_yes_or_no_question(text, judged_by, question):
    watch = read_watch(text)
    assert (watch.judged_by, watch.question) == (judged_by, question)


def test_a_model_judged_watch_fires_on_its_first_yes_and_a_confirmed_one_asks_only_where_the_counts_hold():
    asked = []

    def answers(*said):  # the model's answers, in order, to whatever it is asked
        replies = iter(said)
        return lambda questions: [asked.append(question) or next(replies) for question in questions]

    door = Watches(read_watches(["the door is open"], 1, 0), "s")
    ask = answers("no", "yes", "Yes", "no", "yes")
    fired = [a for k in range(1, 6) for a in door.judge(clip(k), ask=ask)]
    assert [a["clip"] for a in fired] == [2, 5] and asked == ["is the door open?"] * 5
    assert fired[0]["description"] == "yes: is the door open?"
    assert fired[0]["provenance"] == "the model's answer after clip 2"
    assert fired[0]["evidence"] == {"model": {"asked": "is the door open?", "answer": "yes"}}
    # a question that failed (None) or was not asked leaves the watch as it was: the next yes is still its first
    failed = Watches(read_watches(["the door is open"], 1, 0), "s")
    assert failed.judge(clip(1), ask=lambda qs: [None]) == [] and failed.judge(clip(2)) == []
    assert [a["clip"] for a in failed.judge(clip(3), ask=lambda qs: ["yes"])] == [3]
    # verified: asked only on the clips that count a person, fired where the model says yes to the whole sentence
    asked.clear()
    lying = Watches(read_watches(["a person lying on the floor"], 1, 0), "s")
    ask = answers("no", "yes")
    fired = [a for meta in (clip(1), clip(2, person=1), clip(3), clip(4, person=1)) for a in lying.judge(meta, ask=ask)]
    assert asked == ["is there a person lying on the floor?"] * 2 and [a["clip"] for a in fired] == [4]
    assert fired[0]["description"] == "a person, and the model says yes: is there a person lying on the floor?"
    assert fired[0]["provenance"].endswith("a person in the frame at 0:12, confirmed by the model's answer")


@pytest.mark.parametrize("text, said", [
    ("", "needs words"), ("   @once", "needs words"), ("a person " * 40, "at most 200 characters"),
])
def test_a_watch_that_cannot_be_watched_is_refused_in_one_line(text, said):
    with pytest.raises(ValueError, match=said) as err:
        read_watches([text])
    assert "\n" not in str(err.value)


def clip(k: int, **objects) -> dict:
    """A clip-log entry as the engine writes it: 4-s clips, the detector's counts, each counted in the clip's first
    frame."""
    return {"clip": k, "start": 4.0 * (k - 1), "end": 4.0 * k, "seen": ", ".join(objects) or "nothing recognised",
            "objects": objects, "boxes": [], "counted_at": {w: 4.0 * (k - 1) for w in objects}}


def fires(watcher: Watcher, clips: list[dict]) -> list[int]:
    return [meta["clip"] for meta in clips if watcher.step(meta) is not None]


def test_an_alert_fires_on_the_rising_edge_and_rearms_after_clips_without_it_and_a_cooldown():
    seen = [clip(1), clip(2, person=1), clip(3, person=1), clip(4), clip(5, person=1), clip(6), clip(7),
            clip(8, person=2), clip(9), clip(10), clip(11, person=1)]
    assert fires(Watcher(read_watch("a person"), 0, rearm_clips=2, cooldown_s=0), seen) == [2, 8, 11]
    # a cooldown of 30 s of video: the person back at 28 s (clip 8) is within it, the one at 40 s is not
    assert fires(Watcher(read_watch("a person"), 0, rearm_clips=2, cooldown_s=30), seen) == [2, 11]
    assert fires(Watcher(read_watch("a person @once"), 0, rearm_clips=1, cooldown_s=0), seen) == [2]
    assert fires(Watcher(read_watch("more than 1 person"), 0, rearm_clips=1, cooldown_s=0), seen) == [8]


def test_a_thing_leaves_once_it_was_seen_and_a_count_and_a_pair_are_judged_on_one_clip():
    seen = [clip(1), clip(2, car=1), clip(3, car=2), clip(4), clip(5, car=1), clip(6)]
    # armed after 2 clips with the car (a car found once is not one that left), fired on the first without it
    assert fires(Watcher(read_watch("the car leaves"), 0, rearm_clips=2, cooldown_s=0), seen) == [4]
    holds, evidence = judge(read_watch("a bicycle and a person"), clip(1, bicycle=2, person=1))
    assert holds and evidence == {"bicycle": {"count": 2, "frame_t": 0.0}, "person": {"count": 1, "frame_t": 0.0}}
    assert not judge(read_watch("a bicycle and a person"), clip(1, bicycle=2))[0]
    assert not judge(read_watch("at least 3 cars"), clip(1, car=2))[0]


def test_a_resumed_stream_replays_its_clips_so_no_event_alerts_twice(tmp_path):
    seen = [clip(1), clip(2, person=1), clip(3, person=1), clip(4), clip(5), clip(6, person=1)]
    whole = Watches(read_watches(["a person"], 2, 0), "s")
    alerts = [a for meta in seen for a in whole.judge(meta)]
    first = Watches(read_watches(["a person"], 2, 0), "s")
    before = [a for meta in seen[:3] for a in first.judge(meta)]
    resumed = Watches(read_watches(["a person"], 2, 0), "s")
    resumed.replay(seen[:3], before)
    after = [a for meta in seen[3:] for a in resumed.judge(meta)]
    assert [a["id"] for a in before + after] == [a["id"] for a in alerts] and [a["clip"] for a in alerts] == [2, 6]
    # an alert written just before a kill, its clip not yet in clips.jsonl: the watch is as that alert left it
    cut = Watches(read_watches(["a person"], 2, 0), "s")
    cut.replay(seen[:1], before)
    assert [a["clip"] for meta in seen[1:] for a in cut.judge(meta)] == [6]


def run_cli(*args, timeout=300):
    return subprocess.run([*STREAM_QA, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_stream_qa_watch_alerts_in_the_clip_that_first_shows_it_with_a_snapshot_of_that_frame(tmp_path):
    out = run_cli("--fast", "--json", "--clips", "--ask", "is there a bicycle now? @8s", "--ask",
                  "what happened while I was away? @10s", "--watch", "a person",
                  "--watch", "a bicycle @once", "--watch", "the car leaves", "--session", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    clips = [r for r in rows if "seen" in r and "alert" not in r]
    alerts = [r for r in rows if "alert" in r]
    answers = [r for r in rows if "question" in r]
    assert [r["question"] for r in answers] == ["is there a bicycle now?", "what happened while I was away?"]
    first_person = next(c["clip"] for c in clips if c["objects"].get("person"))
    person = [a for a in alerts if a["alert"] == "a person"]
    assert [a["clip"] for a in person] == [first_person]  # bikes.mp4: the cyclist, once (10 s < the cooldown)
    assert len([a for a in alerts if a["alert"] == "a bicycle"]) == 1
    gone = next(c["clip"] for c in clips if c["clip"] > 1 and not c["objects"].get("car"))
    assert [a["clip"] for a in alerts if a["alert"] == "the car leaves"] == [gone]
    for a in alerts:  # each alert after its clip's record, with its keys, in the folder and its picture on disk
        assert rows.index(a) > rows.index(next(c for c in clips if c["clip"] == a["clip"]))
        assert {"id", "video_t", "clip", "snapshot", "provenance", "description", "evidence"} <= set(a)
        image = cv2.imread(a["snapshot"])
        assert image is not None and image.shape[1] <= 640 and image.shape[2] == 3
    assert person[0]["evidence"]["person"]["frame_t"] == person[0]["snapshot_t"]
    stored = [json.loads(line) for line in (tmp_path / "s" / "alerts.jsonl").read_text().splitlines()]
    assert stored == alerts
    # asked after them, the alerts are read off the alert log, each with its time, watch and clip
    away = answers[1]
    assert away["looked_up"] == "the alert log" and away["answer"].startswith(f"{len(alerts)} alerts: ")
    assert all(f"{a['alert']}: {a['description']} (clip {a['clip']})" in away["answer"] for a in alerts)
    # without --json, the line stream-qa prints for it
    assert alert_line(person[0]) == (f"[{person[0]['video_t']:7.1f}s] ALERT a person: a person   (clip {first_person}; "
                                     f"clip {first_person}'s detections: a person in the frame at 0:0"
                                     f"{int(person[0]['snapshot_t'])})")


@pytest.mark.parametrize("args, said", [
    (["--watch", ""], "--watch: a watch needs words"),
    (["--watch", "x" * 10_000], "at most 200 characters"),
    (["--watch", "is the door open?", "--policy", "h2o"], "needs the model's answer, and policy h2o evicts while"),
    ([f"--watch=person {i}" for i in range(1000)], "at most 64 watches"),
    (["--watch", "a person", "--watch-cooldown", "-1"], "--watch-cooldown must be"),
    (["--watch", "a person", "--watch-rearm", "0"], "--watch-rearm must be"),
    (["--watch", "a person", "--server", "http://127.0.0.1:9"], "--watch runs here"),
    (["--webhook", "http://127.0.0.1:9/hook"], "--webhook sends alerts: give a --watch too"),
    (["--watch", "a person", "--webhook", "file:///etc/passwd"], "a webhook is an http:// or https:// URL"),
    (["--watch", "a person", "--webhook", "ftp://127.0.0.1/x"], "a webhook is an http:// or https:// URL"),
    (["--watch", "a person", "--webhook", "http://:80/x"], "names no host"),
    (["--mqtt", "mqtt://127.0.0.1:9"], "--mqtt sends alerts: give a --watch too"),
    (["--watch", "a person", "--mqtt", "http://127.0.0.1/x"], "an MQTT broker is an mqtt:// or mqtts:// URL"),
    (["--watch", "a person", "--mqtt", "mqtt://[::1"], "not a URL that can be read"),
    (["--watch", "a person", "--mqtt", "mqtt://127.0.0.1/cams/+/x"], "holds a wildcard or an empty level"),
])
def test_a_bad_watch_is_one_line_and_exit_2_before_the_model_loads(args, said):
    out = run_cli(*args, timeout=60)
    assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
def test_a_killed_stream_qa_resumed_keeps_every_alert_and_alerts_each_event_once(tmp_path):
    folder = tmp_path / "s"
    args = ["--loop", "4", "--fast", "--ask", "what is on screen? @39s", "--watch", "a person", "--watch-cooldown", "0",
            "--watch-rearm", "1"]
    whole = run_cli(*args, "--json", "--session", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    expected = [json.loads(line) for line in whole.stdout.splitlines() if '"alert"' in line]
    assert len(expected) == 4  # the cyclist comes back with every loop
    proc = subprocess.Popen([*STREAM_QA, *args, "--json", "--session", str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    printed = []
    for line in proc.stdout:  # killed right after its second alert is printed
        printed += [json.loads(line)] if '"alert"' in line else []
        if len(printed) == 2:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    out = run_cli("--resume", str(folder), "--json")
    assert out.returncode == 0, out.stderr
    stored = [json.loads(line) for line in (folder / "alerts.jsonl").read_text().splitlines()]
    ids = [a["id"] for a in stored]
    assert len(ids) == len(set(ids))  # no event alerted twice
    assert [a["id"] for a in printed] == ids[:2]  # every alert printed before the kill was on disk first
    # the same events as the unbroken run, clip for clip (the folders differ, so the ids do)
    assert [(a["alert"], a["clip"]) for a in stored] == [(a["alert"], a["clip"]) for a in expected]
    assert all(a["session"] == "s" for a in stored)


def test_stream_qa_posts_each_alert_to_its_webhook_again_after_a_503_with_the_same_id():
    from tests.webhook_receiver import Receiver

    receiver = Receiver(fail=1)
    try:
        out = run_cli("--fast", "--json", "--ask", "is there a car? @4s", "--watch", "a person", "--webhook",
                      f"{receiver.url}/hook")
    finally:
        receiver.close()
    assert out.returncode == 0, out.stderr
    alerts = [json.loads(line) for line in out.stdout.splitlines() if '"alert"' in line]
    assert len(alerts) == 1
    # refused once (503), posted again with the same id: at least once, and the receiver can tell it is a repeat
    assert receiver.posts == [("/hook", alerts[0]["id"], alerts[0])] * 2


def test_webhooks_never_wait_for_a_slow_receiver_nor_follow_a_redirect_nor_reach_a_refused_address():
    from streaming.events import Alert
    from streaming.urls import LOCAL, SERVER
    from streaming.webhooks import Webhooks
    from tests.webhook_receiver import Receiver

    alert = {"id": "a1", "alert": "a person"}
    slow = Receiver(delay_s=2.0, redirect=("/moved",))
    try:
        hooks = Webhooks([f"{slow.url}/hook", f"{slow.url}/moved"], LOCAL, first_wait_s=0.05)
        t0 = time.perf_counter()
        for i in range(3):
            hooks.put(Alert(alert | {"id": f"a{i}"}))
        queued_s = time.perf_counter() - t0
        hooks.close(wait_s=30)
        assert queued_s < 0.05  # the stream's thread hands each alert over and goes on
        paths = [path for path, _, _ in slow.posts]
        assert paths.count("/hook") == 3 and paths.count("/moved") == 3 and "/elsewhere" not in paths
        assert hooks.counts == {"delivered": 3, "retried": 0, "failed": 3, "dropped": 0}  # a 302 is not retried
        refused = Webhooks([f"{slow.url}/hook"], SERVER, first_wait_s=0.05)  # the server's rules: no loopback
        refused.put(Alert(alert))
        refused.close(wait_s=10)
        assert refused.counts["failed"] == 1 and len(slow.posts) == 6  # nothing reached the refused address
    finally:
        slow.close()


def test_the_real_model_answers_a_watch_after_each_clip_and_its_question_leaves_no_trace_in_the_stream(vlm):
    """The real tiny-vlm on bikes.mp4: "a parking meter" (no detector counts one) fires on clip 3, the clip whose words
    hold it, and not before; the stream's own answers, clip log and cache after every clip are those of the same run
    without the watch (each watch's question left the cache with its answer)."""
    from streaming.engine import TurnEngine
    from streaming.questions import Question, Schedule
    from streaming.sources import FileSource, bundled_clip
    from streaming.watches import session_watches

    def run(watches):
        engine = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=512), clip_seconds=4.0)
        engine.watches = session_watches("bikes", watches)
        kv, alerts = [], []
        schedule = Schedule([Question("is there a bicycle?", 6.0), Question("what is on screen?", 9.0),
                             Question("is there a parking meter?")])

        def seen(_clip):
            kv.append(engine.session.kv_tokens)
            alerts.extend(engine.fired)

        answers = [(a.video_t, a.answer, a.kv_tokens) for a in
                   engine.run(FileSource(bundled_clip(), fps=1.0), schedule, on_clip=seen)]
        return answers, [{k: m[k] for k in ("clip", "start", "end", "seen")} for m in engine.log], kv, alerts

    plain = run([])
    watched = run(["a parking meter", "a person with a helmet"])
    assert watched[:3] == plain[:3]
    assert [(a["alert"], a["clip"], a["description"]) for a in watched[3]] == \
        [("a parking meter", 3, "yes: is there a parking meter?")]
    words = [meta["seen"] for meta in watched[1]]
    assert "parking meter" in words[2] and "parking meter" not in words[0] + words[1]
