"""A streaming session: one model, one bounded cache, turns appended in order.

`append` prefills a turn (token ids or input embeddings) over the whole cache, then evicts at the
turn boundary; `generate` streams an answer token by token without evicting (except for policies
that evict while decoding). The answer's last token is held back and prefixed to the next turn.
"""

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from . import probes
from . import recall as recall_
from .answer import Answer, Exchange, Sampling, TurnStats
from .attention import measured_clock
from .cache import StreamingCache
from .compiled import compiled_decode
from .decoding import HandOver
from .positions import TurnPositions
from .restore import restore
from .rows import Row
from .side import side_logits, why_not_packed
from .spec import PolicySpec, Recall, as_spec
from .store import SpanStore
from .text import TextTurns
from .work import BegunQuestion


class StreamSession(TextTurns):
    """`policy` is a `PolicySpec` (a policy string is parsed into one). With recall (`spec.recall`, or
    `recall` given here), turns go to a span store (`store`: a `SpanStore`, or a folder for one that
    survives a restart) and questions asked through `append_question` link back the stored turns they
    need. `static=False` keeps K/V as transformers' dynamic layers do (a comparison, see `buffer.py`).
    `compile_decode=True` runs each decode step the cache allows compiled on fixed shapes (`compiled.py`;
    the first answer waits for the compile). `options` are the policy's options (window, bias, ...)."""

    def __init__(self, model, tokenizer=None, policy: PolicySpec | str = "inf_mllm", budget=None, batch: int = 1,
                 recall: Recall | None = None, store: SpanStore | str | None = None, static: bool = True,
                 compile_decode: bool = False, **options):
        self.model, self.tokenizer = model, tokenizer
        spec = as_spec(policy, **options)  # the one conversion of a policy string on the way to the cache
        if recall is not None:
            spec = spec.with_recall(recall)
        self.recall = spec.recall
        self.cache = StreamingCache.for_model(model, spec, budget, batch=batch, static=static)
        self._compiled = compiled_decode(model) if compile_decode else None
        self.batch = batch
        self.seen = 0  # tokens streamed in so far, whatever was evicted
        self.turns = 0  # turns appended so far; a stored turn's span id is its turn number
        self.last = TurnStats()
        self.clock = time.perf_counter  # what turns and answers are timed by (a test gives one it steps itself)
        self.last_recalled: list[tuple[int, dict]] = []  # (span id, meta) linked for the last question
        self.exchange: Exchange | None = None  # the last question and its answer so far (row 0)
        self._pending: torch.Tensor | None = None  # (B, 1) last answer token, not yet in the cache
        self._logits: torch.Tensor | None = None
        self._decoding = None  # the paused decode loop of an unfinished answer
        # a compiled step for each answer token is launched before the token is handed over, and kept if the
        # answer goes on: on a GPU it runs while the consumer reads the token (on a CPU it would only add a step)
        self.run_ahead = self.device.type == "cuda"
        self._forget_at: list | None = None  # cache marks before a question that leaves with its answer
        self.store = None
        if self.recall is not None:
            if batch != 1:
                raise ValueError("recall works on one stream at a time (batch 1)")
            if self.cache.policy.evict_while_decoding:
                raise ValueError(f"recall needs a policy that evicts only at turn boundaries, not {spec.policy_name}")
            recall_.scoring_layers(self.recall, len(self.cache.layers))  # a layer the model lacks: refused now
            if self.recall.reuse != "full" and (self.cache.multimodal or self.recall.at != "end"):
                raise ValueError(f"recall +{self.recall.reuse} recomputes linked turns placed at the end of the cache "
                                 "of a model with 1-D RoPE (not multimodal RoPE, not placed at the front)")
            self.store = store if isinstance(store, SpanStore) else SpanStore(store)
            self.turns = self.store.next_id

    @property
    def device(self):
        return self.model.device

    @property
    def after_answer(self) -> bool:
        """True while the last answer's final token is held back for the next turn (which a chat template may open
        with what it writes after an answer)."""
        return self._pending is not None

    @torch.inference_mode()
    def append(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
               evict: bool = True, store: bool = True, meta: dict | None = None,
               vision: tuple[int, int] | None = None, all_logits: bool = False,
               positions: TurnPositions | None = None, forward_inputs: dict | None = None) -> torch.Tensor:
        """Prefill one turn; returns the logits of its last position (B, 1, V), or of every position (B, L, V)
        with all_logits=True (perplexity, teacher-forced answers): the LM head over a whole turn is about a
        fifth of a clip turn's prefill for SmolLM2, spent for nothing when only the next token matters.
        Evicts afterwards unless evict=False.

        With recall, recalled spans leave first, and the turn goes to the store (unless store=False)
        with `meta` (e.g. its clip index and video times) to report when it is recalled. `vision`, the
        (start, end) token span of the turn's visual tokens, tells the cache where the text after
        them begins (VL-Cache's post-vision queries); optional. `positions`: the turn's own position ids
        under multimodal RoPE (default: one per token, as for text). `forward_inputs`: more of the model's own
        forward arguments for this turn (Qwen3-VL's precomputed vision outputs, whose DeepStack features it adds
        inside its first layers)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("append takes exactly one of input_ids or inputs_embeds")
        self.begin_turn()
        return self._prefill(input_ids, inputs_embeds, evict, store, meta, vision, all_logits, positions,
                             forward_inputs)

    def begin_turn(self) -> None:
        """Everything of a turn before its prefill: the last answer ends (a question asked with keep=False leaves
        with it), recall's linked turns leave."""
        self._end_answer()
        self._forget_question()
        self.exchange = None  # what follows is not the last question's answer
        if self.recall is not None:
            recall_.unlink(self.cache)

    def forget_question(self) -> None:
        """A question asked with keep=False leaves now, with its answer, not when the next turn begins (a watch's side
        question: the cache is as it was before it)."""
        self._forget_question()
        self.exchange = None

    def side_logits(self, questions: list[torch.Tensor]) -> torch.Tensor:
        """Several questions about the cache as it stands, in shared forwards (side.py: a stream's watches after a
        clip), each one's next-token logits (K, V); nothing of them stays. ValueError where they cannot share one."""
        self._end_answer()
        self._forget_question()
        if (why := why_not_packed(self)) is not None:
            raise ValueError(f"side questions cannot share a forward here: {why}")
        self.exchange, self.last_recalled = None, []
        return side_logits(self, questions)

    def _forget_question(self) -> None:
        """A question asked with keep=False leaves, with its answer, as the next turn begins."""
        if self._forget_at is not None:
            self.cache.rollback(self._forget_at)
            self._forget_at, self._pending = None, None

    def _end_answer(self) -> None:
        """A turn arrives while an answer is paused mid-generation: that answer ends here."""
        if self._decoding is not None:
            self._decoding.close()

    def _prefill(self, input_ids, inputs_embeds, evict: bool, store: bool, meta: dict | None,
                 vision: tuple[int, int] | None = None, all_logits: bool = False,
                 positions: TurnPositions | None = None, forward_inputs: dict | None = None,
                 recompute: tuple | None = None) -> torch.Tensor:
        """`recompute`: (rows of the linked block, their inputs) recomputed in front of the turn, in the same forward
        (MPIC's one step: the linked block is its dummy cache); the logits returned are the turn's."""
        turn = self.turn_row(input_ids, inputs_embeds, vision, positions)
        kwargs = {"input_ids": turn.tokens} if turn.tokens.dim() == 2 else {"inputs_embeds": turn.tokens}
        if recompute is not None:
            rows, inputs = recompute
            embedded = kwargs.pop("inputs_embeds", None)
            embedded = self.model.get_input_embeddings()(turn.tokens) if embedded is None else embedded
            kwargs = {"inputs_embeds": torch.cat([inputs.to(self.device, embedded.dtype)[None], embedded], dim=1),
                      **probes.selective(self, rows, turn.length)}
        kwargs["logits_to_keep"] = 0 if all_logits else 1  # 0: every position
        t0 = self._clock()
        rewrite = None if recompute is None else recompute[0].to(self.device)
        out = self.forward_row(turn, kwargs, forward_inputs, rewrite)
        kept = self.kept_inputs(turn, vision) if store and not forward_inputs else {}
        self.turn_done(out.logits[:, -1], turn.length, t0, evict, store, meta, **kept)
        return out.logits[:, len(recompute[0]):] if recompute is not None and all_logits else out.logits

    def forward_row(self, turn: Row, inputs: dict | None = None, forward_inputs: dict | None = None,
                    rewrite: torch.Tensor | None = None):
        """A turn's forward on this cache alone (`inputs`: the model's token arguments, by default the row's tokens
        and its last position's logits only); the model's output. A lone session's turns and a pool's lone rows both
        take it. A turn that fails (out of memory, Ctrl-C) leaves the session as it was (a block's rewritten rows
        leave with the block at the next turn)."""
        if inputs is None:
            inputs = {"input_ids" if turn.tokens.dim() == 2 else "inputs_embeds": turn.tokens, "logits_to_keep": 1}
        marks = self.cache.mark()
        with self.cache.forward(turn.length, batch=self.batch, device=self.device, **turn.forward) as fwd:
            fwd.rewrite = rewrite
            try:
                return self.model(**inputs, **fwd.kwargs, **(forward_inputs or {}), past_key_values=self.cache,
                                  use_cache=True)
            except BaseException:
                self.cache.rollback(marks)
                raise

    def turn_row(self, input_ids, inputs_embeds, vision: tuple[int, int] | None = None,
                 positions: TurnPositions | None = None) -> Row:
        """The turn as the cache takes it: the held-back answer token in front, and what its forward is told."""
        held = int(self._pending is not None)
        input_ids, inputs_embeds = self.with_pending(input_ids, inputs_embeds)
        tokens = input_ids if input_ids is not None else inputs_embeds
        return Row(self.cache, tokens, {"turn": self.turns, "positions": positions, "held": held,
                                        "vision_end": None if vision is None else vision[1] + held})

    def kept_inputs(self, turn: Row, vision: tuple[int, int] | None) -> dict:
        """What a recompute of the stored turn starts from (`turn_done`'s `inputs` and `vision`): its inputs, where
        recall recomputes linked turns (none where features enter inside the decoder: not called for those)."""
        if self.recall is None or self.recall.reuse == "full":
            return {}
        tokens = turn.tokens if turn.tokens.dim() == 3 else self.model.get_input_embeddings()(turn.tokens)
        held = turn.forward["held"]
        return {"inputs": tokens[0], "vision": None if vision is None else (vision[0] + held, vision[1] + held)}

    def turn_done(self, logits: torch.Tensor, length: int, t0: float, evict: bool = True, store: bool = True,
                  meta: dict | None = None, inputs: torch.Tensor | None = None,
                  vision: tuple[int, int] | None = None) -> None:
        """After a turn's forward (`logits`: its last position's, (B, V)): store it for recall (with its `inputs` and
        `vision` span when linked turns are recomputed), evict, count it."""
        self._pending = None
        stats = TurnStats()
        t1 = self._clock()
        if self.recall is not None and store:
            self.store.add(recall_.make_span(self.cache, self.turns, length, self.recall, meta or {}, inputs, vision))
        if evict:
            self.cache.evict()
        stats.prefill_s, stats.evict_s = t1 - t0, self._clock() - t1
        self.seen += length
        self.turns += 1
        self._logits = logits
        self.last = stats

    def _clock(self) -> float:
        """A prefill's kernels are not timed as the eviction after it."""
        return measured_clock(self.cache.timing, self.device, self.clock)

    def with_pending(self, input_ids, inputs_embeds):
        """The turn with the held-back last answer token in front of it."""
        if self._pending is None:
            return input_ids, inputs_embeds
        if input_ids is not None:
            return torch.cat([self._pending, input_ids.to(self.device)], dim=1), None
        emb = self.model.get_input_embeddings()(self._pending)
        return None, torch.cat([emb.to(inputs_embeds.dtype), inputs_embeds.to(self.device)], dim=1)

    @torch.inference_mode()
    def append_question(self, input_ids: torch.Tensor, probe_ids: torch.Tensor | None = None,
                        named: Callable[[dict], bool] | None = None,
                        oracle: Callable[[dict], bool] | None = None, keep: bool = True,
                        all_logits: bool = False) -> torch.Tensor:
        """A question turn: with recall, the stored turns it needs are linked back first (those `named`
        by the question, then the best matches of its keys: `probe_ids`, default the turn itself), and
        it does not evict them. `oracle` is the right span, for the oracle mode of the benchmarks.

        keep=False: the question and its answer leave the cache when the next turn begins (nothing is
        evicted for them), so an answer about one clip cannot sway the next question about another;
        policies that evict while decoding keep them."""
        question = self.begin_question(input_ids, probe_ids, named, oracle, keep)
        logits = self.prefill_recomputing(question, input_ids, all_logits)
        self.question_done(question)
        return logits

    def begin_question(self, input_ids: torch.Tensor, probe_ids: torch.Tensor | None = None,
                       named: Callable[[dict], bool] | None = None, oracle: Callable[[dict], bool] | None = None,
                       keep: bool = True) -> BegunQuestion:
        """Everything of a question before its prefill: the last answer ends, recall links what it needs."""
        self.last_recalled = []
        self._end_answer()
        self._forget_question()
        keep = keep or self.cache.policy.evict_while_decoding
        self.exchange = Exchange(self.turns, input_ids[0].tolist(), kept=keep)
        linked, t0 = [], self.clock()
        if self.recall is not None:
            recall_.unlink(self.cache)
            resident = recall_.resident_spans(self.cache, self.store, self.recall.resident)
            keys = None  # ranking by keys: only for a question the caller did not resolve
            probe = self.recall.mode == "attention" and len(resident) < len(self.store)
            if probe and not (named and self.recall.named):
                keys = probes.question_keys(self, probe_ids if probe_ids is not None else input_ids)
            chosen = recall_.choose(self.store, resident, self.recall, keys, named, oracle)
            linked = recall_.link(self.cache, self.store, chosen, self.recall.at)
        recompute = probes.to_recompute(self, linked) if linked and self.recall.reuse != "full" else None
        forget_at = None if keep else self.cache.mark()
        return BegunQuestion(linked, self.clock() - t0, forget_at, keep and not linked, recompute)

    @torch.inference_mode()
    def prefill_recomputing(self, question: BegunQuestion, input_ids: torch.Tensor, all_logits: bool = False):
        """The question's prefill, the linked rows `question.recompute` names (if any) recomputed in the same forward
        in place of their stored K/V; a recomputed row stays so until the block leaves. Returns its logits."""
        return self._prefill(input_ids, None, evict=question.evict, store=False, meta=None, all_logits=all_logits,
                             recompute=question.recompute)

    def question_done(self, question: BegunQuestion) -> None:
        self._forget_at = question.forget_at
        self.last.recall_s = question.recall_s
        self.last_recalled = [(i, self.store.spans[i].meta) for i in question.linked if i in self.store]

    def restore(self, exchanges: Iterable[Exchange | dict] = ()) -> list[int]:
        """Rebuild the cache after a restart from a reopened store (restore.py); the span ids linked back."""
        restored = restore(self, exchanges)
        self._logits, self.exchange = None, None  # no answer continues from what went back in
        return restored

    def generate(self, max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None, constraint=None) -> Iterator[torch.Tensor]:
        """An iterator of (B,) token ids on the CPU, one at a time, continuing from the last appended turn.

        Whenever the consumer stops (the end, a `break`, a closed generator, or the next `append`,
        which closes a paused one), the last token it received is held back, pending for the next
        turn, and the logits are spent: the next answer never continues from a stale state.
        `last.decode_s` counts the model's time, not the consumer's."""
        sampling = Sampling(do_sample, temperature, top_p, generator, constraint)  # constraint: `decoding.Phrases`
        self._decoding = self._decode(Answer.begin(self, max_new_tokens, sampling, eos_token_id))
        return self._decoding

    @torch.inference_mode()
    def _decode(self, answer: Answer):
        # what makes a step plain is fixed for an answer (a new turn ends it): checked once, not per token
        compiled = self._compiled if self._compiled is not None and self._compiled.why_not(self.cache) is None \
            else None
        run_ahead = compiled is not None and self.run_ahead
        hand_over = HandOver(self.device, self.batch)
        ahead = None  # the logits of the step launched for the token in the consumer's hands, not yet committed
        try:
            t0 = self._clock()
            while answer.steps < answer.max_new_tokens:  # none at all when asked for none
                token = answer.apply(answer.sampling.pick(answer.logits))
                hand_over.send(token, answer.done)
                if run_ahead and answer.steps + 1 < answer.max_new_tokens:
                    ahead = compiled.launch(self.cache, token)  # dropped if the answer ends at this token
                handed, all_done = hand_over.receive()
                finished = answer.handed(handed, all_done)
                self.last.decode_s += self.clock() - t0  # the token is ready: its steps have run
                yield handed
                t0 = self.clock()  # the consumer's time is not the model's
                if finished:
                    break
                if ahead is not None:
                    compiled.commit(self.cache)
                    logits, ahead = ahead, None
                else:
                    logits = compiled.step(self.cache, token) if compiled is not None else None
                if logits is None:
                    logits = self.step(token)
                answer.advanced(logits)
        finally:
            self._decoding = None
            answer.hold_back()  # received, not yet in the cache (a step launched for it is dropped)

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """One eager decode step: `token` (B,) into the cache; the next token's logits (B, V). A lone session's answer
        and a pool's lone decode row both take it (a forward of its own: nothing is held while an answer pauses)."""
        with self.cache.forward(1, decoding=True, batch=self.batch, device=self.device) as fwd:
            out = self.model(input_ids=token[:, None].to(self.device), past_key_values=self.cache, use_cache=True,
                             **fwd.kwargs)
        return out.logits[:, -1]

    def take_logits(self) -> torch.Tensor:
        """The last turn's logits, which an answer starts from: spent once taken, so no answer continues from a
        stale state."""
        if self._logits is None:
            raise ValueError("append a turn before generating")
        logits, self._logits = self._logits, None
        return logits

    def hold(self, token: torch.Tensor | None) -> None:
        """An answer's last token handed over, (B, 1), not in the cache: it opens the next turn (None: nothing)."""
        self._pending = token

    def discard_pending(self) -> None:
        """Drop the held-back last answer token; the tokens decoded before it stay in the cache."""
        self._pending = None

    @property
    def kv_tokens(self) -> int:
        return self.cache.kv_tokens

    @property
    def kv_bytes(self) -> int:
        return self.cache.kv_bytes
