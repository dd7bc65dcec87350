import subprocess
import sys

import numpy as np
import pytest
import torch

from inf_mllm import POLICIES, make_policy
from inf_mllm.policies import LayerView


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
    return W.mean(axis=0), LayerView(n=n, prompt_len=l, num_kv_heads=2, window_scores=scores)


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
    scores = view.window_scores[0, :, : 400 - 32].mean(0)
    want = torch.cat([scores.topk(96).indices.sort().values, torch.arange(368, 400)])
    assert torch.equal(kept, want)
    assert kept[:96].min() < 200  # attention ranking reaches far back, unlike recency


def test_h2o_keeps_heavy_hitters_per_kv_head():
    acc = torch.zeros(1, 2, 100)
    acc[0, 0, 10], acc[0, 1, 20] = 5.0, 5.0
    view = LayerView(n=100, prompt_len=1, num_kv_heads=2, acc_scores=acc)
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


def test_cli_lists_policies():
    out = subprocess.run([sys.executable, "-m", "inf_mllm", "policies"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == list(POLICIES)
    assert {"full", "window", "streaming_llm", "h2o", "inf_mllm"} <= set(POLICIES)
