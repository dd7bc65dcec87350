"""A session as its stream sees it in a pool (`pool.py`): the calls a `StreamSession` takes, every one that touches
the model run on the pool's thread, and the state a front end reads, named here one by one (the protocol between a
stream and its pool: nothing else of the session is reached through it)."""

import torch

from .session import StreamSession
from .text import TextTurns


def _read(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.session, name), doc=doc)


class PooledSession(TextTurns):
    """A session as its stream sees it in a pool: `StreamSession`'s calls, run on the pool's thread (clip turns,
    questions and decode steps batched with the other streams'); its state read from the session itself."""

    model = _read("model", "the model every stream of the pool shares")
    tokenizer = _read("tokenizer", "its tokenizer")
    device = _read("device", "where the model runs")
    batch = _read("batch", "rows per turn (1 in a pool)")
    cache = _read("cache", "the stream's bounded cache")
    store = _read("store", "its span store (None without recall)")
    recall = _read("recall", "its recall settings (None without)")
    seen = _read("seen", "tokens streamed in so far, whatever was evicted")
    turns = _read("turns", "turns appended so far")
    last = _read("last", "the last turn's and answer's timings (`TurnStats`)")
    last_recalled = _read("last_recalled", "what recall linked for the last question")
    exchange = _read("exchange", "the last question and its answer as the cache took them")
    after_answer = _read("after_answer", "whether an answer's last token is held back for the next turn")
    kv_tokens = _read("kv_tokens", "tokens in the cache")
    kv_bytes = _read("kv_bytes", "bytes the cache holds")
    clock = _read("clock", "what turns and answers are timed by")

    def __init__(self, pool, session: StreamSession):
        self.pool, self.session = pool, session

    def append(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
               evict: bool = True, store: bool = True, meta: dict | None = None, vision=None,
               all_logits: bool = False, positions=None, forward_inputs: dict | None = None) -> torch.Tensor:
        """A clip turn (embeddings, evicting, nothing the model takes beside them) is packed with the other streams'
        clip turns; any other turn runs alone."""
        if inputs_embeds is not None and input_ids is None and evict and not all_logits and not forward_inputs \
                and self.session.batch == 1 and inputs_embeds.shape[0] == 1:
            return self.pool.turn(self.session, inputs_embeds, store=store, meta=meta, vision=vision,
                                  positions=positions)
        return self.pool.call(self.session, self.session.append, input_ids, inputs_embeds, evict, store, meta, vision,
                              all_logits, positions, forward_inputs)

    def restore(self, exchanges=()) -> list[int]:
        return self.pool.call(self.session, self.session.restore, exchanges)

    def run(self, fn, *args, **kwargs):
        """Anything else that touches the session's cache (an out-of-memory shrink), on the pool's thread."""
        return self.pool.call(self.session, fn, *args, **kwargs)

    def append_question(self, input_ids: torch.Tensor, probe_ids=None, named=None, oracle=None, keep: bool = True,
                        all_logits: bool = False) -> torch.Tensor:
        if all_logits or self.session.batch != 1:
            return self.pool.call(self.session, self.session.append_question, input_ids, probe_ids, named, oracle,
                                  keep, all_logits)
        return self.pool.question(self.session, input_ids, probe_ids=probe_ids, named=named, oracle=oracle, keep=keep)

    def forget_question(self) -> None:
        self.pool.call(self.session, self.session.forget_question)

    def side_logits(self, questions: list[torch.Tensor]) -> torch.Tensor:
        return self.pool.call(self.session, self.session.side_logits, questions)

    def generate(self, max_new_tokens: int = 64, **kwargs):
        return self.pool.generate(self.session, max_new_tokens, **kwargs)

    def close(self) -> None:
        self.pool.release(self.session)
        self.session.cache.release()
