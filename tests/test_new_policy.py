"""A new policy with a new statistic is one file and one registry line (ARCHITECTURE.md, "One place to change"):
tests/throwaway_policy.py, registered here, evicts, merges, recalls and rolls back on the real SmolLM2 with its
statistic following the tokens, though no module of the core names it."""

import torch

from inf_mllm import StreamSession, spec
from inf_mllm import recall as recall_


def _turns(session, model, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    for k in range(count):
        embeds = model.get_input_embeddings()(torch.randint(100, 20000, (1, 18), generator=g))
        session.append(inputs_embeds=embeds, meta={"clip": k + 1})


def test_a_throwaway_policy_with_its_own_statistic_runs_by_one_registry_line(smol, monkeypatch):
    monkeypatch.setitem(spec.SCORERS, "peak", "tests.throwaway_policy:Peak")  # the one line
    model, tok = smol
    session = StreamSession(model, tok, "peak", budget=24)
    _turns(session, model, 2)
    layer, budget = session.cache.layers[3], 24
    session.append(torch.arange(300, 330)[None], evict=False)
    before = layer.stats["peak"].clone()
    assert before.shape == (1, layer.keys.shape[1], layer.get_seq_length()) and float(before[..., -1].min()) > 0
    kept = session.cache.policy.select(layer.view(), budget)  # what the policy picks by the new statistic
    session.cache.evict()
    # lasting: not spent by the eviction, gathered with the tokens the policy chose
    assert torch.equal(layer.stats["peak"], before.gather(-1, kept[:, None].expand(-1, before.shape[1], -1)))
    marks = session.cache.mark()
    list(session.generate(3, eos_token_id=[]))  # decode steps grow it (and raise it) in place
    assert layer.stats["peak"].shape[-1] == layer.get_seq_length() == budget + 2
    session.cache.rollback(marks)
    assert torch.equal(layer.stats["peak"], before.gather(-1, kept[:, None].expand(-1, before.shape[1], -1)))


def test_the_new_statistic_is_merged_as_it_declares_and_follows_linked_spans(smol, monkeypatch):
    monkeypatch.setitem(spec.SCORERS, "peak", "tests.throwaway_policy:Peak")
    model, tok = smol
    merged = StreamSession(model, tok, "peak+merge", budget=24)
    _turns(merged, model, 2)
    layer = merged.cache.layers[5]
    merged.append(torch.arange(300, 330)[None], evict=False)
    before = layer.stats["peak"].clone()
    anchors = merged.cache.policy.select(layer.view(), 24)
    merged.cache.evict()
    after = layer.stats["peak"]
    assert after.shape[-1] == 24
    own = before.gather(-1, anchors[:, None].expand(-1, before.shape[1], -1))
    assert bool((after >= own).all()) and bool((after > own).any())  # each bucket keeps its members' highest
    assert float(after.max()) == float(before.max())  # a max, not a sum

    recalling = StreamSession(model, tok, "peak+recall", budget=40)
    _turns(recalling, model, 6)
    layer = recalling.cache.layers[5]
    resident = recall_.resident_spans(recalling.cache, recalling.store, recalling.recall.resident)
    gone = [span.meta["clip"] for i, span in recalling.store.spans.items() if i not in resident]
    recalling.append_question(torch.arange(400, 405)[None], named=lambda meta: meta.get("clip") == gone[0])
    assert [meta["clip"] for _, meta in recalling.last_recalled] == [gone[0]]
    assert layer.stats["peak"].shape[-1] == layer.get_seq_length()  # zeros where the span went in
    recalling.append(torch.arange(500, 505)[None])  # the linked span leaves; the statistic with it
    assert layer.stats["peak"].shape[-1] == layer.get_seq_length() <= 40
