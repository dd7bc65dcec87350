import json
import os
import subprocess
import sys

import pytest
import torch

from inf_mllm.scoring import window_attention


def dense_reference(q, k, v, scaling):
    """Materialise the whole (Hq, l, n) matrix: the definition the blocked code must match."""
    hq, hkv, l, n = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    logits = (q @ kk.transpose(-1, -2)) * scaling
    q_pos = torch.arange(l) + n - l
    logits = logits.masked_fill(torch.arange(n)[None, :] > q_pos[:, None], float("-inf"))
    probs = logits.softmax(-1)
    return probs @ vv, probs.mean(dim=2)


@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 300, 64), (2, 8, 2, 17, 129, 32), (1, 4, 4, 1, 50, 16)])
@pytest.mark.parametrize("block", [32, 4096])
def test_window_attention_matches_dense(shape, block):
    b, hq, hkv, l, n, d = shape
    torch.manual_seed(1)
    q, k, v = torch.randn(b, hq, l, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    out, scores = window_attention(q, k, v, d**-0.5, block=block)
    ref_out, ref_scores = dense_reference(q, k, v, d**-0.5)
    assert torch.allclose(scores, ref_scores, atol=1e-6)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert torch.allclose(scores.sum(-1), torch.ones(b, hq), atol=1e-5)


TRITON_CHECK = """
import json, sys, torch
from inf_mllm.scoring import window_scores_torch
from inf_mllm.triton_scores import window_scores_triton
b, hq, hkv, l, n, d = json.loads(sys.argv[1])
torch.manual_seed(2)
device = "cuda" if torch.cuda.is_available() else "cpu"
q, k = torch.randn(b, hq, l, d, device=device), torch.randn(b, hkv, n, d, device=device)
print(float((window_scores_triton(q, k, d**-0.5) - window_scores_torch(q, k, d**-0.5)).abs().max()))
"""


@pytest.mark.parametrize("shape", [(1, 9, 3, 37, 150, 64), (2, 4, 1, 5, 70, 48)])
def test_triton_kernel_matches_torch_reference(shape):
    """On CPU the kernel runs under TRITON_INTERPRET=1, which must be set before triton loads."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", TRITON_CHECK, json.dumps(shape)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.strip().splitlines()[-1]) <= 1e-5


def test_the_window_attention_gets_transformers_mask_only_when_it_hides_more_than_causality():
    """A causal mask is built into the window attention (masking its logits twice cost ~5 ms a prompt); padding
    or a sliding window must still reach it."""
    from inf_mllm.attention import _beyond_causality
    from inf_mllm.cache import Forward

    n, l = 50, 8
    causal = (torch.arange(n)[None, :] <= torch.arange(n - l, n)[:, None]).expand(2, 1, l, n)
    mask, forward = causal.clone(), Forward()  # checked once per forward, remembered on it
    assert _beyond_causality(forward, mask, mask) is None
    assert forward.window_mask[0] is mask and _beyond_causality(forward, mask, mask) is None  # remembered
    padded = causal.clone()
    padded[1, :, :, :3] = False  # the second row's first three keys are padding
    assert _beyond_causality(forward, padded, padded) is padded
    sliding = causal & (torch.arange(n)[None, :] > torch.arange(n - l, n)[:, None] - 20)
    assert _beyond_causality(Forward(), sliding, sliding) is sliding
    wider = torch.ones(2, 1, l, n, dtype=torch.bool)  # shows future keys: causality hides them anyway
    assert _beyond_causality(Forward(), wider, wider) is None
