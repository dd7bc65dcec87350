"""The benchmark harness (benchmarks/common.py) against hand-computed cases."""

import dataclasses
import math
from types import SimpleNamespace

import pytest

from benchmarks import common
from benchmarks.common import (
    Plan,
    RoundTimer,
    clip_to_context,
    config_for,
    evict_share,
    fraction_of_full,
    plans,
    policy_configs,
    policy_names,
    tokens_per_s,
)
from inf_mllm.policies import make_policy, window_cap
from inf_mllm.spec import PolicySpec


def test_plans_run_the_full_cache_once_clipped_at_the_context_then_each_policy_per_budget():
    got = plans(["full", "window", "inf_mllm"], [128, 512], length=4096, context=2048)
    assert [(p.policy, p.budget, p.length) for p in got] == [
        ("full", None, 2048), ("window", 128, 4096), ("inf_mllm", 128, 4096), ("window", 512, 4096),
        ("inf_mllm", 512, 4096)]
    assert got[0].cfg == {} and got[1].cfg == {}
    assert got[2].cfg == {"window": 32}  # window capped at a quarter of the budget
    assert got[4].cfg == {}  # the defaults (window 64 fits)
    assert [p.policy for p in plans(["window", "inf_mllm"], [128])] == ["window", "inf_mllm"]  # no full asked
    assert [p.policy for p in plans(["full", "window"], [128], full=False)] == ["window"]
    assert plans(["full"], [128])[0].length is None  # no length: nothing to clip
    assert Plan("h2o", 64).key == ("h2o", 64)


def test_clip_to_context():
    assert clip_to_context(4096, 2048) == 2048
    assert clip_to_context(1024, 8192) == 1024
    assert clip_to_context(8192, 8192, reserve=5 * (32 + 16)) == 7952  # latency: room for its question rounds
    assert clip_to_context(65536, None) == 65536


def test_evict_share():
    assert evict_share(0.10, 0.05, 1.0) == pytest.approx(0.15)
    assert evict_share(0.0, 0.0, 0.25) == 0.0
    assert math.isnan(evict_share(0.1, 0.0, 0.0))


def test_tokens_per_s_counts_decode_steps_only():
    # 5 tokens: the first from the question's prefill, 4 from decode steps taking 2 s
    assert tokens_per_s(5, 2.0) == pytest.approx(2.0)
    assert tokens_per_s(17, 0.4) == pytest.approx(40.0)
    assert tokens_per_s(1, 0.3) == 0.0  # the prefill's token alone: no decode step
    assert tokens_per_s(0, 0.0) == 0.0


def test_fraction_of_full():
    assert fraction_of_full(0.9, 1.0) == pytest.approx(0.9)
    assert fraction_of_full(0.5, 0.4) == pytest.approx(1.25)  # a policy may beat the full cache
    assert fraction_of_full(80.0, 76.0, lower_is_better=True) == pytest.approx(0.95)  # perplexity: full / policy
    assert math.isnan(fraction_of_full(0.3, 0.0))


class _Timing:
    def __init__(self, pops):
        self.pops = list(pops)

    def pop(self):
        return self.pops.pop(0)


def test_round_timer_takes_the_probe_out():
    clock = iter([10.0, 10.5, 11.0, 11.0])
    # pops: before the round (discarded), after the turn (score 0.05 s, probe 0.1 s), after decoding (probe 0.2 s)
    session = SimpleNamespace(cache=SimpleNamespace(timing=_Timing([(9.0, 9.0), (0.05, 0.1), (0.0, 0.2)])),
                              last=SimpleNamespace(evict_s=0.02))
    timer = RoundTimer(session, clock=lambda: next(clock))  # t0 = 10.0
    assert timer.turn() == pytest.approx(0.4)  # at 10.5, less the 0.1 s probe
    assert timer.lap() == pytest.approx(0.7)  # at 11.0, less both probes
    assert timer.lap_probe_s == pytest.approx(0.2)  # the decode's own probe (latency's decode time)
    assert timer.share(0.7) == pytest.approx((0.02 + 0.05) / 0.7)


def test_policy_list_comes_from_the_registry():
    from inf_mllm import policies

    names = policy_names()
    assert names[:len(policies.POLICIES)] == list(policies.POLICIES)
    assert set(policies.COMBINATIONS) <= set(names)
    assert policy_names(recall=True)[-len(common.RECALL_POLICIES):] == list(common.RECALL_POLICIES)
    assert policy_names(["inf_mllm", "full", "inf_mllm+typo"]) == ["full", "inf_mllm", "inf_mllm+typo"]


def _built(policy: str, cfg: dict) -> tuple:
    """What a policy string with these options really runs: every field of its scorer and allocator."""
    built = make_policy(policy.split("+recall")[0], **cfg)
    return dataclasses.asdict(built), dataclasses.asdict(built.allocator), built.reducer


def test_existing_configurations_are_unchanged():
    """The committed results were made with these options, written out until the table kept only what
    differs from the defaults (none did); the policies built from the harness's options must be the same."""
    old = {"full": {}, "window": {}, "streaming_llm": {"sinks": 4}, "h2o": {"recent_ratio": 0.5},
           "inf_mllm": {"window": 64, "bias": 0.01}, "inf_mllm_plus": {"window": 64, "bias": 1.0}}
    for budget in (128, 256, 1024):
        got = policy_configs(None, budget, recall=True)
        for policy, cfg in got.items():
            before = dict(old.get(policy, old.get(policy.partition("+")[0], {})))
            if "window" in before:  # the old cap, on the policies that had a window in the table
                before["window"] = min(before["window"], budget // 4)
            if policy.partition("+")[0] not in ("snapkv", "vl_cache") or budget >= 256:  # below: the new cap
                assert _built(policy, cfg) == _built(policy, before), (policy, budget)
    assert config_for("inf_mllm", 128) == {"window": 32} and config_for("inf_mllm+recall_oracle", 512) == {}


def test_the_window_cap_applies_to_every_policy_with_a_window():
    """A quarter of the budget at most, whether the window is the policy's default or set; policies without
    a window get none."""
    assert config_for("vl_cache", 128) == {"window": 32} and config_for("vl_cache+merge", 256) == {}
    assert config_for("snapkv", 64) == {"window": 16} and config_for("snapkv+vl_cache_budgets", 128) == {}
    assert config_for("inf_mllm_plus", 100) == {"window": 25}
    assert config_for("h2o", 16) == {} and config_for("streaming_llm", 8) == {} and config_for("full", 8) == {}
    assert config_for("inf_mllm", None) == {} and config_for("not_a_policy", 8) == {}
    assert window_cap("snapkv", 100) == {"window": 25} and window_cap("snapkv", 128) == {}
    assert window_cap("inf_mllm+recall", 128) == {"window": 32} and window_cap("elastic", 8) == {}
    assert window_cap(PolicySpec.parse("inf_mllm", window=8), 64) == {}  # a window given within the budget stays


def test_plot_draws_marks_for_a_summary_metric(tmp_path):
    """video_qa's plot: per-round curves, summary records left out, the capped cache's OOM round as a line."""
    records = [common.record("video_qa", p, 512, "kv_mb", v * k, k)
               for p, v in (("full_capped", 2.0), ("inf_mllm", 1.0)) for k in range(1, 6)]
    records += [common.record("video_qa", "full_capped", 512, "oom_round", 4, 5),
                common.record("video_qa", "inf_mllm", 512, "kv_mb", 3.0, "5r all rounds")]
    path = tmp_path / "plot.png"
    common.plot(path, "video_qa", records, ["kv_mb"], x_label="round", vlines={"oom_round": "out of memory"})
    assert path.stat().st_size > 0


def test_video_qa_tables_are_read_from_its_records(tmp_path):
    """The README's video_qa tables come from video_qa.json: two policies over a 3-round and a 20-round
    video, summarised by `summarize` as the benchmark does, and each cell checked by hand."""
    import json

    from benchmarks.report import video_qa_section, write_readme
    from benchmarks.video_qa import summarize

    def video(rounds, ok, evicted=False, oom=None):
        rows = [{"round": k, "ok": ok(k), "back": 0 if k % 2 else 10, "ttft_s": 0.1 * k, "kv_mb": 1.0 + k,
                 "rss_mb": 100.0 + k, "evicted": evicted and k % 2 == 0, "recalled": k % 4 == 0}
                for k in range(1, (oom or rounds + 1))]
        tele = SimpleNamespace(ingest_s=1.0, ingest_speed=4.0, video_s=2.0 * rounds)
        return rows, oom, tele, None

    records = []
    for policy, evicted, oom in (("inf_mllm", False, None), ("full_capped", False, 12),
                                 ("inf_mllm+recall", True, None)):
        records += summarize(policy, 64, 3, [video(3, lambda k: True)], False)
        records += summarize(policy, 64, 20, [video(20, lambda k: k > 10, evicted, oom)], True)
    (tmp_path / "video_qa.json").write_text(json.dumps(records))
    section = video_qa_section(tmp_path / "video_qa.json")
    accuracy, times = section.split("Time to first token")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in accuracy.splitlines() if line.startswith("| ")}
    # accuracy: 3 rounds all right; 20 rounds right from round 11 (10 of 20); back 0 (odd rounds): 5 of 10 right
    assert rows["inf_mllm"][1:6] == ["1.000", "0.500", "0.50", "-", "0.50"]  # odd rounds back 0, even 10 back
    assert rows["inf_mllm"][-2:] == ["–", "4.0 |"]  # no OOM, ingest 4× real time
    assert rows["full_capped"][2:4] == ["0.091", "0.17"] and rows["full_capped"][-2] == "12"  # 1 of 11 right
    assert rows["inf_mllm+recall"][8:10] == ["0.500", "0.50"]  # even rounds evicted: 5 of 10 right, 5 of 10 linked
    # time table: rounds 1-10 median 0.55 s, rounds 11-20 median 1.55 s, ratio 2.82; KV at round 10 → 20
    times = next(line for line in times.splitlines() if line.startswith("| inf_mllm |")).split(" | ")
    assert times[1:8] == ["0.300", "0.550", "1.550", "2.82", "2.000", "1.050", "11.0 → 21.0"]
    assert "11.0 → 12.0 (round 11)" in section  # the capped cache stopped at its out-of-memory round
    assert "Orin demo protocol" not in section  # no video_qa_orin.json beside it
    orin = [common.record("video_qa_orin", "inf_mllm", 64, m, v * k, k / 2) for k in range(1, 9)
            for m, v in (("kv_mb", 1.0), ("kv_tokens", 10), ("rss_mb", 100.0), ("ttft_s", 0.1))]
    (tmp_path / "video_qa_orin.json").write_text(json.dumps(orin + [
        common.record("video_qa_orin", "inf_mllm", 64, "ingest_speed", 19.0, "4 min")]))
    section = video_qa_section(tmp_path / "video_qa.json")  # medians of questions 1-5 and 4-8: 0.3 → 0.6 s
    assert "| inf_mllm | 8.0 MB at 4 min | 80 | 100 → 800 MB | 0.300 → 0.600 s | 19.0 |" in section
    readme = tmp_path / "README.md"
    readme.write_text("<!-- video_qa:begin -->\nold\n<!-- video_qa:end -->\n")
    write_readme(readme, section, "video_qa")
    assert "old" not in readme.read_text() and "| inf_mllm+recall |" in readme.read_text()
