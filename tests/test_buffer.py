"""K/V and per-token statistics in preallocated buffers (inf_mllm/buffer.py): the same session as
transformers' dynamic layers give, written in place, and a bounded cache that stops allocating once it
has seen its longest turn and answer."""

import pytest
import torch

from inf_mllm import StreamSession
from inf_mllm.buffer import GRAIN, KVBuffer

POLICIES = ["inf_mllm", "h2o", "inf_mllm+merge", "inf_mllm+vl_cache_budgets", "streaming_llm", "full"]


@pytest.mark.parametrize("policy", POLICIES)
def test_buffers_give_the_dynamic_layers_logits_answers_and_kept_tokens(smol, policy):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 400), generator=torch.Generator().manual_seed(3))
    budget = None if policy == "full" else 128
    kwargs = {"window": 16} if policy.startswith("inf_mllm") else {}
    static = StreamSession(model, tok, policy, budget=budget, **kwargs)
    dynamic = StreamSession(model, tok, policy, budget=budget, static=False, **kwargs)
    for start in range(0, 400, 100):  # the budget of 128 is reached in the second turn
        want, got = dynamic.append(ids[:, start:start + 100]), static.append(ids[:, start:start + 100])
        assert (got - want).abs().max() <= 1e-4, start
        answer = [int(t[0]) for t in dynamic.generate(6, eos_token_id=[])]
        assert [int(t[0]) for t in static.generate(6, eos_token_id=[])] == answer
    for mine, theirs in zip(static.cache.layers, dynamic.cache.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape and torch.allclose(mine.keys, theirs.keys, atol=1e-4)
    assert static.cache.layers[0]._k.static and not dynamic.cache.layers[0]._k.static


def _turns(count: int, longest: int, longest_at: tuple[int, ...], seed: int):
    """(turn, ids (1, L), whether it is a longest one): random turns of 8 to `longest` tokens, `longest` at the turns
    `longest_at`."""
    gen = torch.Generator().manual_seed(seed)
    for turn in range(count):
        length = longest if turn in longest_at else int(torch.randint(8, longest, (1,), generator=gen))
        yield turn, torch.randint(100, 20000, (1, length), generator=gen), turn in longest_at


@pytest.mark.slow  # ~40 s on 2 cores: run by `make test-slow` in CI
def test_a_bounded_session_stops_allocating_after_its_longest_turn_and_answer(smol):
    """60 turns of up to 96 tokens with answers of up to 24: the buffers never overflow (every write fits
    or grows first) and, once the longest turn and answer have been seen, stay the same tensors."""
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
    layer = session.cache.layers[3]
    buffers = None
    for turn, ids, longest in _turns(60, 96, (5, 50), seed=0):
        session.append(ids)
        list(session.generate(24 if longest else 4, eos_token_id=[]))
        assert layer.keys.shape[2] <= layer._k.capacity
        if turn == 10:
            buffers = (layer._k.buf, layer._v.buf)
        if turn > 10:
            assert layer._k.buf is buffers[0] and layer._v.buf is buffers[1], turn
    assert layer._k.capacity == -(-(256 + 96 + 24) // GRAIN) * GRAIN  # budget + longest turn + longest answer


@pytest.mark.parametrize("policy", ["h2o", "inf_mllm+recall"])
def test_what_layers_keep_per_token_grows_in_its_buffer_and_equals_the_dynamic_layers(smol, policy, tmp_path):
    """Turn ids (recall) and accumulated attention (H2O) grow by every decode step: in place, not by a new
    tensor per step, and equal to what the dynamic layers (torch.cat) keep."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 500), generator=torch.Generator().manual_seed(4))
    kwargs = {"window": 16} if policy.startswith("inf_mllm") else {}
    static = StreamSession(model, tok, policy, budget=128, store=tmp_path / "s", **kwargs)
    dynamic = StreamSession(model, tok, policy, budget=128, store=tmp_path / "d", static=False, **kwargs)
    key = "acc" if policy == "h2o" else None
    layer = static.cache.layers[1]
    for start in range(0, 500, 100):
        dynamic.append(ids[:, start:start + 100])
        want = [int(t[0]) for t in dynamic.generate(8, eos_token_id=[])]
        static.append(ids[:, start:start + 100])
        answer = static.generate(8, eos_token_id=[])
        got = [int(next(answer)[0]), int(next(answer)[0])]  # two steps: the statistic has grown into its buffer
        kept = layer.stats[key] if key else layer.turn_ids
        for token in answer:
            got.append(int(token[0]))
            grown = layer.stats[key] if key else layer.turn_ids
            assert grown.data_ptr() == kept.data_ptr() and grown.shape[2] == layer.keys.shape[2]
        assert got == want
        for mine, theirs in zip(static.cache.layers, dynamic.cache.layers, strict=True):
            if key:
                assert torch.allclose(mine.stats[key], theirs.stats[key], atol=1e-4)
            else:
                assert torch.equal(mine.turn_ids, theirs.turn_ids)


def test_buffer_writes_in_place_and_takes_back_a_prefix_without_copying():
    buf = KVBuffer()
    buf.append(torch.ones(1, 2, 3, 4))
    first = buf.buf
    buf.append(torch.full((1, 2, 1, 4), 2.0))
    assert buf.buf is first and buf.get().shape == (1, 2, 4, 4) and float(buf.get()[0, 0, 3, 0]) == 2.0
    buf.set(buf.get()[:, :, :2])  # a rollback: the first rows, the same storage
    assert buf.n == 2 and buf.buf is first
    buf.set(buf.get()[:, :, 1:].flip(2))  # an overlapping view of itself: copied before it is written over
    assert buf.n == 1 and float(buf.get()[0, 0, 0, 0]) == 1.0
    buf.append(torch.zeros(1, 2, GRAIN, 4))  # past the capacity: grows, keeping the rows
    assert buf.capacity == 2 * GRAIN and float(buf.get()[0, 0, 0, 0]) == 1.0 and buf.n == GRAIN + 1


def test_a_tightened_budget_gives_its_reserved_memory_back(smol):
    """An out-of-memory retry shrinks the budget: the buffers shrink with it, not only the cache's rows."""
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=1024, window=16)
    session.append(torch.randint(100, 20000, (1, 1200), generator=torch.Generator().manual_seed(0)))
    layer = session.cache.layers[2]
    assert layer._k.capacity >= 1200
    newest = layer.values[:, :, -10:].clone()  # the newest tokens stay (values are not re-rotated)
    session.cache.shrink([200] * len(session.cache.layers))
    assert layer.keys.shape[2] == layer.values.shape[2] <= 200
    assert layer._k.capacity == layer._v.capacity == GRAIN
    assert torch.equal(layer.values[:, :, -10:], newest)


def test_a_buffer_allocates_at_least_what_was_reserved_and_keeps_it_when_fitted():
    buf = KVBuffer()
    buf.least = GRAIN + 40
    buf.append(torch.ones(1, 2, 3, 4))
    assert buf.capacity == 2 * GRAIN and buf.n == 3  # the reserve, rounded up, at the first write
    first = buf.buf
    buf.append(torch.ones(1, 2, GRAIN, 4))
    assert buf.buf is first  # within the reserve: no new tensor
    buf.set(buf.get()[:, :, :5])
    buf.fit()
    assert buf.capacity == 2 * GRAIN and buf.buf is first  # fitting gives back nothing below the reserve


def test_a_reserved_session_keeps_one_buffer_shape_from_its_first_turn(smol):
    """Budget + longest turn + longest answer reserved before the first turn: every turn and answer up to those
    lengths writes into the same tensors, the shape a compiled decode step was traced on; a tightened budget
    (out of memory) shrinks the reserve with it."""
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=192, window=16)
    session.cache.reserve(80 + 1 + 12)
    layer = session.cache.layers[5]
    buffers = None
    for turn, ids, longest in _turns(12, 80, (3, 9), seed=1):
        session.append(ids)
        if buffers is None:
            buffers = (layer._k.buf, layer._v.buf)
        list(session.generate(12 if longest else 3, eos_token_id=[]))
        assert layer._k.buf is buffers[0] and layer._v.buf is buffers[1], turn
    assert layer._k.capacity == -(-(192 + 80 + 1 + 12) // GRAIN) * GRAIN
    session.cache.shrink([64] * len(session.cache.layers))
    assert layer._k.capacity == layer._v.capacity == GRAIN  # 64 + 93 rows
