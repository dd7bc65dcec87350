"""What the page shows of a real session: the real tiny-vlm on bikes.mp4, its frames released by the player positions
the page's timer reports (`Handlers.tick` with a real `gr.Video`), read back through the functions the page draws
from. No browser: tests/test_app_browser.py looks at the same plots in Chromium."""

import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app.handlers import Handlers, answered
from app.ui import build
from app.views import ALERT, FULL, KV, RSS, STORE, STORE_CAP, WEIGHTS, numbers, store_of
from streaming.events import Done


def until(done, timeout=120.0):
    """Wait for `done()` on a machine whose cores may be busy; the bound is a hang guard, not a timing."""
    deadline = time.monotonic() + timeout
    while not (value := done()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def tick(chat, position, history=(), watched=()):
    """One tick of the page's timer: (plots' updates and the note's, numbers, chat, detector view, alerts list,
    watches line)."""
    return Handlers.tick(gr.Video(playback_position=position), chat, list(history), True, list(watched))


@pytest.fixture(scope="module")
def handlers():
    return Handlers()  # one host: the model loads once for the module's sessions


def opened(handlers, watched=()):
    chat, history, _ = handlers.start(None, list(watched), [], "Bundled clip", "bikes.mp4", None, 0, "tiny-vlm",
                                      "inf_mllm+recall", "96", None, None)
    assert chat is not None, history
    tick(chat, 9.8)  # the player near the clip's end: frames up to 9 s may go in
    return chat


@pytest.fixture(scope="module")
def chat(handlers):
    chat = opened(handlers)
    assert until(lambda: chat.telemetry()["clips"] >= 4)
    yield chat
    handlers.release(chat)


def test_before_a_session_a_note_stands_where_the_plots_will_be():
    demo = build()
    plots = {b.elem_id: b for b in demo.blocks.values() if isinstance(b, gr.LinePlot)}
    assert set(plots) == {"tokens-plot", "mb-plot", "process-plot"}
    assert all(not p.visible and p.title and p.y_lim == [0, None] for p in plots.values())  # hidden; memory from 0
    note = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "graphs-note")
    assert note.visible and "press **Start**" in note.value
    updates = Handlers.tick(None, None, [], True, [])
    assert all(u == gr.skip() for u in updates[:4])  # no session: plots and note stay as they are
    assert updates[4] == numbers(None) == "No session yet: pick a source and press **Start**."


def test_the_kv_line_is_drawn_last_and_the_store_is_plotted_with_its_bound(chat):
    tokens, mb, process, note, stats = tick(chat, 9.8)[:5]
    assert tokens["visible"] and mb["visible"] and process["visible"] and note == gr.update(visible=False)
    drawn = list(dict.fromkeys(tokens["value"]["series"]))  # the plot draws series in the order they come
    assert drawn == ["budget", FULL, KV, ALERT]  # the KV line on top of the budget it sits at; alerts' marks over all
    assert tokens["value"].query("series == 'budget'")["value"].eq(96).all()
    assert list(dict.fromkeys(process["value"]["series"])) == [STORE_CAP, WEIGHTS, STORE, RSS]
    frame, store = process["value"], store_of(chat)
    cap = frame.query(f"series == '{STORE_CAP}'")["value"]
    assert cap.eq(store.ram_cap / 2**20).all() and cap.iloc[0] == 1024  # the default 1 GiB RAM tier
    held = frame.query(f"series == '{STORE}'")["value"]
    assert held.is_monotonic_increasing and 0 < held.iloc[-1] <= store.ram_bytes / 2**20  # a clip's KV each turn
    assert 400 < frame.query(f"series == '{WEIGHTS}'")["value"].iloc[0] < 700  # SmolLM2-135M in fp32
    assert "span store, every clip's KV kept for recall" in process["caption"] and "bound 1024 MB" in process["caption"]
    assert f"span store {store.ram_bytes / 2**20:.0f} of 1024 MB" in numbers(chat) and "budget 96)" in stats
    assert "last answer" in stats and "(lap" not in stats  # first play of the clip


def test_a_loop_of_the_player_is_said_once_and_the_numbers_show_the_lap(chat):
    tick(chat, 9.9)
    history = tick(chat, 0.4)[5]  # wrapped from the end to the start: lap 2
    said = [m["content"] for m in history if "looped" in m["content"]]
    assert len(said) == 1 and said[0].startswith("↻ bikes.mp4 looped: lap 2 begins at video time 10.4 s"), said
    assert tick(chat, 2.5, history)[5] == gr.skip()  # said once, not every tick; frames to 12 s go in
    assert until(lambda: chat.telemetry()["video_s"] > 10)
    assert "(lap 2 of the 10-s clip)" in numbers(chat)


def test_an_answer_read_off_the_clip_log_shows_no_tokens_per_second(chat):
    def answer(question):
        out = chat.ask(question)
        while not (event := out.get(timeout=120)).final:
            continue
        assert isinstance(event, Done), event
        return event.answer

    logged = answer("how many times did you see a car?")
    assert logged.source == "clip log"
    line = answered("", logged)
    assert "tokens/s" not in line and line.count("read off the clip log") == 1 and "s to first token" in line, line
    assert "**last answer** read off the clip log in" in numbers(chat)
    modelled = answer("what is on screen?")
    assert modelled.source == "model" and f"{modelled.tokens_per_s:.0f} tokens/s" in answered("", modelled)
    assert "tokens/s" in numbers(chat).split("**last answer**")[1]


def test_a_watch_is_read_when_typed_and_its_alert_is_said_listed_marked_and_asked_about(handlers):
    said = [Handlers.watch(None, [], [], text)[1][-1]["content"] for text in ("  ", "x" * 201, "is the door open?")]
    assert said[0].startswith("⚠ Type what to watch for first") and "⚠ a watch is at most 200 characters" in said[1]
    assert "the model is asked 'is the door open?' after each clip" in said[2]
    watched, history, box, line = Handlers.watch(None, [], [], "two people")  # before Start: kept for it
    assert watched == ["two people"] and box == ""
    assert "from the first clip once you press Start" in history[-1]["content"]
    assert "two people (from Start)" in line
    chat = opened(handlers, ["a car"])  # set on the page before Start: bikes.mp4's first clip shows cars
    try:
        watched_session(chat)
    finally:
        handlers.release(chat)


def watched_session(chat):
    assert until(lambda: chat.watches.alerts)  # the car in clip 1
    alert = chat.watches.alerts[0]
    plots, _, _, _, _, said, _, listed, watches = tick(chat, 9.8, watched=["a car"])
    assert any(m["content"].startswith(f"[{alert['video_t']:.1f} s] ALERT **a car**: ") for m in said), said
    assert tick(chat, 9.8)[5] == gr.skip() and tick(chat, 9.8)[7] == gr.skip()  # said and listed once
    assert listed["visible"] and Path(listed["value"][-1][0]).read_bytes()[:2] == b"\xff\xd8"  # the oldest last: a JPEG
    assert listed["value"][-1][1].startswith(f"0:0{alert['video_t']:.0f} a car: ")
    marks = plots["value"].query(f"series == '{ALERT}'")
    top = plots["value"]["value"].max()
    at_alert = [v for t, v in zip(marks["video_s"], marks["value"], strict=True) if t == alert["video_t"]]
    assert at_alert[:3] == [0, top, 0]
    assert "a car (" in watches and "alert" in watches
    question, frame = Handlers.pick(chat, SimpleNamespace(index=len(chat.listed) - 1))
    assert question == f"what happened at 0:{int(alert['snapshot_t'] or alert['start']):02d}?"
    assert frame["value"][0] == alert["snapshot"] and frame["label"].startswith("Alert · ")
    assert tick(chat, 9.8)[6] == gr.skip()  # the picked frame stays a while, not replaced by the newest clip's
    assert Handlers.pick(chat, SimpleNamespace(index=99)) == (gr.skip(), gr.skip())


def test_a_question_the_stream_has_not_reached_says_what_it_waits_for_then_its_answer(handlers, monkeypatch):
    """The player ran ahead of ingest (a fresh session: the frames up to 9 s released at once, none seen yet): the
    question's placeholder says the moment it waits for and how far the stream has seen, then the answer replaces it."""
    monkeypatch.setattr("app.handlers.WAIT_LINE_S", 0.02)  # say it at once: ingest's first frame takes longer
    chat = opened(handlers)
    try:
        assert until(lambda: chat.source.yielded_t is not None)
        shown = [str(update[1][-1]["content"]) for update in handlers.ask(chat, [], "what is on screen?")]
        waiting = [line for line in shown if line.startswith("… waiting for the stream to reach ")]
        assert waiting and waiting[0].endswith("(seen up to 0:00)"), shown
        assert "s to first token" in shown[-1] and not shown[-1].startswith("…"), shown
    finally:
        handlers.release(chat)
