"""What a decode loop does around each model step (session.py): pick the next token, and hand it to the consumer.
"""

import functools
from dataclasses import dataclass

import torch


class HandOver:
    """How each answer token reaches the consumer. From a GPU it goes through pinned host memory with the rows'
    end flags, and only that copy is waited for, so a step queued after it (run ahead) keeps the GPU busy; on a
    CPU the token is there already."""

    def __init__(self, device: torch.device, batch: int):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((2, batch), dtype=torch.long, pin_memory=True)
            self.ready = torch.cuda.Event()

    def send(self, token: torch.Tensor, done: torch.Tensor) -> None:
        self.token, self.done = token, done
        if self.cuda:
            self.host[0].copy_(token, non_blocking=True)
            self.host[1].copy_(done, non_blocking=True)
            self.ready.record(torch.cuda.current_stream(self.device))  # the model's GPU, not the current one

    def receive(self) -> tuple[torch.Tensor, bool]:
        """The tokens (B,) on the CPU and whether every row has ended, once they are there."""
        if not self.cuda:
            return self.token, bool(self.done.all())
        self.ready.synchronize()
        return self.host[0].clone(), bool(self.host[1].all())


def eos_set(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def pick(logits, do_sample, temperature, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)



@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's tokens by their text, for holding an answer to given words (`Phrases`): built once per tokenizer
    (`vocabulary`)."""

    ids_of: dict[str, list[int]]  # a token's text (as the tokenizer decodes it alone) → the ids that decode to it
    text_of: dict[int, str]
    longest: int


def vocabulary(tokenizer) -> Vocabulary:
    """Special tokens and pieces of a character (which spell nothing alone) are left out."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    ids_of: dict[str, list[int]] = {}
    text_of: dict[int, str] = {}
    for i, text in zip(ids, tokenizer.batch_decode([[i] for i in ids]), strict=True):
        if text and "\ufffd" not in text:
            ids_of.setdefault(text, []).append(i)
            text_of[i] = text
    return Vocabulary(ids_of, text_of, max(map(len, ids_of), default=1))


class Phrases:
    """An answer held to a list of phrases (a clip's words: "Egyptian Mau (cat)", "tabby cat"): each token picked must
    keep the text a run of distinct phrases joined by `sep`, and an end token may come only where a phrase ends. The
    model still chooses which phrases, in what order and how many; it cannot misspell one, name one the list lacks, or
    be cut off inside one by the answer's `budget` of tokens: a token is let through only where what it leaves can
    still be finished in the tokens left, at the cost (`cost`: the tokens a text takes) of spelling it as the
    tokenizer would.

    Checked on the text, not on ids: a tokenizer merges across a phrase's edge ("cat" + ")," for "(cat), tabby"), so
    the ids of a list are not its phrases' ids end to end; each step lets through the tokens whose text begins one of
    the few strings that may come next."""

    def __init__(self, phrases, vocab: Vocabulary, end, budget: int, cost, sep: str = ", "):
        self.phrases = list(dict.fromkeys(p for p in phrases if p))
        self.vocab, self.end, self.budget, self.sep = vocab, sorted(eos_set(end)), budget, sep
        self.cost = functools.lru_cache(maxsize=None)(cost)
        self.text, self.steps = "", 0

    def _states(self, text: str, used: frozenset = frozenset()) -> list[tuple]:
        """Where `text` may stand: ("in", phrase, chars typed, used), ("sep", used, chars of `sep` typed), ("end", used)
        or ("start",)."""
        if not text:
            return [("sep", used, len(self.sep))] if used else [("start",)]
        out: list[tuple] = []
        for j, phrase in enumerate(self.phrases):
            if j in used:
                continue
            if phrase.startswith(text) and len(text) < len(phrase):
                out.append(("in", j, len(text), used))
            elif text.startswith(phrase):
                rest, now = text[len(phrase):], used | {j}
                if not rest:
                    out.append(("end", now))
                elif self.sep.startswith(rest):
                    out.append(("sep", now, len(rest)))
                elif rest.startswith(self.sep):
                    out += self._states(rest[len(self.sep):], now)
        return out

    def _ahead(self, state: tuple) -> list[str]:
        """The strings that may follow a state: the rest of its phrase (alone, or then a separator and another
        phrase), or a separator's rest and a phrase not said yet."""
        if state[0] == "start":
            return self.phrases
        if state[0] == "in":
            _, j, typed, used = state
            rest = self.phrases[j][typed:]
            return [rest] + [rest + s for s in self._ahead(("end", used | {j}))]
        used, typed = state[1], state[2] if state[0] == "sep" else 0
        return [self.sep[typed:] + p for j, p in enumerate(self.phrases) if j not in used]

    def _to_finish(self, text: str) -> float:
        """The fewest tokens that end `text` where a phrase ends (inf: it cannot)."""
        def need(state):
            if state[0] == "end":
                return 0
            if state[0] == "in":
                return self.cost(self.phrases[state[1]][state[2]:])
            return min((self.cost(a) for a in self._ahead(state)), default=float("inf"))
        return min(map(need, self._states(text)), default=float("inf"))

    def allowed(self) -> tuple[list[int], bool]:
        """The ids that may come next (those after which the answer can still end in the budget; where none can and
        the answer cannot end here either, as with a phrase longer than the whole budget, any that keep to the
        phrases), and whether the answer may end here."""
        states = self._states(self.text)
        ahead = [a for state in states for a in self._ahead(state)]
        ids = {i for a in ahead for k in range(1, min(len(a), self.vocab.longest) + 1)
               for i in self.vocab.ids_of.get(a[:k], ())}
        left = self.budget - self.steps - 1  # after this token
        fits = [i for i in ids if self._to_finish(self.text + self.vocab.text_of[i]) <= left]
        can_end = any(state[0] == "end" for state in states)
        return sorted(fits if fits or can_end else ids), can_end

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (1, V) with every token but the allowed ones at -inf. Where none is allowed (phrases no token
        spells), the answer ends, or, before its first token, is free."""
        ids, can_end = self.allowed()
        ids += self.end if can_end or (not ids and self.text) else []
        if not ids:
            return logits
        keep = torch.tensor(ids, device=logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[..., keep] = logits[..., keep]
        return out

    def advance(self, token: torch.Tensor) -> None:
        """The token picked (batch 1) joins the text."""
        t = int(token.reshape(-1)[0])
        self.steps += 1
        self.text += self.vocab.text_of.get(t, "") if t not in self.end else ""
