"""The streaming cache on the real SmolLM2-135M-Instruct (GQA: 9 query heads, 3 KV heads)."""

import pytest
import torch

from inf_mllm import POLICIES, StreamingCache, StreamSession

# policies whose layers all keep the same budget (those with per-layer allocators: tests/test_policy_matrix.py)
BOUNDED = [p for p in POLICIES if p != "full" and POLICIES[p].default_allocator == "uniform"]
SMALL = {"inf_mllm": {"window": 16}, "inf_mllm_plus": {"window": 16}}


def plain_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_prefill_computes_the_last_positions_logits_unless_asked_for_all(smol):
    """Only the next token needs logits: the LM head runs over the last position (the same numbers as the last
    row of every position's), and everything else about the turn is as before."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 40), generator=torch.Generator().manual_seed(0))
    last_only, every = (StreamSession(model, tok, "inf_mllm", budget=4096) for _ in range(2))
    last, all_rows = last_only.append(ids), every.append(ids, all_logits=True)
    assert last.shape == (1, 1, model.config.vocab_size) and all_rows.shape == (1, 40, model.config.vocab_size)
    assert (last[:, -1] - all_rows[:, -1]).abs().max() < 1e-4
    assert last_only.seen == every.seen == 40 and last_only.kv_tokens == every.kv_tokens == 40
    answers = [[int(t[0]) for t in s.generate(4, eos_token_id=[])] for s in (last_only, every)]
    assert answers[0] == answers[1]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("batch", [1, 2])
def test_budget_above_stream_reproduces_plain_model(smol, policy, batch):
    model, tok = smol
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (batch, 120))
    want = plain_logits(model, ids)
    session = StreamSession(model, tok, policy, budget=4096, batch=batch, **SMALL.get(policy, {}))
    got = torch.cat([session.append(ids[:, i:i + 30], all_logits=True) for i in range(0, 120, 30)], dim=1)
    assert (got - want).abs().max() <= 1e-4
    assert session.kv_tokens == 120


@pytest.mark.parametrize("batch", [1, 2])
def test_every_evicting_policy_really_evicts(smol, batch):
    model, tok = smol
    ids = torch.randint(100, 20000, (batch, 200))
    for policy in BOUNDED:
        session = StreamSession(model, tok, policy, budget=64, batch=batch, **SMALL.get(policy, {}))
        session.append(ids[:, :100])
        session.append(ids[:, 100:])
        assert session.kv_tokens == 64, policy
        layer = session.cache.layers[3]
        assert layer.keys.shape == (batch, 3, 64, 64) and layer.values.shape == layer.keys.shape


def test_turns_as_input_embeddings_match_token_ids(smol):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 150))
    by_ids = StreamSession(model, tok, "inf_mllm", budget=64, window=16)
    by_emb = StreamSession(model, tok, "inf_mllm", budget=64, window=16)
    embed = model.get_input_embeddings()
    for part in (ids[:, :80], ids[:, 80:]):
        want = by_ids.append(part)
        with torch.no_grad():
            got = by_emb.append(inputs_embeds=embed(part))
        assert (got - want).abs().max() <= 1e-4
    assert torch.equal(by_ids.cache.layers[5].keys, by_emb.cache.layers[5].keys)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the Triton scoring path runs only there")
def test_cuda_session_uses_triton_scores_and_matches_cpu(smol):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 160))
    cpu = StreamSession(model, tok, "inf_mllm", budget=64, window=16)
    cpu.append(ids[:, :100], evict=False)
    cpu_scores = cpu.cache.layers[0].stats["window"]
    gpu_model = type(model).from_pretrained(model.name_or_path, attn_implementation="inf_mllm_sdpa").cuda()
    gpu = StreamSession(gpu_model, tok, "inf_mllm", budget=64, window=16)
    gpu.append(ids[:, :100].cuda(), evict=False)
    assert (gpu.cache.layers[0].stats["window"].cpu() - cpu_scores).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("policy", BOUNDED)
def test_long_stream_stays_bounded(smol, policy):
    """80 turns with answers (25 budgets' worth): the cache and every position stay under budget + turn + answer."""
    model, tok = smol
    budget, turn, answer = 32, 8, 2
    positions = []

    def record(module, args, kwargs, out):
        positions.append(int(kwargs.get("position_ids", args[-1]).max()))

    hook = model.model.rotary_emb.register_forward_hook(record, with_kwargs=True)
    try:
        session = StreamSession(model, tok, policy, budget=budget, **({"window": 8} if policy in SMALL else {}))
        gen = torch.Generator().manual_seed(0)
        for _ in range(80):
            session.append(torch.randint(100, 20000, (1, turn), generator=gen))
            assert session.kv_tokens <= budget
            for _ in session.generate(answer, eos_token_id=[]):
                assert session.kv_tokens <= budget + answer
    finally:
        hook.remove()
    assert session.seen == 80 * (turn + answer) - 1  # the last answer token waits for the next turn
    assert max(positions) < budget + turn + answer + 1  # +1: the held-back answer token joins the next turn


def test_bytes_budget_and_per_layer_budgets(smol):
    model, _ = smol
    per_token = 2 * 3 * 64 * 4 * model.config.num_hidden_layers  # K+V, 3 KV heads, dim 64, fp32
    cache = StreamingCache.for_model(model, "streaming_llm", budget=f"{per_token * 100}B")
    assert cache.budgets == [100] * model.config.num_hidden_layers
    budgets = [32 + i for i in range(model.config.num_hidden_layers)]
    session_cache = StreamingCache.for_model(model, "window", budget=budgets)
    with torch.no_grad():
        model(input_ids=torch.randint(100, 20000, (1, 90)), past_key_values=session_cache)
    session_cache.evict()
    assert [layer.get_seq_length() for layer in session_cache.layers] == budgets
    with pytest.raises(ValueError, match="layers"):
        StreamingCache.for_model(model, "window", budget=[10, 20])


def test_h2o_evicts_during_decoding_but_inf_mllm_does_not(smol):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 80))
    for policy, grows in [("h2o", False), ("inf_mllm", True)]:
        session = StreamSession(model, tok, policy, budget=64, **({"window": 16} if policy == "inf_mllm" else {}))
        session.append(ids)
        list(session.generate(10, eos_token_id=[]))
        assert (session.kv_tokens > 64) == grows, policy


def test_generate_with_hf_generate_after_eviction(smol):
    """model.generate(past_key_values=cache) continues correctly from a shrunk, re-rotated cache."""
    model, tok = smol
    ids = tok("Once upon a time, in a small village by the sea, there lived an old fisherman who " * 6,
              return_tensors="pt").input_ids
    question = tok(" The fisherman", return_tensors="pt").input_ids
    ours = StreamSession(model, tok, "inf_mllm", budget=64, window=16)
    ours.append(ids)
    ours.append(question)
    want = [int(t) for t in ours.generate(8, eos_token_id=[])]

    theirs = StreamSession(model, tok, "inf_mllm", budget=64, window=16)
    theirs.append(ids)
    first = theirs.append(question)[:, -1].argmax(-1, keepdim=True)
    cached = theirs.kv_tokens
    assert cached == 64  # evicted and re-rotated before generate sees it
    # generate slices off what the cache already holds: the prefix ids are placeholders
    full = torch.cat([torch.zeros(1, cached, dtype=torch.long), first], dim=1)
    out = model.generate(full, attention_mask=torch.ones_like(full), past_key_values=theirs.cache,
                         max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert [int(first)] + out[0, cached + 1:].tolist() == want


def test_greedy_generate_matches_transformers(smol):
    model, tok = smol
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    session = StreamSession(model, tok, "full")
    session.append(ids)
    got = [int(t) for t in session.generate(12, eos_token_id=[])]
    want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == want[0, ids.shape[1]:].tolist()


def test_sampling_is_reproducible_and_streams(smol):
    model, tok = smol
    runs = []
    for _ in range(2):
        session = StreamSession(model, tok, "inf_mllm", budget=128, window=16)
        session.append_text("Tell me a story about a dragon.")
        gen = torch.Generator().manual_seed(7)
        runs.append([int(t) for t in session.generate(10, do_sample=True, temperature=0.8, top_p=0.9,
                                                      generator=gen, eos_token_id=[])])
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_non_rope_model_raises_value_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100))
    with pytest.raises(ValueError, match="rotary"):
        StreamingCache.for_model(model, "inf_mllm", budget=128)


def test_kv_bytes_track_tokens(smol):
    model, tok = smol
    session = StreamSession(model, tok, "streaming_llm", budget=64)
    session.append(torch.randint(100, 20000, (1, 200)))
    assert session.kv_bytes == 64 * 2 * 3 * 64 * 4 * model.config.num_hidden_layers


@pytest.mark.parametrize("policy", ["inf_mllm", "inf_mllm+recall"])
def test_a_question_asked_with_keep_false_leaves_no_trace(smol, policy):
    """keep=False: the question and its answer leave as the next turn begins, so the next turn and
    question see exactly the cache they would have seen had it never been asked."""
    model, tok = smol

    def ids(text):
        return tok(text, return_tensors="pt", add_special_tokens=False).input_ids

    def session(ask_first: bool):
        s = StreamSession(model, tok, policy, budget=48, window=8)
        for line in ("The red fox jumps over the fence.\n", "Paris is the capital of France.\n") * 3:
            s.append(ids(line))
        if ask_first:
            s.append_question(ids("What colour is the fox?"), keep=False)
            assert len(list(s.generate(5, eos_token_id=[len(tok) - 1]))) == 5  # five tokens go in
        s.append(ids("The secret number is 4721.\n"))
        return s, s.kv_tokens, s.append_question(ids("What is the secret number?"))

    (_, kv_plain, plain), (_, kv_asked, asked) = session(False), session(True)
    assert kv_plain == kv_asked
    assert (plain - asked).abs().max() < 1e-4


def _decode_ops(session, steps: int = 4):
    """How many times each torch operator runs in `steps` decode steps after the first answer token."""
    from collections import Counter

    from torch.profiler import profile

    tokens = session.generate(steps + 2, eos_token_id=[])
    next(tokens)
    with profile() as prof:
        for _ in range(steps):
            next(tokens)
    tokens.close()
    return Counter({event.key: event.count for event in prof.key_averages()})


def test_an_inf_mllm_decode_step_runs_the_same_operators_as_streaming_llms(smol):
    """Issue 23's goal, inf_mllm decode <= 1.02x streaming_llm's: with both caches full, a decode step of either
    does the same work, operator for operator (Inf-MLLM scores and evicts at the next prompt, never while decoding).
    The timed ratio is left to `python -m benchmarks latency`."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 400), generator=torch.Generator().manual_seed(9))
    ops = []
    for policy in ("inf_mllm", "streaming_llm"):
        session = StreamSession(model, tok, policy, budget=128, **SMALL.get(policy, {}))
        for start in range(0, 400, 100):
            session.append(ids[:, start:start + 100])
        assert session.kv_tokens <= 128 + 100
        ops.append(_decode_ops(session))
    assert sum(ops[0].values()) > 4 * model.config.num_hidden_layers  # the profile saw the steps
    assert ops[0] == ops[1]


@pytest.mark.parametrize("policy", ["inf_mllm+recall", "h2o", "elastic"])
def test_a_released_cache_frees_its_buffers_without_the_garbage_collector(smol, policy, tmp_path):
    """No layer sits in a reference cycle (it knows a `LayerSetup`, not its cache; its positions and statistics
    know it weakly): once its session is closed, every K/V and statistics buffer is freed by reference counting
    alone, with the collector off, after turns, an answer, an eviction and (recall) a linked block."""
    import gc
    import weakref

    model, tok = smol
    session = StreamSession(model, tok, policy, budget=96, store=str(tmp_path / "store") if "recall" in policy
                            else None)
    for seed in range(3):
        session.append(torch.randint(100, 20000, (1, 70), generator=torch.Generator().manual_seed(seed)))
    session.append_question(torch.randint(100, 20000, (1, 8)), named=lambda meta: True)  # every stored turn named
    list(session.generate(3, eos_token_id=[]))
    assert session.store is None or session.cache.layers[0].linked  # recall: the question linked stored turns
    layers = session.cache.layers
    held = [weakref.ref(t) for layer in layers for t in (*layer.buffers(), *layer.stats.values())]
    held += [weakref.ref(layer) for layer in layers]
    del layers
    assert all(ref() is not None for ref in held)
    gc.disable()
    try:
        session.cache.release()
        alive = sum(ref() is not None for ref in held)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(held)} layers or buffers still alive after release"
