"""The watch benchmark's scoring (benchmarks/watch.py): what counts as a right alert, a missed event, a false alert
and a repeat, on hand-made truths; and its replay of a clip log fires what the stream's own watches fired."""

import pytest

from benchmarks.natural import pieces
from benchmarks.watch import events, replay, score, truth_of
from streaming.watches import Watches, read_watches


def test_events_are_the_runs_of_clips_that_show_the_thing():
    assert events([False, True, True, False, True]) == [(1, 2), (4, 4)]
    assert events([]) == [] and events([False, False]) == []


def test_an_event_is_alerted_once_and_everything_else_is_false_or_a_repeat():
    truth = [False, True, True, True, False, False, True, False] * 3  # 6 events in 24 clips (96 s of video)
    alerts = [1, 3, 5, 7, 9, 14, 18]  # 3 events at their first clip, one a clip late, a repeat, 2 in quiet clips
    got = score(alerts, truth)
    assert got["events"] == 6 and got["alerts"] == 7
    assert got["precision"] == pytest.approx(4 / 7) and got["recall"] == pytest.approx(4 / 6)
    hour = 24 * 4 / 3600
    assert got["false_per_hour"] == pytest.approx(2 / hour) and got["repeats_per_hour"] == pytest.approx(1 / hour)
    assert got["false_per_quiet_hour"] == pytest.approx(2 / (12 * 4 / 3600))
    assert got["latency_clips"] == 0  # the median of 0, 0, 0 and 1 clips
    assert score([], truth)["precision"] is None and score([], truth)["recall"] == 0


def test_a_person_watch_holds_the_astronaut_photo_and_a_dog_watch_holds_nothing():
    """The annotation names the astronaut photo's thing "astronaut"; it is a portrait of a person in her suit, so a
    person watch's alert there is right (the cameraman's person is in the annotation already)."""
    order = ["astronaut", "camera", "bikes-a", "bunny-a", "horse", "chelsea"]
    truth = truth_of(pieces(), order)
    assert truth["a person"] == [True, True, True, False, False, False]
    assert truth["a dog"] == [False] * 6 and truth["a cat"] == [False] * 5 + [True]


def test_the_replay_fires_what_a_stream_fires_on_the_same_clip_log():
    """Clip-log entries as the engine logs them (the detector's vote, `objects`): a person for 3 clips, gone for 3,
    back; a car in one clip."""
    person, car = {"person": 1}, {"car": 2}
    shown = [person, person, person, {}, {}, {}, person, car, {}]
    log = [{"clip": k + 1, "start": k * 4.0, "end": (k + 1) * 4.0, "objects": objects, "seen": ", ".join(objects)}
           for k, objects in enumerate(shown)]
    texts = ["a person", "a car"]
    stream = Watches(read_watches(texts, 2, 0.0), "s")
    fired = [(a["alert"], a["clip"] - 1) for meta in log for a in stream.judge(meta)]
    assert fired == [("a person", 0), ("a person", 6), ("a car", 7)]
    assert replay(log, 2, 0.0, texts) == {"a person": [0, 6], "a car": [7]}
    assert replay(log, 2, 30.0, texts)["a person"] == [0]  # 24 s after the first alert's clip ended: cooling down
