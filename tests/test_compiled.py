"""Compiled decode (inf_mllm/compiled.py): the same tokens as the eager step, on the cache's own buffers, and the
eager step wherever a step is not plain."""

import pytest
import torch
from run_ahead import check_run_ahead

from inf_mllm import StreamSession
from inf_mllm.compiled import CompiledDecode, compiled_decode


def _stream(session, ids, rounds: int, answer: int) -> list[list[int]]:
    tokens = []
    for r in range(rounds):
        session.append(ids[:, 100 * r:100 * (r + 1)])
        tokens.append([int(t[0]) for t in session.generate(answer, eos_token_id=[])])
    return tokens


@pytest.mark.slow  # the first compile of SmolLM2's step takes about two minutes on 2 cores
@pytest.mark.parametrize("policy", ["inf_mllm", "streaming_llm", "inf_mllm+recall"])
def test_compiled_decode_answers_the_eager_tokens_and_leaves_the_same_cache(smol, policy, tmp_path):
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 800), generator=torch.Generator().manual_seed(5))
    kwargs = {"window": 16} if policy.startswith("inf_mllm") else {}
    eager = StreamSession(model, tok, policy, budget=256, store=tmp_path / "eager", **kwargs)
    compiled = StreamSession(model, tok, policy, budget=256, store=tmp_path / "compiled", compile_decode=True, **kwargs)
    steps = compiled._compiled.steps
    assert _stream(compiled, ids, 8, 12) == _stream(eager, ids, 8, 12)
    assert compiled._compiled.steps - steps == 8 * 11  # every step after an answer's first token ran compiled
    for mine, theirs in zip(compiled.cache.layers, eager.cache.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-3) and torch.allclose(mine.values, theirs.values,
                                                                                     atol=1e-3)
        if "recall" in policy:
            assert torch.equal(mine.turn_ids, theirs.turn_ids)


@pytest.mark.slow  # compiles SmolLM2's step (shared with the test above when both run)
def test_a_step_run_ahead_is_kept_only_while_the_answer_goes_on(smol):
    """`run_ahead` (on by default on a GPU, forced here) launches the step for each token before handing it over;
    answers that end at the last token, at an end token or at the consumer's break keep the eager tokens and cache,
    and only the steps of tokens that went on count."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 800), generator=torch.Generator().manual_seed(5))
    eager = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
    ahead = StreamSession(model, tok, "inf_mllm", budget=256, window=16, compile_decode=True)
    ahead.run_ahead = True
    answers = check_run_ahead(eager, ahead, ids)
    assert any(len(a) not in (5, 12) for a in answers)  # one answer ended at an end token


@pytest.mark.parametrize("policy, reason", [("h2o", "evicts while decoding"), ("full", "unbounded"),
                                            ("inf_mllm+vl_cache_budgets", "per-layer budgets")])
def test_a_step_that_is_not_plain_runs_eagerly(smol, policy, reason):
    """Nothing compiles here: `step` declines before it would."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 400), generator=torch.Generator().manual_seed(6))
    budget = None if policy == "full" else 64  # every round evicts: per-layer budgets differ from the first answer
    kwargs = {"window": 16} if policy.startswith("inf_mllm") else {}
    eager = StreamSession(model, tok, policy, budget=budget, **kwargs)
    session = StreamSession(model, tok, policy, budget=budget, compile_decode=True, **kwargs)
    steps = session._compiled.steps
    assert _stream(session, ids, 4, 5) == _stream(eager, ids, 4, 5)
    assert reason in CompiledDecode.why_not(session.cache)
    assert session._compiled.steps == steps


def test_a_full_buffer_declines_the_compiled_step_and_writes_nothing(smol):
    """With no free row the eager step grows the buffers; the compiled one must not write past them."""
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=256, window=16)
    session.append(torch.randint(100, 20000, (1, 256), generator=torch.Generator().manual_seed(7)))
    layer = session.cache.layers[0]
    assert CompiledDecode.why_not(session.cache) is None and layer.get_seq_length() == layer._k.capacity
    before = layer.keys.clone()
    assert compiled_decode(model).step(session.cache, torch.tensor([42])) is None
    assert layer.get_seq_length() == 256 and torch.equal(layer.keys, before)


def test_a_static_false_session_never_compiles(smol):
    model, tok = smol
    session = StreamSession(model, tok, "inf_mllm", budget=128, static=False, compile_decode=True)
    session.append(torch.randint(100, 20000, (1, 200), generator=torch.Generator().manual_seed(8)))
    assert "not in buffers" in CompiledDecode.why_not(session.cache)


@pytest.mark.slow  # two runs of stream-qa, one of them compiling tiny-vlm's decode step
def test_stream_qa_compile_decode_gives_the_eager_answers():
    import json
    import subprocess
    import sys

    from streaming.sources import bundled_clip

    def answers(*flags):
        out = subprocess.run([sys.executable, "-m", "streaming.cli", str(bundled_clip("bikes.mp4")), "--fast", "--json",
                              "--budget", "128", "--policy", "inf_mllm", "--ask", "what is in the video? @9s",
                              "--ask", "is there a bicycle? @3s", *flags], capture_output=True, text=True, timeout=600,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        assert ("run compiled" in out.stderr) == bool(flags)
        return [json.loads(line)["answer"] for line in out.stdout.splitlines()]

    eager = answers()
    assert len(eager) == 2 and all(eager)
    assert answers("--compile-decode") == eager


@pytest.mark.parametrize("options, triton, compiled", [([], True, False), (["--device", "cuda"], True, True),
                                                       (["--device", "cuda:1"], True, True),
                                                       (["--device", "cuda"], False, False),
                                                       (["--device", "cuda", "--no-compile-decode"], True, False),
                                                       (["--compile-decode"], True, True)])
def test_stream_qa_compiles_decode_by_default_where_it_is_faster_a_gpu(options, triton, compiled, monkeypatch):
    """On an H200 the compiled 7B step is 5.6-8.8x faster than eager; on this CPU it is no faster. A CUDA build
    without Triton has no GPU compiler."""
    import importlib.util

    from streaming.budgets import compiles_decode
    from streaming.cli import build_parser
    from streaming.sources import bundled_clip

    args = build_parser().parse_args([str(bundled_clip()), *options])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: find_spec(name) if triton else None)
    assert compiles_decode(args.device, args.compile_decode) is compiled


def test_a_compile_that_fails_warns_once_and_decodes_eagerly(smol):
    """A GPU without Triton (some Jetson builds) or an op the compiler cannot trace: `stream-qa` compiles by
    default on a GPU, so a failed compile must cost a warning, not the answer."""
    model, tok = smol
    ids = torch.randint(100, 20000, (1, 400), generator=torch.Generator().manual_seed(10))
    eager = StreamSession(model, tok, "inf_mllm", budget=128, window=16)
    session = StreamSession(model, tok, "inf_mllm", budget=128, window=16, compile_decode=True)
    session._compiled = broken = CompiledDecode(model)  # not the model's shared step
    calls = []

    def no_compiler(token):
        calls.append(token)
        raise RuntimeError("Cannot find a working triton installation.\nMore details")

    broken._forward = no_compiler
    with pytest.warns(UserWarning, match=r"compiled decode failed \(RuntimeError: Cannot find a working triton "
                                         r"installation\.\); decoding eagerly"):
        assert _stream(session, ids, 3, 6) == _stream(eager, ids, 3, 6)
    assert len(calls) == 1 and broken.steps == 0
    assert session.cache.get_seq_length() == eager.cache.get_seq_length()
