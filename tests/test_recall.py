"""Recall of evicted turns on the real SmolLM2-135M-Instruct and tiny-vlm: the span store (RAM and
disk tiers, checksums, a full disk), linking stored KV back (equal to the cache it came from),
unlinking, choosing by what a question names, and a session that ends in `kill -9` and resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from clocks import SteppedClock

from benchmarks.real_scenes import clip_frames, photo
from inf_mllm import StreamSession, store_index
from inf_mllm import recall as recall_
from inf_mllm.store import SpanStore
from streaming.sources import FileSource, bundled_clip


def ids_of(tok, text):
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids


TURNS = ["The red fox jumps over the fence.\n", "Paris is the capital of France.\n",
         "The secret number is 4721.\n", "Bananas are yellow and curved.\n"]


def streamed(smol, policy="inf_mllm+recall", budget=4096, store=None, **kw):
    model, tok = smol
    window = {} if policy == "full" else {"window": 16}  # a policy without a window refuses the option
    session = StreamSession(model, tok, policy, budget=budget, store=store, **window, **kw)
    for i, text in enumerate(TURNS):
        session.append(ids_of(tok, text), meta={"line": i})
    return session


def test_recall_without_eviction_equals_the_plain_model(smol):
    """Recall only adds bookkeeping: with nothing evicted, a question's logits are the plain model's."""
    model, tok = smol
    question = ids_of(tok, "What is the secret number?")
    session = streamed(smol)
    got = session.append_question(question, all_logits=True)
    want = model(input_ids=torch.cat([ids_of(tok, t) for t in TURNS] + [question], dim=1)).logits
    assert session.last_recalled == [] and len(session.store) == len(TURNS)
    assert (got - want[:, -question.shape[1]:]).abs().max() < 1e-4


def test_linked_spans_reproduce_the_cache_they_came_from(smol):
    """Turns 1-3 linked back behind turn 0 (re-rotated to their old positions) give the same logits for
    a question as the cache that prefilled them: the stored KV is position-independent and exact."""
    model, tok = smol
    question = ids_of(tok, "What is the secret number?")
    whole = streamed(smol)
    want = whole.append(question, store=False)
    rebuilt = StreamSession(model, tok, "inf_mllm+recall", budget=4096, window=16)
    rebuilt.append(ids_of(tok, TURNS[0]))
    assert recall_.link(rebuilt.cache, whole.store, [1, 2, 3], "end", recalled=False) == [1, 2, 3]
    got = rebuilt.append(question, store=False)
    assert rebuilt.kv_tokens == whole.kv_tokens
    assert (got - want).abs().max() < 1e-3


def test_recalled_spans_leave_at_the_next_turn(smol):
    model, tok = smol
    session = streamed(smol, budget=24)
    before = session.kv_tokens
    keys = session.cache.layers[5].keys.clone()
    gone = [i for i in session.store.spans if i not in recall_.resident_spans(session.cache, session.store, 0.5)]
    assert gone, "the small budget evicted the early turns"
    linked = recall_.link(session.cache, session.store, gone[:2], "end")
    assert session.kv_tokens == before + sum(session.store.spans[i].length for i in linked)
    recall_.unlink(session.cache)
    assert session.kv_tokens == before and torch.allclose(session.cache.layers[5].keys, keys, atol=1e-5)


@pytest.mark.parametrize("at", ["end", "front"])
def test_a_question_links_the_turn_it_names_and_answers_from_it(smol, at):
    """The secret number left a 24-token cache long ago; a question naming its turn links it back, and
    the number's first digit becomes as likely as with the full cache, far more than without recall."""
    model, tok = smol
    four = tok.convert_tokens_to_ids("4")
    question = ids_of(tok, "The secret number is ")

    def log_p_four(policy, budget, **kw):
        session = streamed(smol, policy, budget=budget, **kw)
        for _ in range(3):
            session.append(ids_of(tok, "Nothing else happened today.\n"))
        if session.recall is None:
            return float(session.append(question)[0, -1].log_softmax(-1)[four]), session
        assert 2 not in recall_.resident_spans(session.cache, session.store, 0.5)
        logits = session.append_question(question, named=lambda meta: meta.get("line") == 2)
        return float(logits[0, -1].log_softmax(-1)[four]), session

    recalled, session = log_p_four("inf_mllm+recall", 24, recall=recall_.Recall(at=at))
    assert [i for i, _ in session.last_recalled] == [2]
    without, _ = log_p_four("inf_mllm", 24)
    full, _ = log_p_four("full", None)
    assert recalled > without + 0.5 and recalled > full - 0.5, (recalled, without, full)


def test_oracle_random_and_similarity_modes_choose_among_evicted_turns(smol):
    model, tok = smol
    for mode in ("oracle", "random", "attention"):
        session = streamed(smol, budget=24, recall=recall_.Recall(mode=mode, k=2, named=False))
        for _ in range(3):
            session.append(ids_of(tok, "Nothing else happened today.\n"))
        resident = recall_.resident_spans(session.cache, session.store, 0.5)
        session.append_question(ids_of(tok, "The secret number is"), oracle=lambda meta: meta.get("line") == 2)
        recalled = [i for i, _ in session.last_recalled]
        assert len(recalled) <= 2 and recalled == sorted(recalled) and not set(recalled) & resident, mode
        assert recalled == [2] if mode == "oracle" else len(recalled) == 2 if mode == "random" else True


def test_recall_refuses_what_it_cannot_serve(smol):
    model, tok = smol
    with pytest.raises(ValueError, match="unknown or misplaced policy part"):
        StreamSession(model, tok, "inf_mllm+recal", budget=64)
    with pytest.raises(ValueError, match="turn boundaries"):
        StreamSession(model, tok, "h2o+recall", budget=64)
    with pytest.raises(ValueError, match="batch 1"):
        StreamSession(model, tok, "inf_mllm+recall", budget=64, batch=2)


# --- the store ----------------------------------------------------------------------------------


def test_store_reopens_from_disk_and_drops_a_corrupt_file(smol, tmp_path):
    session = streamed(smol, store=tmp_path)
    first_kv = session.store.kv(1)[0].clone()
    session.store.close()  # one process writes a store folder at a time
    again = SpanStore(tmp_path)
    assert sorted(again.spans) == sorted(session.store.spans)
    assert again.spans[2].meta == {"line": 2} and torch.equal(again.kv(1)[0], first_kv)
    victim = tmp_path / store_index.read(tmp_path / "index.jsonl").records[0]["file"]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    again.close()
    with pytest.warns(UserWarning, match="corrupt"):
        third = SpanStore(tmp_path)
    assert len(third) == len(TURNS) - 1


def test_the_clip_log_keeps_the_clips_the_caps_dropped(smol):
    """The library resolves a question against `SpanStore.clips()`: a clip whose KV the RAM cap dropped is still
    in it (a question about it still resolves to it, as against the engine's own log), and none of its KV is kept."""
    session = streamed(smol)
    one = session.store.spans[1].nbytes
    store = SpanStore(ram_bytes=2 * one + 1)
    for span in list(session.store.spans.values()):
        store.add(span.__class__(span.id, span.length, span.summary, {"clip": span.id + 1}, span.keys, span.values))
    assert len(store) < 4 and [m["clip"] for m in store.clips()] == [1, 2, 3, 4]  # dropped, still in the log


def test_store_caps_drop_least_recently_used(smol, tmp_path):
    session = streamed(smol)
    one = session.store.spans[1].nbytes
    store = SpanStore(tmp_path, ram_bytes=2 * one + 1, disk_bytes=3 * one)
    for span in list(session.store.spans.values()):
        store.add(span.__class__(span.id, span.length, span.summary, span.meta, span.keys, span.values))
    store.flush()  # the writes are the store's thread's: the caps apply once they land
    assert store.ram_bytes <= 2 * one + 1 and store.disk_bytes <= 3 * 1.1 * one
    assert store.kv(0) is None and store.kv(3) is not None  # the oldest is gone from both tiers


def test_a_full_disk_degrades_to_ram_with_one_warning(tmp_path):
    """A real EFBIG: the store runs in a process whose file-size limit is smaller than one span."""
    code = f"""
import resource, warnings, torch
from inf_mllm.store import Span, SpanStore
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = SpanStore({str(tmp_path)!r})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(4):
        kv = torch.randn(2, 3, 400, 64)
        store.add(Span(i, 400, torch.randn(1, 3, 5, 64).half(), {{"i": i}}, kv, kv.clone()))
    store.flush()  # the disk's answer, on this thread
print(len(caught), len(store), not store.writable, store.kv(3) is not None, str(caught[0].message))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    warned, kept, ram_only, readable, message = out.stdout.split(" ", 4)
    assert (warned, kept, ram_only, readable) == ("1", "4", "True", "True"), out.stderr
    assert "disk is full" in message


# --- the session: generate, failures -------------------------------------------------------------


def test_a_stopped_answer_leaves_its_last_token_pending(smol):
    """Breaking out of generate, or appending while it is paused, continues as if the received tokens
    had been the whole answer; decode_s counts the model's time only."""
    model, tok = smol

    def fresh():
        s = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
        s.append(ids_of(tok, "The capital of France is"))
        return s

    broken = fresh()
    clock = SteppedClock()  # moves only when the consumer below takes its time
    broken.clock = clock
    got = []
    for token in broken.generate(8, eos_token_id=[]):
        got.append(token)
        clock.sleep(10.0)  # a slow consumer
        if len(got) == 3:
            break
    assert broken.last.decode_s == 0.0 and clock.now == 30.0  # none of the consumer's 30 s is the model's
    paused = fresh()
    steps = paused.generate(8, eos_token_id=[])
    assert [int(next(steps)[0]) for _ in range(3)] == [int(t[0]) for t in got]
    nxt = ids_of(tok, " Next")
    reference = fresh()
    reference.append(torch.cat([torch.cat(got)[None], nxt], dim=1))
    for s in (broken, paused):
        logits = s.append(nxt)
        assert (logits[:, -1] - reference._logits).abs().max() < 1e-4
        assert s.kv_tokens == reference.kv_tokens


def test_a_turn_that_fails_midway_leaves_the_session_as_it_was(smol):
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
    session.append(ids_of(tok, TURNS[0]))
    keys, seen = [layer.keys.clone() for layer in session.cache.layers], session.seen
    hook = model.model.layers[12].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(MemoryError("boom")))
    try:
        with pytest.raises(MemoryError):
            session.append(ids_of(tok, TURNS[1]))
    finally:
        hook.remove()
    assert session.seen == seen and all(torch.equal(a.keys, b) for a, b in zip(session.cache.layers, keys, strict=True))
    again = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
    again.append(ids_of(tok, TURNS[0]))
    assert (session.append(ids_of(tok, TURNS[1])) - again.append(ids_of(tok, TURNS[1]))).abs().max() < 1e-5


# --- tiny-vlm and stream-qa ----------------------------------------------------------------------


@pytest.mark.slow  # ~42 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_the_library_call_reads_a_question_as_the_engine_does(vlm):
    """The README's library call (`answer(session, question)`: no caller resolves the words) on a recall session over
    real photos and footage: a cat photo, 24 clips of bikes.mp4 (the cat long evicted at budget 256), a rocket photo
    on screen. A question about the present links nothing; "what did you see at the start?" links the cat's clip
    alone; "did you see a cat?", "when …" and "what did you see?" are read off the clip log. Before, the same calls
    linked four clips by their keys to every question (the present's too) and answered "no" about the cat."""
    street, t = [f.rgb for f in FileSource(bundled_clip(), fps=2.0)], 0.0
    session = vlm.new_session("inf_mllm+recall", budget=256)
    clips = [list(clip_frames(photo("chelsea")))]
    clips += [[street[2 * i % len(street)], street[(2 * i + 1) % len(street)]] for i in range(24)]
    clips += [list(clip_frames(photo("rocket")))]
    for index, frames in enumerate(clips, 1):
        vlm.add_clip(session, np.stack(frames), [t + 0.5 * k for k in range(len(frames))], index)
        t += 0.5 * len(frames)
    cat = next(i for i, span in session.store.spans.items() if span.meta["clip"] == 1)
    assert cat not in recall_.resident_spans(session.cache, session.store, session.recall.resident)
    present = vlm.answer(session, "what is in the video?")
    assert session.last_recalled == [] and "rocket" in present
    assert "cat" in vlm.answer(session, "what did you see at the start?")
    assert [meta["clip"] for _, meta in session.last_recalled] == [1]
    assert vlm.answer(session, "is there a rocket now?") == "yes" and session.last_recalled == []
    turns = session.turns  # the clip log's own answers: the model is not asked
    assert vlm.answer(session, "did you see a cat?") == "yes, last seen in clip 1 (0:00-0:02)"
    assert vlm.answer(session, "when did you see a cat?") == "at 0:00 (clip 1)" and session.turns == turns
    assert vlm.answer(session, "what did you see?").startswith("0:00 cat; 0:")


def restart_of(vlm, folder, plan):
    """A `full+recall` session over bikes.mp4's clips and the questions of `plan` ("clip", or (question, keep)),
    its store closed as a crash would leave it; returns (the session, the exchanges of its answers)."""
    frames = list(FileSource(bundled_clip(), fps=2.0))
    session, exchanges, index = vlm.new_session("full+recall", store=folder), [], 0
    for step in plan:
        if step == "clip":
            index += 1
            clip = frames[2 * index - 2:2 * index]
            vlm.add_clip(session, np.stack([f.rgb for f in clip]), [f.t for f in clip], index)
        else:
            vlm.answer(session, step[0], max_new_tokens=6, keep=step[1])
            exchanges.append(session.exchange.as_dict())
    session.store.close()
    return session, exchanges


def test_a_restored_session_is_the_one_before_the_restart(vlm, tmp_path):
    """Under a policy that evicts nothing, `restore` with the transcript's exchanges puts the kept questions and
    answers back between the clips where they were asked: every layer's K/V, the held-back answer token and the
    next answer are those of the session before the restart. A question that left with its answer (keep=False)
    stays out; without the exchanges, the rebuilt cache lacks them all."""
    plan = ["clip", "clip", ("what is in the video?", True), "clip", ("what color is the shape?", False),
            ("what do you see?", True), ("is it a bike?", True), "clip", "clip", ("what is there now?", True)]
    before, exchanges = restart_of(vlm, tmp_path / "store", plan)
    assert [e["kept"] for e in exchanges] == [True, False, True, True, True] and all(e["answer"] for e in exchanges)
    json.dumps(exchanges)  # what a transcript line holds
    again = vlm.new_session("full+recall", store=tmp_path / "store")
    assert again.restore(exchanges) == sorted(again.store.spans)
    cached = before.kv_tokens
    assert again.kv_tokens == cached
    assert torch.equal(again._pending, before._pending)
    for old, new in zip(before.cache.layers, again.cache.layers, strict=True):
        n = old.get_seq_length()
        assert new.get_seq_length() == n
        assert (old.keys[..., :n, :] - new.keys[..., :n, :]).abs().max() < 1e-4
        assert (old.values[..., :n, :] - new.values[..., :n, :]).abs().max() < 1e-4
    question = vlm.question_turn("what happened so far?")
    want, got = before.append_question(question), again.append_question(question)
    assert (want - got).abs().max() < 1e-4
    assert [int(t[0]) for t in before.generate(8)] == [int(t[0]) for t in again.generate(8)]
    again.store.close()
    bare = vlm.new_session("full+recall", store=tmp_path / "store")
    bare.restore()
    clips = sum(span.length for span in bare.store.spans.values())
    assert bare.kv_tokens == vlm.new_session("full").kv_tokens + clips < cached  # the opening turn and the clips
    bare.store.close()




@pytest.mark.slow
def test_stream_qa_answers_from_a_recalled_clip_after_kill_9_and_resume(tmp_path):
    """A session over the bundled clip (looped) is killed mid-stream; --resume rebuilds the cache from
    the store and answers a question about clip 1 by recalling it. The transcript is whole."""
    folder = tmp_path / "session"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, "-m", "streaming.cli", "--fast", "--loop", "30", "--budget", "128",
                              "--clip-seconds", "2", "--session", str(folder), "--json",
                              "--ask", "what is the color of the shape? @6s"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    index = folder / "store" / "index.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not index.exists() or index.read_text().count("\n") < 12):
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    transcript = [json.loads(line) for line in (folder / "transcript.jsonl").read_text().splitlines()]
    assert len(transcript) == 1 and transcript[0]["question"] == "what is the color of the shape?"
    resumed = subprocess.Popen([sys.executable, "-m", "streaming.cli", "--resume", str(folder), "--json",
                                "--ask", "In clip 1, what is the color of the shape?"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               stdin=subprocess.DEVNULL)
    line = resumed.stdout.readline()  # the answer; then the rest of the 30 loops is not waited for
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=60) == 143
    assert "resuming after clip" in resumed.stderr.read()
    answer = json.loads(line)
    assert answer["recalled"] and answer["recalled"][0]["clip"] == 1 and answer["recalled"][0]["start"] == 0.0
    lines = (folder / "transcript.jsonl").read_text().splitlines()
    row = json.loads(lines[-1])  # the record printed, and what the cache took (for the next resume)
    assert len(lines) == 2 and row.pop("exchange")["answer"] and row == answer

def test_stream_qa_rejects_an_unknown_recall_suffix_in_one_line():
    out = subprocess.run([sys.executable, "-m", "streaming.cli", "--policy", "inf_mllm+recal"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.count("\n") <= 2 and "+recall" in out.stderr.splitlines()[-1]



def test_a_resolved_question_links_exactly_its_turns_and_none_for_the_present(smol):
    """A caller that resolved what a question needs (`named`) gets those evicted turns and nothing else: a
    question about the present (nothing named) links nothing, and no probe ranks the rest."""
    model, tok = smol
    session = streamed(smol, budget=24, recall=recall_.Recall(k=2))
    for _ in range(3):
        session.append(ids_of(tok, "Nothing else happened today.\n"))
    session.append_question(ids_of(tok, "What is the secret number?"), named=lambda meta: False)
    assert session.last_recalled == []
    session.append_question(ids_of(tok, "What is the secret number?"), named=lambda meta: meta.get("line") in (0, 2))
    assert [i for i, _ in session.last_recalled] == [0, 2]


def test_similarity_links_only_turns_that_beat_every_cached_one(smol):
    """Ranked by keys, a stored turn is linked only when it matches the question better than every turn
    still cached: a question the cache answers links nothing, one about an evicted turn links it."""
    model, tok = smol
    session = streamed(smol, budget=24, recall=recall_.Recall(k=2, named=False))
    for _ in range(3):
        session.append(ids_of(tok, "Nothing else happened today.\n"))
    session.append_question(ids_of(tok, "Did nothing else happen today?"))
    assert session.last_recalled == []
    session.append_question(ids_of(tok, "What is the secret number?"))
    assert 2 in [i for i, _ in session.last_recalled]
