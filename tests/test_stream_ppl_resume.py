"""A stopped stream_ppl run resumed from its checkpoint gives the numbers of an unbroken run."""

import io

import pytest
import torch
from tqdm import tqdm

from benchmarks.corpus import token_stream
from benchmarks.stream_ppl import stream


@pytest.mark.slow  # ~25 s on 2 cores: run by `make test-slow` in CI
def test_resumed_stream_matches_an_unbroken_one(smol):
    model, tok = smol
    ids = token_stream(tok, 2048)
    cfg = {"window": 32, "bias": 0.01}
    with tqdm(disable=True) as bar:
        unbroken = []
        for end, ppl, kv, _, state in stream(model, tok, ids, "inf_mllm", 256, cfg, 512, bar):
            unbroken.append((end, ppl, kv))
            if end == 1024:  # what the checkpoint file would hold, taken before the run goes on
                buffer = io.BytesIO()
                torch.save(state, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        resumed = [(end, ppl, kv) for end, ppl, kv, _, _ in stream(model, tok, ids, "inf_mllm", 256, cfg, 512, bar,
                                                                   saved)]
    assert [e for e, _, _ in resumed] == [1536, 2048]
    for (e1, p1, k1), (e2, p2, k2) in zip(unbroken[2:], resumed, strict=True):
        assert (e1, k1) == (e2, k2) and abs(p1 - p2) < 1e-6 * p1
