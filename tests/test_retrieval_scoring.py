"""The retrieval benchmark scores answers by teacher forcing: it must agree with greedy decoding."""

import torch

from benchmarks.retrieval import answered
from benchmarks.retrieval import token_ids as ids
from inf_mllm import StreamSession

LINES = "river: 417\nstone: 802\nlight: 356\nhouse: 129\n"


def test_teacher_forced_answer_agrees_with_greedy_decoding(smol):
    model, tok = smol
    question, after = ids(tok, "stone:"), ids(tok, "\n")
    decoder = StreamSession(model, tok, "full")
    decoder.append_text(LINES)
    decoder.append(question)
    greedy = torch.stack([t for t in decoder.generate(4, eos_token_id=[])], dim=1)  # (1, 4)
    wrong = greedy.clone()
    wrong[0, -1] = (wrong[0, -1] + 1) % model.config.vocab_size
    for answer, expected in ((greedy, True), (wrong, False)):
        session = StreamSession(model, tok, "full")
        session.append_text(LINES)
        before = session.seen
        assert answered(session, question, answer, after) is expected
        # the stream holds exactly question, answer and what follows: nothing decoded is left behind
        assert session.seen == before + question.shape[1] + answer.shape[1] + after.shape[1]
