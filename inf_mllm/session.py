"""A streaming session: one model, one bounded cache, turns appended in order.

`append` prefills a turn (token ids or input embeddings) over the whole cache, then evicts at the
turn boundary; `generate` streams an answer token by token without evicting (except for policies
that evict while decoding). The answer's last token is held back and prefixed to the next turn.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .cache import StreamingCache


@dataclass
class TurnStats:
    prefill_s: float = 0.0
    evict_s: float = 0.0
    decode_s: float = 0.0
    decoded: int = 0


class StreamSession:
    def __init__(self, model, tokenizer=None, policy="inf_mllm", budget=None, batch: int = 1, **policy_kwargs):
        self.model, self.tokenizer = model, tokenizer
        self.cache = StreamingCache.for_model(model, policy, budget, batch=batch, **policy_kwargs)
        self.batch = batch
        self.seen = 0  # tokens streamed in so far, whatever was evicted
        self.last = TurnStats()
        self._pending: torch.Tensor | None = None  # (B, 1) last answer token, not yet in the cache
        self._logits: torch.Tensor | None = None

    @property
    def device(self):
        return self.model.device

    @torch.inference_mode()
    def append(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
               evict: bool = True) -> torch.Tensor:
        """Prefill one turn; returns its logits (B, L, V). Evicts afterwards unless evict=False."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("append takes exactly one of input_ids or inputs_embeds")
        if self._pending is not None:
            if input_ids is not None:
                input_ids = torch.cat([self._pending, input_ids.to(self.device)], dim=1)
            else:
                emb = self.model.get_input_embeddings()(self._pending)
                inputs_embeds = torch.cat([emb.to(inputs_embeds.dtype), inputs_embeds.to(self.device)], dim=1)
            self._pending = None
        stats = TurnStats()
        t0 = time.perf_counter()
        kwargs = {"input_ids": input_ids} if input_ids is not None else {"inputs_embeds": inputs_embeds}
        out = self.model(**kwargs, past_key_values=self.cache, use_cache=True)
        t1 = time.perf_counter()
        if evict:
            self.cache.evict()
        stats.prefill_s, stats.evict_s = t1 - t0, time.perf_counter() - t1
        self.seen += out.logits.shape[1]
        self._logits = out.logits[:, -1]
        self.last = stats
        return out.logits

    def append_text(self, text: str, **kwargs) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        return self.append(ids.expand(self.batch, -1), **kwargs)

    @torch.inference_mode()
    def generate(self, max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """Yield (B,) token ids one at a time, continuing from the last appended turn."""
        if self._logits is None:
            raise ValueError("append a turn before generating")
        eos = _eos_set(eos_token_id if eos_token_id is not None else self.model.generation_config.eos_token_id)
        logits, done = self._logits, torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=self.device)
        filler = min(eos, default=0)  # what finished rows emit while others continue
        t0 = time.perf_counter()
        with self.cache.decoding():
            for step in range(max_new_tokens):
                token = _pick(logits, do_sample, temperature, top_p, generator)
                token = torch.where(done, token.new_full(token.shape, filler), token)
                done |= torch.isin(token, eos_ids)
                self.last.decoded = step + 1
                yield token
                if bool(done.all()) or step == max_new_tokens - 1:
                    self._pending = token[:, None]
                    break
                out = self.model(input_ids=token[:, None], past_key_values=self.cache, use_cache=True)
                self.seen += 1
                logits = out.logits[:, -1]
                self.cache.step()
        self._logits = None
        self.last.decode_s = time.perf_counter() - t0

    def discard_pending(self) -> None:
        """Drop the held-back last answer token; the tokens decoded before it stay in the cache."""
        self._pending = None

    def answer(self, text: str, max_new_tokens: int = 64, **kwargs) -> str:
        """Append `text` as a turn and return the decoded answer of the first batch row."""
        self.append_text(text)
        ids = [int(t[0]) for t in self.generate(max_new_tokens, **kwargs)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def kv_tokens(self) -> int:
        return self.cache.kv_tokens

    @property
    def kv_bytes(self) -> int:
        return self.cache.kv_bytes


def _eos_set(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _pick(logits, do_sample, temperature, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
