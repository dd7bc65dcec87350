"""A stream's watch questions in shared forwards (inf_mllm/side.py): the mask and positions they are packed with, and,
on the real tiny-vlm over bikes.mp4, the same answers as one question at a time, with the cache left as it was."""

import pytest
import torch

from inf_mllm.side import groups, packed, shared_prefix

WATCHES = ["a person", "a car", "a bicycle", "a motorcycle", "a cat", "a dog", "a traffic light", "a parking meter",
           "a street sign", "a tree", "a bench", "a boat", "a bird", "a horse", "a truck", "a helmet"]


def test_questions_share_their_common_prefix_once_and_each_rest_sees_the_cache_the_prefix_and_itself_only():
    inputs = packed(3, [[1, 2, 3, 9], [1, 2, 4, 5, 6]], "cpu")
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 9, 4, 5, 6]]
    assert inputs["position_ids"].tolist() == [[3, 4, 5, 6, 5, 6, 7]]  # each rest right after the prefix
    assert inputs["logits_to_keep"].tolist() == [3, 6]
    mask = inputs["attention_mask"][0, 0].int().tolist()
    assert mask[1] == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # the prefix: causal
    assert mask[3] == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]  # 9: the cache, the prefix, 3 and itself
    assert mask[4] == [1, 1, 1, 1, 1, 0, 0, 1, 0, 0]  # 4: not the first question's 3 or 9
    assert mask[6] == [1, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert shared_prefix([[5, 6, 7]]) == 2 and shared_prefix([[5, 6], [5, 6, 7]]) == 1  # each keeps a last token
    assert groups([15, 15, 15, 40], 32) == [[0, 1], [2], [3]]  # the buffers' free rows bound a forward


@pytest.fixture(scope="module")
def streamed(vlm):
    """bikes.mp4's clips through a stream (inf_mllm with recall, as the app opens one), its session after them."""
    from streaming.engine import TurnEngine
    from streaming.questions import Schedule
    from streaming.sources import FileSource, bundled_clip

    engine = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=512), clip_seconds=4.0)
    list(engine.run(FileSource(bundled_clip(), fps=1.0), Schedule([])))
    return engine.session


def one_at_a_time(vlm, session, questions):
    """Each question's own prefill's logits, taken out of the cache after it (as `yes_or_no` asks one)."""
    out = []
    for question in questions:
        out.append(session.append_question(vlm.question_turn(question, session), keep=False)[0, -1].clone())
        session.forget_question()
    return torch.stack(out)


def test_the_real_model_gives_each_packed_question_its_own_prefills_logits_and_leaves_the_cache_as_is(vlm, streamed):
    from models.watch import Watch

    questions = [Watch(text, ()).question for text in WATCHES]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in streamed.cache.layers]
    packed_logits = streamed.side_logits([vlm.question_turn(q, streamed) for q in questions])
    after = [(layer.keys, layer.values) for layer in streamed.cache.layers]
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(before, after, strict=True))
    alone = one_at_a_time(vlm, streamed, questions)
    assert packed_logits.shape == alone.shape
    torch.testing.assert_close(packed_logits, alone, atol=2e-4, rtol=1e-4)
    assert vlm.yes_or_no_all(streamed, questions) == [vlm.yes_or_no(streamed, q) for q in questions]
    assert "yes" in vlm.yes_or_no_all(streamed, questions)  # bikes.mp4 shows bicycles: not every answer is "no"


def test_a_pooled_stream_packs_its_watch_questions_on_the_pools_thread_with_the_same_answers(vlm):
    from inf_mllm.pool import SessionPool
    from models.watch import Watch
    from streaming.engine import TurnEngine
    from streaming.questions import Schedule
    from streaming.sources import FileSource, bundled_clip

    questions = [Watch(text, ()).question for text in WATCHES[:6]]
    pool = SessionPool(vlm.model, vlm.tokenizer)
    try:
        session = pool.open(make=lambda: vlm.new_session("inf_mllm", budget=512))
        engine = TurnEngine(vlm, session, clip_seconds=4.0)
        list(engine.run(FileSource(bundled_clip(), fps=1.0), Schedule([])))
        kv = session.kv_tokens
        got = vlm.yes_or_no_all(session, questions)
        assert session.kv_tokens == kv
        assert got == [vlm.yes_or_no(session, q) for q in questions]
    finally:
        pool.close()
