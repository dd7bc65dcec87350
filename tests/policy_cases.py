"""Fixed random layer views, shared by the kept-index fixture's recorder and its test.

`python -m tests.policy_cases` re-records tests/fixtures/policy_kept_indices.json; it was recorded
from the policies as they were before the scorer/selector refactor, so the test proves the
refactor kept every existing policy's choice bit for bit.
"""

import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "policy_kept_indices.json"

# (policy, options, n, prompt_len, budget, query heads, KV heads)
CASES = [
    ("window", {}, 50, 10, 20, 4, 2),
    ("window", {}, 300, 40, 128, 6, 2),
    ("streaming_llm", {}, 50, 10, 20, 4, 2),
    ("streaming_llm", {"sinks": 1}, 300, 40, 128, 6, 3),
    ("h2o", {}, 60, 8, 20, 4, 2),
    ("h2o", {"recent_ratio": 0.25}, 400, 50, 128, 9, 3),
    ("h2o", {}, 200, 1, 64, 8, 8),
    ("inf_mllm", {"window": 8, "bias": 0.01}, 60, 20, 24, 4, 2),
    ("inf_mllm", {"window": 32, "bias": 0.1}, 400, 64, 128, 9, 3),
    ("inf_mllm", {"window": 64, "bias": 0.0}, 500, 20, 100, 6, 2),
    ("inf_mllm", {"window": 16, "bias": 0.05}, 300, 300, 96, 8, 1),
    ("inf_mllm_plus", {"window": 8}, 60, 20, 24, 4, 2),
    ("inf_mllm_plus", {"window": 32, "bias": 0.5, "pool": 5}, 400, 64, 128, 9, 3),
    ("inf_mllm_plus", {"window": 16, "sinks": 2, "pool": 1}, 300, 10, 64, 6, 6),
    ("inf_mllm_plus", {"window": 64}, 120, 100, 80, 4, 2),
]


def case_view(i: int, n: int, prompt_len: int, hq: int, hkv: int):
    """A LayerView with softmax-shaped window scores and positive accumulated scores, seeded by case index."""
    from inf_mllm.policies import LayerView

    g = torch.Generator().manual_seed(1000 + i)
    window = torch.softmax(torch.randn(1, hq, n, generator=g) * 3, dim=-1)
    acc = torch.rand(1, hkv, n, generator=g) * torch.linspace(3, 1, n)
    return LayerView(n=n, prompt_len=prompt_len, num_kv_heads=hkv, window_scores=window, acc_scores=acc)


def kept(i: int):
    from inf_mllm.policies import make_policy

    name, options, n, prompt_len, budget, hq, hkv = CASES[i]
    idx = make_policy(name, **options).select(case_view(i, n, prompt_len, hq, hkv), budget)
    return idx.tolist()


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps([kept(i) for i in range(len(CASES))], separators=(",", ":")))
    print(f"{FIXTURE}: {FIXTURE.stat().st_size} bytes")
