"""A session as its stream sees it in a pool (`pool.py`): what a `StreamSession` answers to, every call that touches
the model run on the pool's thread."""

import torch

from .session import StreamSession


class PooledSession:
    """A session as its stream sees it in a pool: `StreamSession`'s calls, run on the pool's thread (questions
    and decode steps batched with the other streams'); everything else read from the session itself."""

    def __init__(self, pool, session: StreamSession):
        self.pool, self.session = pool, session

    def __getattr__(self, name):
        return getattr(self.session, name)

    def append(self, *args, **kwargs) -> torch.Tensor:
        return self.pool.call(self.session, self.session.append, *args, **kwargs)

    def append_text(self, text: str, **kwargs) -> torch.Tensor:
        return self.pool.call(self.session, self.session.append_text, text, **kwargs)

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

    def generate(self, max_new_tokens: int = 64, **kwargs):
        return self.pool.generate(self.session, max_new_tokens, **kwargs)

    def answer(self, text: str, max_new_tokens: int = 64, **kwargs) -> str:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        self.append_question(ids)
        tokens = [int(t[0]) for t in self.generate(max_new_tokens, **kwargs)]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.pool.release(self.session)
        self.session.cache.release()
