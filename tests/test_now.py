""""Now" means now: a question asked at video time T is answered about every frame at or before T (the clip open at T
closes there for it) and stamped T; the grouping of clips is unchanged where no question cuts it. The player-driven
source of the app on the real bikes.mp4 with the real tiny-vlm: "is there a bicycle now?" asked at every half second
from 4.5 to 7.5 s, as a viewer asks it while the cyclist rides through."""

import threading
import time
from functools import partial

import numpy as np
import pytest

from streaming.clips import ClipGrouper, Cuts, grouped
from streaming.events import Done, Started
from streaming.frames import Frame
from streaming.live import LiveSession
from streaming.page_sources import PlaybackSource
from streaming.sources import bundled_clip, handed_over


def frames_at(*times):
    return [Frame(float(t), np.zeros((4, 4, 3), np.uint8)) for t in times]


def test_without_questions_clips_close_at_clip_seconds_and_end_where_the_next_begins():
    clips = list(grouped(frames_at(*range(10)), 2.0))
    assert [times for _, times in clips] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    grouper = ClipGrouper(4.0)
    closed = [c for f in frames_at(0, 1, 2, 3, 4) if (c := grouper.add(f))]
    assert [(c[1], c[2], c[3]) for c in closed] == [([0, 1, 2, 3], 4.0, False)]
    assert grouper.close()[2:] == (5.0, False)  # a lone last frame stands for the interval between frames, not 4 s


def test_a_question_closes_the_open_clip_after_its_last_frame_at_or_before_its_time():
    grouper = ClipGrouper(4.0)
    for f in frames_at(4, 5):
        assert grouper.add(f) is None
    assert grouper.cut(5.5, passed=False) is None  # a frame at 5.2 may still come
    assert grouper.cut(5.0, passed=False)[1:] == ([4, 5], 5.0, True)  # the frame at the question's time is in
    assert grouper.before(5.0, passed=False) and not grouper.before(5.5, passed=False)
    grouper.add(frames_at(6)[0])
    assert grouper.cut(5.5, passed=True) is None and grouper.before(5.5, passed=True)  # nothing at or before 5.5


def test_cuts_are_kept_in_order_and_dropped_once_their_frames_are_in():
    woken = []
    cuts = Cuts(wake=lambda: woken.append(1))
    cuts.add_all([7.5, 4.5, None, 6.0])
    assert cuts.first() == 4.5 and len(woken) == 3
    cuts.done(6.0, inclusive=False)
    assert cuts.first() == 6.0
    cuts.done(6.0)
    assert cuts.first() == 7.5


def test_a_question_waits_for_a_frame_of_an_ingest_behind_the_player_not_until_it_catches_up():
    """The player at 9.5 s while ingest has taken the frames at 0 and 1 s (two tabs on 2 cores, a slow encoder): a
    question asked now is about the frames up to 2 s, the next one ingest takes; with ingest at the player, the
    player's position."""
    source = PlaybackSource(bundled_clip("bikes.mp4"), threading.Event(), fps=1.0)
    source.report(9.5)
    frames = iter(source)
    assert [round(next(frames).t) for _ in range(2)] == [0, 1]
    assert source.asked_at() == pytest.approx(2.0)
    frames.close()
    assert handed_over(5.5, 5.0, 1.0) == 5.5 and handed_over(5.5, None, 1.0) == 0.0


def over_the_player(vlm, budget: int, max_new_tokens: int, at: float = 0.0):
    """A live session (the app's) over bikes.mp4's player-driven source, the player at `at`: (session, source)."""
    held = {}

    def make(stop):
        held["player"] = PlaybackSource(bundled_clip("bikes.mp4"), stop, fps=1.0)
        held["player"].report(at)
        return held["player"]

    live = LiveSession(vlm, vlm.new_session("inf_mllm", budget=budget), make, "bikes.mp4", clip_seconds=2.0,
                       max_new_tokens=max_new_tokens)
    return live, held["player"]


def test_is_there_a_bicycle_now_asked_every_half_second_sees_the_frames_up_to_then(vlm):
    """The app's path (a `LiveSession` over the player-driven source, asked without a time, as a viewer types): each
    answer is stamped with the player's position and holds the frames up to it. bikes.mp4's cyclist enters in the
    frame at 5 s (the detector's log: no bicycle in the frames before); the answers from 5.0 s on say yes, the one
    at 4.5 s says no. Before, every one of them was answered at the end of the last whole clip (4.0 s, "no")."""
    live, player = over_the_player(vlm, budget=256, max_new_tokens=4)
    rows = []
    try:
        for position in np.arange(4.5, 7.75, 0.5):
            player.report(float(position))
            deadline = time.monotonic() + 60  # ingest up with the player, as it is when it keeps up (a hang guard)
            while (player.yielded_t or 0) < int(position) and time.monotonic() < deadline:
                time.sleep(0.01)
            out = live.ask("is there a bicycle now?")
            start = out.get(timeout=120)
            got = next(item for item in iter(partial(out.get, timeout=120), object()) if item.final)
            assert isinstance(start, Started) and start.video_t == pytest.approx(position), start
            assert start.question == "is there a bicycle now?" and isinstance(got, Done), got
            rows.append((float(position), got.answer.video_t, got.answer.answer))
        log = {m["clip"]: m for m in live.engine.clip_log()}
    finally:
        live.close()
    assert [r[1] for r in rows] == pytest.approx([r[0] for r in rows])  # stamped the moment asked
    bicycle_from = min(m["start"] for m in log.values() if "bicycle" in m.get("objects", {}))
    assert bicycle_from == 5.0, log
    assert [r[2].lower().startswith("yes") for r in rows] == [t >= bicycle_from for t, *_ in rows], rows
    assert max(m["end"] for m in log.values()) <= 7.5  # nothing past the player went in


def test_a_stopped_engine_leaves_no_frame_reader_behind(vlm):
    """The reader thread (ingest's second) ends with its engine, even while the player waits."""
    def ingest_threads():
        return {t.ident for t in threading.enumerate() if t.name in ("frames", "ingest") and t.is_alive()}

    before = ingest_threads()  # another test's, if any: not this one's
    live, _ = over_the_player(vlm, budget=128, max_new_tokens=2, at=1.0)
    deadline = time.monotonic() + 30
    while len(ingest_threads() - before) < 2 and time.monotonic() < deadline:  # a hang guard, not a timing
        time.sleep(0.02)
    assert len(ingest_threads() - before) == 2  # its reader and its ingest thread run
    live.close()
    deadline = time.monotonic() + 10
    while ingest_threads() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ingest_threads() - before
