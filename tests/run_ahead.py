"""The run-ahead check shared by the CPU test (SmolLM2, `test_compiled.py`) and the GPU one (a random small Llama,
`test_cuda.py`): a session whose compiled step is launched before its token is handed over answers as an eager
session does, whether an answer ends at its last token, at an end token or at the consumer's break."""

import torch


def answer(session, eos, stop=None) -> list[int]:
    tokens = []
    for t in session.generate(12, eos_token_id=eos):
        assert t.device.type == "cpu"  # handed over on the host, wherever the model runs
        tokens.append(int(t[0]))
        if len(tokens) == stop:
            break  # the consumer stops: the step launched ahead for this token is dropped
    return tokens


def check_run_ahead(eager, ahead, ids) -> list[list[int]]:
    """Six rounds of 100 tokens and an answer each, then a turn that takes the held-back tokens; only the steps
    of tokens that went on count. The answers, for the caller's own checks."""
    steps, eos, answers = ahead._compiled.steps, [], []
    for r in range(6):
        for session in (eager, ahead):
            session.append(ids[:, 100 * r:100 * (r + 1)])
        stop = 5 if r % 3 == 1 else None
        want = answer(eager, eos, stop)
        assert answer(ahead, eos, stop) == want, r
        answers.append(want)
        eos = eos or want[3:]  # later answers may end at any of these tokens
    assert ahead._compiled.steps - steps == sum(len(a) - 1 for a in answers)
    for session in (eager, ahead):
        session.append(ids[:, 600:610])  # takes the held-back tokens
    assert ahead.seen == eager.seen and ahead.cache.get_seq_length() == eager.cache.get_seq_length()
    for mine, theirs in zip(ahead.cache.layers, eager.cache.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-3) and torch.allclose(mine.values, theirs.values,
                                                                                     atol=1e-3)
    return answers
