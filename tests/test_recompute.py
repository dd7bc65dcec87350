"""Recomputing linked turns with the question (MPIC's selective attention; recall.py `recompute_rows`, session.py
`prefill_recomputing`) on the real tiny-vlm over bikes.mp4 and the real SmolLM2: recomputing every linked token is
one forward over them, recomputing none is full reuse, MPIC-k recomputes a clip's text and first k visual tokens
and nothing else, CacheBlend's probe leaves the cache as it was, the inputs survive a restart, and a pooled
stream recomputes as it would alone."""

import numpy as np
import pytest
import torch

from inf_mllm import StreamSession, probes
from inf_mllm import recall as recall_
from inf_mllm.pool import SessionPool
from inf_mllm.spec import PolicySpec
from inf_mllm.store import SpanStore
from streaming.sources import FileSource, bundled_clip


@pytest.fixture(scope="module")
def frames():
    return list(FileSource(bundled_clip(), fps=2.0))


def streamed(vlm, frames, policy, clips=8, store=None):
    """`policy` at budget 128 over `clips` 2-frame clips of bikes.mp4: clip 1 is evicted long before the end."""
    session = vlm.new_session(policy, budget=128, store=store)
    for index in range(1, clips + 1):
        clip = frames[2 * index - 2:2 * index]
        vlm.add_clip(session, np.stack([f.rgb for f in clip]), [f.t for f in clip], index)
    return session


def question_ids(vlm, text="what is in the video?"):
    return vlm.text_ids(vlm.question_text(text))


def layer_kv(session):
    return [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers]


@torch.inference_mode()
def test_recomputing_every_linked_token_is_one_forward_over_them(vlm, frames):
    """Re-encoding (every row recomputed) gives the question the logits of a cache that prefilled the linked clip's
    inputs where the block sits, then the question: the selective forward is that forward."""
    q = question_ids(vlm)
    session = streamed(vlm, frames, "inf_mllm+recall+reencode")
    question = session.begin_question(q, named=lambda meta: meta.get("clip") == 1)
    span = session.store.spans[question.linked[0]]
    assert question.recompute[0].tolist() == list(range(span.length))
    got = session.prefill_recomputing(question, q, all_logits=True)
    plain = streamed(vlm, frames, "inf_mllm+recall")
    plain.append(inputs_embeds=span.inputs[None], evict=False, store=False)
    want = plain.append(q, evict=False, store=False, all_logits=True)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    for (k, v), (k2, v2) in zip(layer_kv(session), layer_kv(plain), strict=True):
        assert (k - k2).abs().max() <= 1e-5 and (v - v2).abs().max() <= 1e-5


@torch.inference_mode()
@pytest.mark.slow  # ~21 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_recomputing_no_linked_token_is_full_reuse(vlm, frames):
    """The selective forward with no row selected (its own positions and mask) is the plain question over the
    linked block as stored."""
    q = question_ids(vlm)
    session = streamed(vlm, frames, "inf_mllm+recall+mpic")
    question = session.begin_question(q, named=lambda meta: meta.get("clip") == 1)
    rows, inputs = question.recompute
    question.recompute = (rows[:0], inputs[:0])
    got = session.prefill_recomputing(question, q, all_logits=True)
    reused = streamed(vlm, frames, "inf_mllm+recall")
    want = reused.append_question(q, named=lambda meta: meta.get("clip") == 1, all_logits=True)
    assert [i for i, _ in reused.last_recalled] == question.linked
    assert (got - want).abs().max() <= 1e-5


@torch.inference_mode()
def test_mpic_recomputes_a_clips_text_and_its_first_k_visual_tokens_only(vlm, frames):
    """MPIC-k: the rows are the clip's text tokens and its first k visual tokens; after the question those rows hold
    new values and every other row of the block still holds the stored ones (layer 0's values depend on the token
    alone, so they are the stored ones everywhere)."""
    q = question_ids(vlm)
    session = streamed(vlm, frames, "inf_mllm+recall+mpic")
    question = session.begin_question(q, named=lambda meta: meta.get("clip") == 1)
    span = session.store.spans[question.linked[0]]
    start, end = span.vision.tolist()
    k = session.recall.mpic_k
    assert 0 < start < end <= span.length and end - start > k
    want = [t for t in range(span.length) if t < start + k or t >= end]
    assert question.recompute[0].tolist() == want
    assert torch.equal(question.recompute[1], span.inputs[want])
    session.prefill_recomputing(question, q)
    _, stored = session.store.kv(span.id)
    kept = [t for t in range(span.length) if t not in want]
    for i, layer in enumerate(session.cache.layers):
        at = layer.linked[0]
        moved = (layer.values[0, :, at:at + span.length] - stored[i]).abs().amax(dim=(0, 2))
        assert moved[kept].max() == 0, i
        assert (moved[want].min() > 1e-4) if i else moved.max() <= 1e-5, i


@torch.inference_mode()
def test_cacheblend_probe_leaves_the_cache_as_it_was_and_keeps_its_share(vlm, frames):
    q = question_ids(vlm)
    session = streamed(vlm, frames, "inf_mllm+recall+blend")
    linked = recall_.link(session.cache, session.store, [1], "end")
    before = layer_kv(session)
    rows, inputs = recall_.recompute_rows(session.store, linked, session.recall)
    deviation = probes.deviation(session, rows, inputs)
    for (k, v), (k2, v2) in zip(before, layer_kv(session), strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert deviation.shape == rows.shape and (deviation > 0).all()
    kept, kept_inputs = recall_.most_deviating(rows, inputs, deviation, session.recall.blend_r)
    assert len(kept) == round(session.recall.blend_r * len(rows)) and kept.tolist() == sorted(kept.tolist())
    assert set(kept.tolist()) == set(rows[deviation.topk(len(kept)).indices].tolist())
    assert torch.equal(kept_inputs, inputs[deviation.topk(len(kept)).indices.sort().values])
    recall_.unlink(session.cache)
    question = session.begin_question(q, named=lambda meta: meta.get("clip") == 1)
    assert question.recompute[0].tolist() == kept.tolist()


@torch.inference_mode()
def test_a_reopened_store_recomputes_from_the_inputs_it_wrote(vlm, frames, tmp_path):
    session = streamed(vlm, frames, "inf_mllm+recall+mpic", clips=3, store=tmp_path)
    inputs, vision = session.store.spans[1].inputs.clone(), session.store.spans[1].vision.clone()
    session.store.close()
    again = SpanStore(tmp_path)
    assert again.spans[1].inputs is None and torch.equal(again.spans[1].vision, vision)
    rows, got = recall_.recompute_rows(again, [1], session.recall)
    assert torch.equal(got, inputs[rows])
    again.close()


def test_a_reuse_mode_is_a_policy_part_after_recall_and_refused_elsewhere(smol):
    spec = PolicySpec.parse("inf_mllm+merge+recall_oracle+blend")
    assert spec.recall.reuse == "blend" and spec.recall.mode == "oracle"
    assert spec.name == "inf_mllm+merge+recall_oracle+blend"
    for text in ("inf_mllm+mpic", "inf_mllm+recall+mpic+blend", "inf_mllm+mpic+recall"):
        with pytest.raises(ValueError, match="misplaced policy part"):
            PolicySpec.parse(text)
    model, tok = smol
    with pytest.raises(ValueError, match="placed at the end"):
        StreamSession(model, tok, PolicySpec.parse("inf_mllm+recall+mpic").with_recall(
            recall_.Recall(reuse="mpic", at="front")), budget=64)


TURNS = ["The red fox jumps over the fence.\n", "Paris is the capital of France.\n",
         "The secret number is 4721.\n", "Bananas are yellow and curved.\n"] + ["Nothing else happened today.\n"] * 3


def text_stream(session, tok):
    for i, text in enumerate(TURNS):
        session.append(tok(text, return_tensors="pt", add_special_tokens=False).input_ids, meta={"line": i})
    ids = tok("What is the secret number?", return_tensors="pt", add_special_tokens=False).input_ids
    logits = session.append_question(ids, named=lambda meta: meta.get("line") == 2)[0, -1].clone()
    return logits, [int(t[0]) for t in session.generate(6, eos_token_id=[])], [i for i, _ in session.last_recalled]


def test_a_pooled_stream_recomputes_its_linked_turns_as_it_would_alone(smol):
    """A text turn has no visual tokens: MPIC-k recomputes all of it. In the pool the question takes a forward of
    its own and answers as alone."""
    model, tok = smol
    alone = text_stream(StreamSession(model, tok, "inf_mllm+recall+mpic", budget=24, window=16), tok)
    assert alone[2] == [2]
    pool = SessionPool(model, tok)
    try:
        pooled = text_stream(pool.open("inf_mllm+recall+mpic", budget=24, window=16), tok)
    finally:
        pool.close()
    assert pooled[1:] == alone[1:] and (pooled[0] - alone[0]).abs().max() <= 1e-5


def test_the_link_time_benchmark_asks_every_mode_about_an_evicted_clip_it_links(smol):
    """`python -m benchmarks link_time` times only questions whose named clip was evicted and linked back in every
    mode: at tiny-vlm's turn layout on the real SmolLM2, each timed question linked exactly its clip, every time."""
    from benchmarks.link_time import MODES, time_modes

    rows = time_modes(smol[0], 24, asks=2, device="cpu")
    assert len(rows) == 2
    assert all(r[mode]["linked"] == 1 and r[mode]["ttft_s"] > 0 for r in rows for mode in MODES)
