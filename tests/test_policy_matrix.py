"""Every registered policy and every listed combination, on the real SmolLM2-135M: a clip-like turn
(input embeddings with a vision span), a question with an answer, another turn; each layer stays
within the budget its allocator gave it, the layers' total within the nominal total, and generation
works. Plus the per-layer machinery: positions, the explicit decode phase, option errors."""

import pytest
import torch

from inf_mllm import POLICIES, StreamingCache, StreamSession
from inf_mllm.policies import COMBINATIONS, policy_options
from inf_mllm.rope import rerotate

BUDGET = 12
MATRIX = [p for p in POLICIES if p != "full"] + list(COMBINATIONS)


def _within_budgets(session, answer: int = 0):
    cache = session.cache
    lengths = [layer.get_seq_length() for layer in cache.layers]
    allotted = cache.layer_budgets
    assert all(n <= b + answer for n, b in zip(lengths, allotted, strict=True)), (lengths, allotted)
    assert sum(allotted) <= BUDGET * len(lengths)
    assert session.kv_tokens <= BUDGET + answer
    assert cache.get_seq_length() == max(lengths)  # every layer ends at the same position
    assert all(layer.start + n == max(lengths) for layer, n in zip(cache.layers, lengths, strict=True))


@pytest.mark.parametrize("name", MATRIX)
def test_policy_runs_real_turns_within_its_per_layer_budgets(smol, name):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 32), generator=torch.Generator().manual_seed(0))
    options = {"window": 4} if "window" in policy_options(name) else {}
    session = StreamSession(model, tok, name, budget=BUDGET, **options)
    with torch.no_grad():
        clip = model.get_input_embeddings()(ids[:, :20])
    session.append(inputs_embeds=clip, vision=(2, 16))  # 14 "visual" tokens, then text
    _within_budgets(session)
    logits = session.append(ids[:, 20:29])
    assert torch.isfinite(logits).all()
    _within_budgets(session)
    answer = [int(t[0]) for t in session.generate(2, eos_token_id=[])]
    assert len(answer) == 2 and all(0 <= t < model.config.vocab_size for t in answer)
    _within_budgets(session, answer=0 if session.cache.policy.evict_while_decoding else 1)
    assert torch.isfinite(session.append(ids[:, 29:])).all()
    _within_budgets(session)


def test_layers_of_different_budgets_end_at_one_position(smol):
    """Per-layer budgets: layer l keeps its last K_l tokens, re-rotated so that every layer ends at
    position max K (where the next token goes): the keys equal the full cache's, rotated by max K - n."""
    model, _ = smol
    n = 50
    budgets = [12 + i for i in range(model.config.num_hidden_layers)]
    ids = torch.randint(100, 20000, (1, n))
    full = StreamingCache.for_model(model, "full")
    cache = StreamingCache.for_model(model, "window", budget=budgets)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full)
        model(input_ids=ids, past_key_values=cache)
    cache.evict()
    end = max(budgets)
    assert cache.get_seq_length() == end
    for i in (0, 7, 29):
        k = budgets[i]
        want = rerotate(full.layers[i].keys[:, :, n - k:], torch.tensor(end - n), cache.inv_freq)
        assert torch.allclose(cache.layers[i].keys, want, atol=1e-4), i
    with torch.no_grad():  # the next turn runs over layers of different lengths (the mask sliced per layer)
        out = model(input_ids=ids[:, :5], past_key_values=cache)
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == end + 5


def test_a_paused_answer_leaves_the_cache_in_the_prompt_phase(smol):
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=64, window=8)
    session.append(torch.randint(100, 20000, (1, 12)))
    answer = session.generate(3, eos_token_id=[])
    next(answer)
    next(answer)  # one decode forward ran; the answer is paused
    assert not session.cache.current.decoding
    session.append(torch.randint(100, 20000, (1, 5)))  # a turn, not a decode step
    assert session.cache.layers[0].prompt_len == 6  # the held-back answer token and the 5 new ones


def test_a_window_for_a_policy_without_one_is_an_error(smol):
    model, tok = smol
    with pytest.raises(ValueError, match="'streaming_llm' takes no option window"):
        StreamSession(model, tok, "streaming_llm", budget=64, window=4)
