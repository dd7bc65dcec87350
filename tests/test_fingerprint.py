"""Every policy path still does what the committed fingerprints say (benchmarks/fingerprint.py): the last logits
of every turn, the KV lengths and tokens seen, every answer's tokens, what recall linked, and `stream-qa`'s answers
on the bundled clip, on the real SmolLM2, a tiny random Qwen2-VL and the real tiny-vlm.

The record was made on one machine (a 2-core AMD EPYC); another CPU rounds differently, so logits are compared within
2e-3 and an answer's tokens only where its first step is no near tie (`compare`'s tolerance). On a 2-core Intel Xeon
with AMX the merge paths' logits came 1.15e-3 (`inf_mllm+vl_cache_budgets+merge`) and at most 5.2e-4 (the other 309
steps) from the record, every top-5 id the same; a changed path moves them by tenths or more. Bit-identity before
and after a change is what `python -m benchmarks fingerprint --old-tree DIR` checks, on one machine, in one run."""

import json
from pathlib import Path

import pytest

from benchmarks.fingerprint import compare, fingerprints

RECORD = Path(__file__).parent.parent / "benchmarks" / "results" / "fingerprint.json"


@pytest.mark.slow  # every policy on three models and two stream-qa runs: ~2 min on 2 cores
def test_every_policy_path_keeps_its_committed_fingerprint():
    recorded = json.loads(RECORD.read_text())["fingerprints"]
    now = fingerprints(log=lambda text: None)
    differences = compare(now, recorded, tolerance=2e-3)
    assert not differences, "\n".join(differences[:40])
    steps = sum(len(path) for path in now.values())
    assert len(now) == len(recorded) >= 30 and steps == sum(len(path) for path in recorded.values()) >= 350


def test_compare_tells_a_changed_answer_from_a_rounding():
    step = {"step": "answer", "tokens": [5, 6], "first_margin": 0.5, "kv_tokens": 24,
            "logits": {"sha": "a", "top": [[1, 2.0], [2, 1.0]], "finite": True}}
    rounded = {**step, "logits": {"sha": "b", "top": [[1, 2.0004], [2, 1.0]], "finite": True}}
    changed = {**step, "tokens": [5, 7]}
    assert compare({"p": [step]}, {"p": [rounded]}, tolerance=1e-3) == []
    assert compare({"p": [step]}, {"p": [rounded]}) != []  # without a tolerance: bytes
    assert compare({"p": [step]}, {"p": [changed]}, tolerance=1e-3) == ["p / answer: tokens: [5, 6] vs [5, 7]"]
    tie = {**changed, "first_margin": 1e-5}
    assert compare({"p": [tie]}, {"p": [step]}, tolerance=1e-3) == []  # a near tie may go either way
