import subprocess
import sys

import numpy as np
import pytest
import torch

from inf_mllm import POLICIES, make_policy
from inf_mllm.calibrate import save
from inf_mllm.observers import PostVisionObserver, threshold_sparsity
from inf_mllm.policies import COMBINATIONS, LayerView
from inf_mllm.policies.base import pooled
from inf_mllm.policies.priority import priority_curve, resample_curve, search_retention
from inf_mllm.rope import rerotate
from inf_mllm.spec import ALLOCATORS, SCORERS, PolicySpec, Recall


def algorithm1_numpy(W, l, r, b):
    """Inf-MLLM Algorithm 1 transcribed line by line; W is (m, n) attention of one layer."""
    m, n = W.shape
    S = W[m - l:m, 0:n - l].sum(axis=0) / l
    d = b / (n - l)
    D = -np.arange(n - l - 1, -1, -1) * d
    I_r = np.argsort(-(S + D), kind="stable")[:r]
    I_l = np.arange(n - l, n)
    return np.sort(np.concatenate([I_r, I_l]))


def random_view(n, l, hq=6, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(hq, l, n)) * 3
    W = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)  # rows of softmax attention
    scores = torch.tensor(W.mean(axis=1), dtype=torch.float32)[None]  # (1, Hq, n): mean over window queries
    return W.mean(axis=0), LayerView(n=n, prompt_len=l, num_kv_heads=2, stats={"window": scores})


@pytest.mark.parametrize("bias", [0.0, 0.01, 0.1])
@pytest.mark.parametrize("n,l,budget", [(300, 32, 100), (130, 64, 64), (1000, 50, 512)])
def test_inf_mllm_keeps_algorithm1_indices(n, l, budget, bias):
    W, view = random_view(n, l, seed=n + l)
    got = make_policy("inf_mllm", window=l, bias=bias).select(view, budget)[0].numpy()
    want = algorithm1_numpy(W, l, budget - l, bias)
    assert np.array_equal(got, want)


def test_large_bias_reduces_inf_mllm_to_recency():
    _, view = random_view(400, 32, seed=3)
    kept = make_policy("inf_mllm", window=32, bias=1e6).select(view, 128)[0]
    assert torch.equal(kept, torch.arange(400 - 128, 400))


def test_zero_bias_is_pure_attention_ranking():
    _, view = random_view(400, 32, seed=4)
    kept = make_policy("inf_mllm", window=32, bias=0.0).select(view, 128)[0]
    scores = view.stat("window")[0, :, : 400 - 32].mean(0)
    want = torch.cat([scores.topk(96).indices.sort().values, torch.arange(368, 400)])
    assert torch.equal(kept, want)
    assert kept[:96].min() < 200  # attention ranking reaches far back, unlike recency


def test_h2o_keeps_heavy_hitters_per_kv_head():
    acc = torch.zeros(1, 2, 100)
    acc[0, 0, 10], acc[0, 1, 20] = 5.0, 5.0
    view = LayerView(n=100, prompt_len=1, num_kv_heads=2, stats={"acc": acc})
    kept = make_policy("h2o").select(view, 10)
    assert kept.shape == (1, 2, 10)
    assert 10 in kept[0, 0] and 20 in kept[0, 1] and 20 not in kept[0, 0]
    assert torch.equal(kept[0, 0, -5:], torch.arange(95, 100))


@pytest.mark.parametrize(
    "name,kwargs,budget,match",
    [
        ("inf_mllm", {"window": 64}, 32, "smaller than"),
        ("inf_mllm", {"bias": -0.1}, 256, "bias"),
        ("streaming_llm", {}, 4, "sink"),
    ],
)
def test_bad_configurations_raise_value_error(name, kwargs, budget, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, **kwargs).check(budget)


def test_unknown_policy_and_option_raise_value_error():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru")
    with pytest.raises(ValueError, match="no option"):
        make_policy("window", bias=0.1)


def test_cli_lists_policies_and_the_tested_combinations():
    out = subprocess.run([sys.executable, "-m", "inf_mllm", "policies"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [*POLICIES, *COMBINATIONS]
    seeds = {"full", "window", "streaming_llm", "h2o", "inf_mllm", "snapkv", "elastic", "prefixkv", "vl_cache"}
    assert seeds <= set(POLICIES)
    assert "inf_mllm+vl_cache_budgets+merge" in COMBINATIONS


@pytest.mark.parametrize("name", list(POLICIES))
def test_selecting_every_layer_at_once_keeps_what_each_layer_alone_keeps(name):
    """`select_layers` (scoring policies rank a stack of same-shaped layers in one go) = `select` per layer: 30
    layers of one length and budget, then lengths that differ (one by one), both with tied scores too."""
    policy = make_policy(name)
    g = torch.Generator().manual_seed(0)

    def view(n, prompt_len=40):
        scores = torch.rand(1, 6, n, generator=g)
        scores[..., ::7] = 0.5  # ties
        return LayerView(n=n, prompt_len=prompt_len, num_kv_heads=2, stats={
            "window": scores, "acc": scores[:, ::3].clone() * 10, "post": scores.clone(),
            "sparsity": torch.rand(1, 6, generator=g)})

    for views in ([view(300) for _ in range(30)], [view(300 + 5 * i) for i in range(6)] + [view(90)]):
        budgets = [128] * len(views)
        want = [policy.select(v, b) if v.n > b else None for v, b in zip(views, budgets, strict=True)]
        got = policy.select_layers(views, budgets)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    assert got[-1] is None  # the layer under its budget


def test_window_keeps_the_newest_tokens():
    view = LayerView(n=10, prompt_len=3, num_kv_heads=1)
    assert make_policy("window").select(view, 4).tolist() == [[6, 7, 8, 9]]


def test_streaming_llm_keeps_sinks_and_the_newest_tokens():
    view = LayerView(n=10, prompt_len=3, num_kv_heads=1)
    assert make_policy("streaming_llm", sinks=2).select(view, 5).tolist() == [[0, 1, 7, 8, 9]]


def test_inf_mllm_plus_keeps_sinks_recent_and_each_kv_heads_own_best():
    kv0 = [0.05, 0.01, 0.30, 0.02, 0.20, 0.03, 0.04, 0.06]
    kv1 = [0.01, 0.02, 0.03, 0.40, 0.04, 0.05, 0.35, 0.06]
    rows = [kv0 + [0.1, 0.1], kv0 + [0.1, 0.1], kv1 + [0.1, 0.1], kv1 + [0.1, 0.1]]  # 4 query heads, 2 KV heads
    view = LayerView(n=10, prompt_len=2, num_kv_heads=2, stats={"window": torch.tensor([rows])})
    plus = make_policy("inf_mllm_plus", window=2, sinks=1, pool=1, bias=0.0)
    assert plus.select(view, 5).tolist() == [[[0, 2, 4, 8, 9], [0, 3, 6, 8, 9]]]
    # a large relative bias: recency decides, the sink stays
    recency = make_policy("inf_mllm_plus", window=2, sinks=1, pool=1, bias=100.0)
    assert recency.select(view, 5).tolist() == [[[0, 6, 7, 8, 9], [0, 6, 7, 8, 9]]]


# --- the protocol ------------------------------------------------------------------------------------


def test_the_catalogue_names_each_class_by_its_own_name():
    """The spec's catalogue is the one list of names: each entry's class carries the name it is listed under."""
    from inf_mllm.policies import ALLOCATORS as allocator_classes

    assert [cls.name for cls in POLICIES.values()] == list(SCORERS)
    assert [cls.name for cls in allocator_classes.values()] == list(ALLOCATORS)
    assert POLICIES["window"].__name__ == "Window"


@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "h2o", "elastic", "prefixkv"])
def test_policies_without_a_window_refuse_the_option(name):
    with pytest.raises(ValueError, match=f"policy '{name}' takes no option window"):
        make_policy(name, window=8)


def test_policy_strings_compose_scorer_allocator_and_reducer():
    p = make_policy("inf_mllm+vl_cache_budgets+merge", window=16, p=0.05)
    assert (p.name, p.window, p.reducer, type(p.allocator).__name__, p.allocator.p) == (
        "inf_mllm+vl_cache_budgets+merge", 16, "merge", "VLCacheBudgets", 0.05)
    assert {obs.key for obs in p.all_observers()} == {"window", "post"}
    assert make_policy("elastic").reducer == "merge" and make_policy("elastic+evict").reducer == "evict"
    assert type(make_policy("prefixkv").allocator).__name__ == "PrefixKVBudgets"
    for bad in ("inf_mllm+merge+vl_cache_budgets", "inf_mllm+blend", "inf_mllm+merge+merge"):
        with pytest.raises(ValueError, match="unknown or misplaced"):
            make_policy(bad)
    spec = PolicySpec.parse("inf_mllm+vl_cache_budgets+merge+recall")
    assert (spec.policy_name, spec.recall) == ("inf_mllm+vl_cache_budgets+merge", Recall())
    assert spec.name == "inf_mllm+vl_cache_budgets+merge+recall" and str(PolicySpec.parse(spec.name)) == spec.name
    assert PolicySpec.parse("inf_mllm+recall_oracle").recall.mode == "oracle"
    assert PolicySpec.parse("inf_mllm+recall_keys").recall.named is False
    for bad in ("inf_mllm+recal", "inf_mllm+recall+merge", "inf_mllm+recall+recall"):
        with pytest.raises(ValueError, match="unknown or misplaced"):
            PolicySpec.parse(bad)


def test_policy_spec_parses_without_torch():
    """The command line checks --policy and --budget with the real grammars before torch loads."""
    code = ("import sys; from inf_mllm.spec import PolicySpec, parse_budget; "
            "s = PolicySpec.parse('snapkv+vl_cache_budgets+recall'); "
            "print(s.name, parse_budget('2GiB'), parse_budget('AUTO'), parse_budget('64'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["snapkv+vl_cache_budgets+recall", "2GiB", "auto", "64", "False"]


@pytest.mark.parametrize("bad", ["0", "-3", "12 tokens", "0MB", "lots", ""])
def test_bad_budgets_are_refused_in_one_line(bad):
    from inf_mllm.spec import parse_budget

    with pytest.raises(ValueError, match="budget"):
        parse_budget(bad)


def test_a_spec_refuses_unknown_parts_on_construction():
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        PolicySpec("lru")
    with pytest.raises(ValueError, match="unknown budget allocator"):
        PolicySpec("inf_mllm", allocator="merge")
    with pytest.raises(ValueError, match="unknown reducer"):
        PolicySpec("inf_mllm", reducer="blend")


# --- each seed method's core step on a hand-computed case --------------------------------------------


def test_snapkv_pooling_prefers_a_cluster_over_a_lone_peak():
    s = [0, 0.2, 0.2, 0.2, 0.2, 0.2, 0, 0, 0, 0, 0, 0.9, 0, 0]  # 14 candidates, then the 2-token window
    view = LayerView(n=16, prompt_len=2, num_kv_heads=1, stats={"window": torch.tensor([[s + [0.5, 0.5]]])})
    # average pooling, kernel 5, zero padding: index 3 -> 1.0 / 5 = 0.2; around the lone peak 0.9 / 5 = 0.18
    assert make_policy("snapkv", window=2).select(view, 3).tolist() == [[[3, 14, 15]]]
    assert make_policy("snapkv", window=2, pool=1).select(view, 3).tolist() == [[[11, 14, 15]]]
    assert torch.allclose(pooled(torch.tensor([[0.0, 0, 1, 0, 0, 0]]), 5, "avg"),
                          torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2, 0.0]]))


def test_threshold_filter_sparsity_by_hand():
    # d = 1, scale 1: logits are q * k. Query 0 (position 1) sees keys 0..1 (logits 0, 1): nothing under
    # max + ln(0.01); query 1 sees 0..2 (logits 0, 1, 10): two of three under. 2 zeros of 5 entries.
    q = torch.ones(1, 1, 2, 1)
    k = torch.tensor([0.0, 1.0, 10.0]).reshape(1, 1, 3, 1)
    assert threshold_sparsity(q, k, 1.0, 0.01).tolist() == [[pytest.approx(0.4)]]
    assert threshold_sparsity(q, k, 1.0, 0.5).tolist() == [[pytest.approx(0.6)]]  # q0: 0 < 1 + ln .5 too


def test_vl_cache_budgets_follow_algorithm_1():
    views = [LayerView(n=100, prompt_len=10, num_kv_heads=1, stats={"sparsity": torch.tensor([[g, g]])})
             for g in (0.2, 0.6)]
    policy = make_policy("vl_cache")
    # density 0.8, 0.4; Z = 1.2; alpha L = 60 / 200 * 2 = 0.6 -> beta 0.4, 0.2 of 100 tokens
    assert policy.allocator.allocate(policy, views, [30, 30]) == [40, 20]
    views[0].stats["sparsity"], views[1].stats["sparsity"] = torch.tensor([[0.0]]), torch.tensor([[0.999]])
    # beta_1 clips to 0.01 (1 token); the total stays 60
    assert policy.allocator.allocate(policy, views, [30, 30]) == [59, 1]


def test_post_vision_queries_are_the_text_after_the_last_visual_token():
    from inf_mllm.cache import Forward

    obs = PostVisionObserver(window=8)
    assert obs.queries(Forward(vision_end=30, vision_seen=True), 40) == 10  # a clip turn: the text after its frames
    assert obs.queries(Forward(vision_seen=True), 12) == 12  # a question after clips: all of it is post-vision
    assert obs.queries(Forward(), 40) == 8  # no vision known: the window fallback
    assert obs.queries(Forward(decoding=True), 40) == 0


def test_prefixkv_binary_search_by_hand():
    assert torch.allclose(priority_curve(torch.tensor([2.0, 6.0, 2.0])), torch.tensor([0.6, 0.8, 1.0]).double())
    curves = [torch.tensor([0.5, 0.8, 1.0]).double(), torch.tensor([0.25, 0.5, 0.75, 1.0]).double()]
    # p = 0.5 gives 1 + 2 = 3 tokens; p = 0.75 gives 2 + 3 = 5: the target, found on the second step
    assert search_retention(curves, 5) == (0.75, [2, 3])
    # 4 is reachable by no p: the largest p under it (just at 0.5) keeps 3
    p, counts = search_retention(curves, 4)
    assert counts == [1, 2] and p == pytest.approx(0.5)
    views = [LayerView(n=3, prompt_len=1, num_kv_heads=1, stats={"acc": torch.tensor([[[0.5, 0.3, 0.2]]])}),
             LayerView(n=4, prompt_len=1, num_kv_heads=1, stats={"acc": torch.full((1, 1, 4), 0.25)})]
    policy = make_policy("prefixkv")
    assert policy.allocator.allocate(policy, views, [2, 3]) == [2, 3]


def test_prefixkv_calibrated_budgets_come_from_the_file(tmp_path):
    path = tmp_path / "calib.json"
    # layer 0 concentrated (half the importance in 10% of tokens), layer 1 uniform
    save(path, [resample_curve(torch.tensor([0.5] + [0.5 / 9] * 9).cumsum(0).double(), 11).tolist(),
                [i / 10 for i in range(11)]], {"test": True})
    policy = make_policy("prefixkv", calibration=str(path))
    views = [LayerView(n=100, prompt_len=1, num_kv_heads=1) for _ in range(2)]
    got = policy.allocator.allocate(policy, views, [50, 50])
    assert sum(got) <= 100 and got[0] < got[1]  # the dispersed layer gets more
    with pytest.raises(ValueError, match="cannot read"):
        make_policy("prefixkv", calibration=str(tmp_path / "missing.json"))


def test_elastic_fixed_point_elimination_drops_at_the_truncation_point():
    view = LayerView(n=10, prompt_len=1, num_kv_heads=1)
    kept = make_policy("elastic", truncation=3).decode_select(view, 8)
    assert kept.tolist() == [[0, 1, 2, 3, 4, 7, 8, 9]]  # the first tokens and the 3 newest stay
    assert make_policy("elastic").decode_select(view, 10) is None


def _one_layer(keys, values, inv_freq):
    from inf_mllm.cache import StreamingCache

    cache = StreamingCache(make_policy("elastic"), [2], inv_freq, 1)
    layer = cache.layers[0]
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def test_merge_averages_each_bucket_into_its_anchor():
    # anchors 1 and 5: the boundary is floor((1 + 5) / 2) = 3, so tokens 0-3 form bucket 0 and 4-6 bucket 1
    v = torch.arange(7.0).reshape(1, 1, 7, 1).expand(1, 2, 7, 2).contiguous()
    layer = _one_layer(v.clone(), v.clone(), torch.zeros(1))  # no rotation: plain means
    layer.merge(torch.tensor([[1, 5]]), start=0)
    assert layer.values[0, 0, :, 0].tolist() == [1.5, 5.0] and layer.keys[0, 1, :, 1].tolist() == [1.5, 5.0]


def test_merge_rotates_members_to_the_bucket_position():
    """Keys are cached after RoPE: identical content at positions 0..5 merges to that content at the
    bucket's new position, not to a blur of rotations."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    u = torch.randn(1, 1, 1, 8)
    keys = rerotate(u.expand(1, 1, 6, 8), torch.arange(6).reshape(1, 1, 6), inv_freq)  # u at positions 0..5
    layer = _one_layer(keys, torch.randn(1, 1, 6, 8), inv_freq)
    layer.merge(torch.tensor([[2, 4]]), start=0)  # buckets {0..3} -> position 0, {4, 5} -> position 1
    want = rerotate(u.expand(1, 1, 2, 8), torch.arange(2).reshape(1, 1, 2), inv_freq)
    assert torch.allclose(layer.keys, want, atol=1e-5)


def test_merge_with_every_token_an_anchor_changes_nothing():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    layer = _one_layer(keys.clone(), values.clone(), inv_freq)
    layer.merge(torch.arange(5)[None], start=0)
    assert torch.allclose(layer.keys, keys, atol=1e-6) and torch.equal(layer.values, values)
