"""The arena (benchmarks/arena.py): fractions of the full cache, the best configuration, resuming and an
interrupted run by hand, then a tiny real run (SmolLM2 + tiny-vlm, two policies) end to end."""

import json
from pathlib import Path

import pytest

from benchmarks import arena as arena_mod
from benchmarks.arena import Scale, arena
from benchmarks.arena_scores import QUALITY, best_at, fractions
from benchmarks.common import fraction_of_full, record
from benchmarks.report import arena_section, write_readme
from streaming.records import read


def test_fractions_read_each_policy_against_the_full_cache_on_the_same_questions():
    records = [
        record("stream_ppl", "full", None, "ppl", 80.0, "stream"),
        record("stream_ppl", "window", 64, "ppl", 100.0, "stream"),
        record("retrieval", "full", None, "accuracy", 0.8, "all"),
        record("retrieval", "full", None, "accuracy", 0.9, "within 64"),
        record("retrieval", "full", None, "accuracy", 0.6, "within 128"),
        record("retrieval", "window", 64, "accuracy", 0.45, "within budget"),
        record("retrieval", "window", 128, "accuracy", 0.6, "within budget"),
        record("retrieval", "window", 64, "accuracy", 0.2, "all"),
        record("retrieval", "window", 64, "round_ms", 5.0, "median"),  # not a quality: no fraction
        record("video_qa", "window", 64, "accuracy", 0.5, "all"),  # no full cache run: no fraction
    ]
    got = {(r["benchmark"], r["budget"], r["x"]): r["value"] for r in fractions(records)}
    assert got == pytest.approx({("stream_ppl", 64, "stream"): 0.8, ("retrieval", 64, "within budget"): 0.5,
                                 ("retrieval", 128, "within budget"): 1.0, ("retrieval", 64, "all"): 0.25})
    assert all(r["metric"] == "of_full" and r["policy"] == "window" for r in fractions(records))


def test_best_configuration_is_the_one_whose_worst_goal_benchmark_is_highest():
    def of_full(policy, benchmark, value, budget=64):
        return record(benchmark, policy, budget, "of_full", value, QUALITY[benchmark][1])

    records = [of_full("a", "retrieval", 0.99), of_full("a", "video_qa", 0.80),
               of_full("b", "retrieval", 0.90), of_full("b", "video_qa", 0.91), of_full("b", "stream_ppl", 0.5),
               of_full("c", "retrieval", 1.00), of_full("c", "video_qa", 1.00, budget=128),  # other budget
               of_full("d", "retrieval", 0.95)]  # no video_qa: not a candidate
    assert best_at(records, 64) == ("b", {"retrieval": 0.90, "video_qa": 0.91})
    assert best_at(records, 128) is None


@pytest.fixture
def fake_units(monkeypatch, smol):
    """The stream_ppl unit replaced by one that records its call (and can be told to be interrupted)."""
    calls = []

    def fake(ctx, policy, budget, cfg, bar):
        calls.append((policy, budget, cfg))
        if policy == fake.interrupt_at:
            raise KeyboardInterrupt
        ppl = 10.0 if policy == "full" else 12.5
        return [record("stream_ppl", policy, budget, "ppl", ppl, "stream"),
                record("stream_ppl", policy, budget, "round_ms", 1.0, "median")]

    fake.interrupt_at = None
    monkeypatch.setitem(arena_mod.RUNNERS, "stream_ppl", fake)
    return fake, calls


def test_an_interrupted_run_keeps_what_it_finished_and_resumes_from_there(tmp_path, smol, fake_units):
    fake, calls = fake_units
    model, tok = smol
    scale = Scale(context=512, fractions=(8,), ppl_tokens=128, retrieval_rounds=1, retrieval_seeds=1,
                  video_rounds=1, videos=1)
    kwargs = {"names": ["full", "window", "streaming_llm"], "benchmarks": ("stream_ppl",), "model": model,
              "tok": tok, "plot": False}
    fake.interrupt_at = "streaming_llm"
    with pytest.raises(KeyboardInterrupt):
        arena(tmp_path, scale, **kwargs)
    kept = read(tmp_path / "arena.json")
    assert {(r["policy"], r["metric"]) for r in kept} == {("full", "ppl"), ("full", "round_ms"), ("window", "ppl"),
                                                          ("window", "round_ms"), ("window", "of_full")}
    assert [c[:2] for c in calls] == [("full", None), ("window", 64), ("streaming_llm", 64)]
    assert calls[2][2] == {}  # streaming_llm's defaults (4 sinks)

    fake.interrupt_at = None
    calls.clear()
    records = arena(tmp_path, scale, resume=True, **kwargs)
    assert [c[:2] for c in calls] == [("streaming_llm", 64)]  # the finished runs are not run again
    got = {r["policy"]: r["value"] for r in records if r["metric"] == "of_full"}
    assert got == pytest.approx({"window": 0.8, "streaming_llm": 0.8})  # full ppl / policy ppl
    with pytest.raises(SystemExit, match="another run"):
        arena(tmp_path, scale, resume=True, budgets=[32], **kwargs)


@pytest.fixture(scope="module")
def vlm():
    from models import load_adapter

    return load_adapter("tiny-vlm")


def test_replayed_video_rounds_match_the_engine(vlm):
    """The arena encodes each video once and replays its clips; answers and cache sizes are the engine's."""
    from tqdm import tqdm

    from benchmarks.common import config_for
    from benchmarks.video_qa import qa_rounds, run_one

    scale = Scale(context=256, fractions=(4,), ppl_tokens=64, retrieval_rounds=1, retrieval_seeds=1,
                  video_rounds=3, videos=1)
    (clips, asks), = arena_mod.videos(vlm, scale)
    assert [c[:3] for c in clips] == [(1, 0.0, 2.0), (2, 2.0, 4.0), (3, 4.0, 6.0)]
    cfg = config_for("inf_mllm", 64)
    replayed = qa_rounds(vlm, clips, asks, "inf_mllm", 64, cfg)
    with tqdm(disable=True) as bar:
        engine, _, _, _ = run_one(vlm, Path(".cache/video_qa/easyvqa_3_rounds_0.mp4"), asks, "inf_mllm", 64, cfg, None,
                               bar)
    assert [(r["round"], r["back"], r["ok"]) for r in replayed] == [(r["round"], r["back"], r["ok"]) for r in engine]
    assert [r["kv_mb"] for r in replayed] == pytest.approx([r["kv_mb"] for r in engine])


@pytest.mark.slow  # ~23 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_tiny_arena_on_the_real_models(tmp_path, smol, vlm):
    model, tok = smol
    scale = Scale(context=256, fractions=(4,), ppl_tokens=128, retrieval_rounds=3, retrieval_seeds=1,
                  video_rounds=2, videos=1)
    records = arena(tmp_path, scale, names=["full", "streaming_llm"], model=model, tok=tok, vlm=vlm)
    value = {(r["benchmark"], r["policy"], r["budget"], r["metric"], r["x"]): r["value"] for r in records}
    assert all(set(r) == {"benchmark", "policy", "budget", "metric", "value", "x"} for r in records)
    for benchmark in ("stream_ppl", "retrieval", "video_qa"):
        for policy, budget in (("full", None), ("streaming_llm", 64)):
            for metric, x in (("round_ms", "median"), ("kv_mb", "peak"), ("evict_share", "median")):
                assert (benchmark, policy, budget, metric, x) in value, (benchmark, policy, metric)
        assert value[(benchmark, "full", None, "evict_share", "median")] < 0.01  # nothing to evict
        assert value[(benchmark, "streaming_llm", 64, "kv_mb", "peak")] < value[(benchmark, "full", None, "kv_mb",
                                                                                  "peak")]
        assert value[(benchmark, "full", None, "kv_tokens", "context")] > 64
    # the fractions are the policy's quality over the full cache's, on the same questions
    ppl = value[("stream_ppl", "full", None, "ppl", "stream")] / value[("stream_ppl", "streaming_llm", 64, "ppl",
                                                                        "stream")]
    assert value[("stream_ppl", "streaming_llm", 64, "of_full", "stream")] == pytest.approx(ppl)
    for benchmark in ("retrieval", "video_qa"):
        acc, full = (value[(benchmark, p, b, "accuracy", "all")] for p, b in (("streaming_llm", 64), ("full", None)))
        assert value[(benchmark, "streaming_llm", 64, "of_full", "all")] == pytest.approx(
            fraction_of_full(acc, full), nan_ok=True)  # nan when the full cache got none of its 2-3 right
    assert value[("stream_ppl", "full", None, "kv_tokens", "context")] == 128
    assert (tmp_path / "arena.png").stat().st_size > 0
    settings = json.loads((tmp_path / "arena.settings.json").read_text())
    assert settings["policies"] == ["full", "streaming_llm"] and settings["budgets"] == [64]
    assert not settings["failed"]

    section = arena_section(tmp_path / "arena.json")
    assert "| streaming_llm | 64 |" in section and "| full | full |" in section
    readme = tmp_path / "README.md"
    readme.write_text("# results\n<!-- arena:begin -->\nold\n<!-- arena:end -->\nafter\n")
    write_readme(readme, section)
    text = readme.read_text()
    assert "old" not in text and "| streaming_llm | 64 |" in text and text.endswith("<!-- arena:end -->\nafter\n")
