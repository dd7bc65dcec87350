"""One answer in progress, and the records a turn and an exchange leave: the one place a decoded token is applied,
whether a lone session decodes it (`StreamSession.generate`) or the pool's batched step does (`pool.py`).

An answer's life: `begin` takes the logits the last turn left; each token picked from them is `apply`'d (finished
rows emit the filler), then `handed` to the reader (counted, written to the exchange); unless the answer ends there
the token goes through one decode step and `advanced` takes the step's logits. Whenever it ends, `hold_back` keeps
the last token handed, not yet in the cache, for the next turn.
"""

from dataclasses import asdict, dataclass, field

import torch

from .decoding import Phrases, eos_set, pick


@dataclass
class TurnStats:
    prefill_s: float = 0.0
    evict_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0
    recall_s: float = 0.0  # probe forward + scoring + linking, before the question's prefill

    @property
    def tokens_per_s(self) -> float:
        """Decode speed, the one definition (engine, app, benchmarks): the first answer token comes from the
        question's prefill, whose time is the time to first token, so `decoded` tokens took `decoded - 1`
        decode steps. 0.0 when there was none."""
        return (self.decoded - 1) / self.decode_s if self.decoded > 1 and self.decode_s > 0 else 0.0


@dataclass
class Exchange:
    """A question and its answer as the cache took them, so a restart can put them back where they were: the
    question turn's number among the session's turns (a stored clip's span id is its turn number too), its ids
    (without the held-back token of the answer before), the answer's tokens as handed over (the last one held back
    for the next turn), and whether they stay in the cache (keep=False: they leave at the next turn)."""

    turn: int
    question: list[int]
    answer: list[int] = field(default_factory=list)
    kept: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    constraint: Phrases | None = None  # which tokens may come next (batch 1); None: any

    @property
    def plain(self) -> bool:
        """Greedy over the whole vocabulary: a batch of such answers may be picked with one argmax."""
        return not self.do_sample and self.constraint is None

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            return pick(logits, self.do_sample, self.temperature, self.top_p, self.generator)
        token = pick(self.constraint.mask(logits), self.do_sample, self.temperature, self.top_p, self.generator)
        self.constraint.advance(token)
        return token


@dataclass(eq=False)  # one answer is itself only: `in` and `remove` on lists of them
class Answer:
    """`logits`: what the next token comes from (None: the last token handed must go through a step first);
    `token`: the last token handed, not yet in the cache; `done`: the rows that have emitted an end token."""

    session: object  # the StreamSession answering
    max_new_tokens: int
    eos: torch.Tensor
    filler: int  # what finished rows emit while others continue
    sampling: Sampling
    logits: torch.Tensor | None
    done: torch.Tensor
    token: torch.Tensor | None = None
    steps: int = 0

    @classmethod
    def begin(cls, session, max_new_tokens: int, sampling: Sampling, eos_token_id=None, device=None, **more):
        """The answer to the session's last turn, whose logits it takes (they are spent: the next answer never
        continues from a stale state). `device`: where tokens are compared (default the model's)."""
        logits = session.take_logits()
        eos = eos_set(eos_token_id if eos_token_id is not None else session.model.generation_config.eos_token_id)
        device = session.device if device is None else device
        answer = cls(session, max_new_tokens, torch.tensor(sorted(eos), dtype=torch.long, device=device),
                     min(eos, default=0), sampling, logits, torch.zeros(session.batch, dtype=torch.bool, device=device),
                     **more)
        session.last.decode_s, session.last.decoded = 0.0, 0
        return answer

    def apply(self, token: torch.Tensor) -> torch.Tensor:
        """A token picked from `logits`, as it is handed over: rows already done emit the filler."""
        token = torch.where(self.done, token.new_full(token.shape, self.filler), token)
        self.done |= torch.isin(token, self.eos)
        self.logits, self.token = None, token
        return token

    def handed(self, host_token: torch.Tensor, all_done: bool) -> bool:
        """The token reached its reader (`host_token`, on the CPU); whether the answer ends with it."""
        self.steps += 1
        self.session.last.decoded = self.steps
        if self.session.exchange is not None:
            self.session.exchange.answer.append(int(host_token[0]))
        return all_done or self.steps >= self.max_new_tokens

    def advanced(self, logits: torch.Tensor) -> None:
        """The last token handed went through a decode step: it is in the cache, `logits` give the next."""
        self.logits, self.token = logits, None
        self.session.seen += 1
        self.session.cache.step()

    def hold_back(self) -> None:
        """The answer ends: its last token handed (if not in the cache) opens the session's next turn."""
        self.session.hold(None if self.token is None else self.token[:, None].to(self.session.device))
