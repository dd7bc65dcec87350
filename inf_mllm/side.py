"""Side questions packed into one forward: several questions about the cache as it stands (a stream's watches after
a clip), each seeing the cache and its own tokens only, none of them staying in the cache.

Asked one after another, each of 16 watches' questions was a forward of its own (~15 tokens) and a rollback, ~0.19 s
each for tiny-vlm on 2 CPU cores: a clip's ingest cost 4.6x what it costs without watches. Packed, the questions are
one sequence: the tokens they all open with (the chat template's, "is there a") once, then each one's rest, its
positions right after that prefix; a mask keeps each rest to the cache, the prefix and itself, and only each question's
last token reaches the LM head. What is left is arithmetic (matmuls over ~8 tokens a watch). The forward is rolled back
after it, so nothing scores these tokens (what they would record would leave with them): their attention is plain
SDPA, the numbers each question's own prefill gives.
"""

import torch


def why_not_packed(session) -> str | None:
    """Why `session`'s side questions cannot share a forward (None: they can). Multimodal RoPE places a token by more
    than its index; a held-back answer token would open the first question only; recall that links by keys links
    per question."""
    if session.cache.multimodal:
        return "multimodal RoPE"
    if session.batch != 1:
        return "more than one row a turn"
    if session.after_answer:
        return "an answer's last token is held back"
    if session.recall is not None and not session.recall.named:
        return "recall links each question's own matches"
    return None


def groups(lengths: list[int], room: int) -> list[list[int]]:
    """The questions (by index) in runs whose tokens fit in `room` rows (a question longer than that runs alone), so
    the cache's buffers keep their shape."""
    out: list[list[int]] = []
    used = room + 1
    for i, length in enumerate(lengths):
        if not out or used + length > room:
            out.append([])
            used = 0
        out[-1].append(i)
        used += length
    return out


def shared_prefix(questions: list[list[int]]) -> int:
    """How many first tokens every question has in common (the chat template's opening and "is there a"), short of
    each one's last token, which its own logits come from."""
    n = min(len(q) for q in questions) - 1
    for i in range(max(n, 0)):
        if len({q[i] for q in questions}) > 1:
            return i
    return max(n, 0)


def packed(cached: int, questions: list[list[int]], device) -> dict:
    """One forward's arguments for `questions` (token ids) after `cached` positions: their shared prefix once, then
    each one's rest; the keep-mask (1, 1, Q, cached + Q) lets each rest see the cache, the prefix and itself, causally;
    the position ids put each rest right after the prefix, and only each question's last token reaches the LM head."""
    p = shared_prefix(questions)
    rests = [q[p:] for q in questions]
    sizes = torch.tensor([p] + [len(r) for r in rests])
    which = torch.repeat_interleave(torch.arange(len(sizes)), sizes)  # 0: the prefix, j: question j's rest
    offset = torch.cat([torch.arange(n) for n in sizes.tolist()]) + (which > 0) * p
    own = ((which[:, None] == which[None, :]) | (which[None, :] == 0)) & (offset[None, :] <= offset[:, None])
    mask = torch.cat([torch.ones(len(which), cached, dtype=torch.bool), own], dim=1)
    ids = torch.tensor([questions[0][:p] + [t for r in rests for t in r]])
    return {"input_ids": ids.to(device), "attention_mask": mask[None, None].to(device),
            "position_ids": (offset + cached)[None].to(device), "logits_to_keep": (sizes.cumsum(0)[1:] - 1).to(device)}


@torch.inference_mode()
def side_logits(session, questions: list[torch.Tensor]) -> torch.Tensor:
    """Each question's next-token logits, (K, V), as its own prefill on the cache would give them; the cache is left as
    it was. `questions`: (1, L) token ids each."""
    cache, out = session.cache, []
    ids = [q.reshape(-1).tolist() for q in questions]
    for group in groups([len(q) for q in ids], cache.free_rows()):
        inputs = packed(cache.get_seq_length(), [ids[i] for i in group], session.device)
        marks = cache.mark()
        try:
            with cache.forward(inputs["input_ids"].shape[1], batch=1, device=session.device) as fwd:
                fwd.observers = []
                logits = session.model(**inputs, past_key_values=cache, use_cache=True, **fwd.kwargs).logits
        finally:
            cache.rollback(marks)
        out.append(logits[0])
    return torch.cat(out)
