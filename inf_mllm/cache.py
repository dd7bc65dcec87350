"""A transformers Cache whose layers evict by policy at turn boundaries and keep positions contiguous.

The seam between a session and its cache is one call per forward: `cache.forward(...)` opens a `Forward`
(what the forward is: a prompt turn, a decode step or a probe; its turn id; its positions; its vision span) and
gives the keyword arguments the model call takes with it. The layers (layer.py) read the open forward when they
update; the attention function (attention.py) gets it through those keyword arguments, which transformers hands
to every attention call. Nothing of a forward outlives it, and nothing of a session lives outside its cache, so
sessions on other threads (or, later, other rows of one batch) never see each other's state.

What is chosen once per cache: the policy (built from its spec), the position strategy (positions.py: 1-D or
multimodal RoPE), the observers and the statistics they declare (observers.py), whether turns are tracked for
recall. Because the kept tokens are always contiguous and every layer ends at the same position, the model's
default position ids (arange + cache length) and causal mask stay right after a shrink.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from .attention import FORWARD_KWARG, use_observing_attention
from .budget import KVShape, layer_budgets
from .layer import LayerSetup, ProbeDone, StreamingLayer  # noqa: F401 (ProbeDone re-exported for probes.py)
from .observers import declared
from .policies import LayerView, Policy, Uniform, build
from .positions import LinearRoPE, MultimodalRoPE, TurnPositions
from .recall import observers as recall_observers
from .rope import RotationTable, multimodal_rope, rope_inv_freq
from .spec import PolicySpec, Recall, as_spec


@dataclass
class Forward:
    """One forward over the cache, as its caller opened it (`StreamingCache.forward`).

    `decoding`: a decode step (it neither opens a turn nor refreshes prompt statistics); `turn`: the id its tokens
    are tracked under (recall); `incoming`: under multimodal RoPE, the tokens' unit bases and the next position;
    `vision_end`: the prompt's tokens up to this index end with its last visual token; `probe_until`: a probe stops
    before this layer; `rewrite`: its first tokens are linked tokens recomputed, written over their stored K/V at
    these rows of the linked block (a probe's go to `fresh` instead, the cache left as it was); `observers`: those
    that score this forward (none: attention goes straight to SDPA)."""

    cache: "StreamingCache | None" = None
    decoding: bool = False
    turn: int = 0
    incoming: tuple | None = None
    vision_end: int | None = None
    vision_seen: bool = False
    probe_until: int | None = None
    observers: list = field(default_factory=list)
    rewrite: torch.Tensor | None = None  # rows of the linked block its first tokens replace (recall's recompute)
    fresh: dict = field(default_factory=dict)  # a probe's recomputed (K, V) of those rows, by layer
    kwargs: dict = field(default_factory=dict)  # for the model call: the forward itself, positions if explicit
    window_mask: tuple = (None, (None, None))  # attention.py's check of the mask, once per forward


@dataclass
class ScoreTime:
    """Time spent on scores since the last `pop()`. With `measure` (benchmarks), the cost beyond plain SDPA,
    found by also running SDPA on the window queries (`probe_s`), and each clock waits for the GPU."""

    measure: bool = False
    score_s: float = 0.0
    probe_s: float = 0.0

    def pop(self) -> tuple[float, float]:
        """(score seconds, probe seconds); probe time is measurement, not work."""
        spent, self.score_s, probe, self.probe_s = self.score_s, 0.0, self.probe_s, 0.0
        return spent, probe


class StreamingCache(Cache):
    """Bounded KV cache for streams: `evict()` at each turn boundary, `step()` after each decode step, and every
    forward inside `forward(...)`."""

    def __init__(self, policy: Policy, budgets: list[int] | None, inv_freq: torch.Tensor, num_layers: int,
                 static: bool = True, multimodal: bool = False, recall: Recall | None = None):
        super().__init__(layers=[])
        self.static = static  # K/V in preallocated buffers written in place (False: transformers' torch.cat)
        self.rope = MultimodalRoPE if multimodal else LinearRoPE
        self.policy = policy
        self.budgets = budgets  # nominal per-layer budgets; the allocator splits their sum at each eviction
        self.headroom = 0  # rows reserved beyond each budget (`reserve`)
        self.observers = policy.all_observers()
        # recall (recall.py): every token's turn tracked, every turn's window observed (recall reads its scores)
        self.recall = recall
        self.track_turns = recall is not None
        if recall is not None:
            self.observers = recall_observers(self.observers, recall)
        self.statistics = declared(self.observers)
        self.inv_freq = inv_freq
        self.rotations = RotationTable(inv_freq)
        self.vision_seen = False  # some turn held visual tokens (VL-Cache's post-vision queries)
        self.timing = ScoreTime()
        self.current = Forward(self)  # the forward under way (a plain prompt when none was opened)
        setup = LayerSetup(static, self.rope, self.track_turns, inv_freq, self.rotations, self.statistics, policy)
        self.layers = [StreamingLayer(i, setup) for i in range(num_layers)]
        if budgets is not None:
            for budget in budgets:
                policy.check(budget)

    @classmethod
    def for_model(cls, model, policy: PolicySpec | Policy | str = "inf_mllm", budget=None, batch: int = 1,
                  static: bool = True, **options):
        """Build a cache for `model`; `budget` is tokens, bytes ("512MB"), a per-layer list or a `Budget`. A spec
        with recall makes a cache that tracks turns for it."""
        recall = None
        if not isinstance(policy, Policy):
            spec = as_spec(policy, **options)
            policy, recall = build(spec), spec.recall
        inv_freq = rope_inv_freq(model)
        shape = KVShape.from_config(model.config, torch.finfo(model.dtype).bits // 8, batch)
        budgets = layer_budgets(budget, shape) if type(policy).name != "full" else None
        if recall is not None or policy.all_observers() or not isinstance(policy.allocator, Uniform):
            use_observing_attention(model)  # also slices the causal mask for layers of different lengths
        return cls(policy, budgets, inv_freq, shape.num_layers, static, multimodal_rope(model), recall)

    # --- the seam: one forward at a time -------------------------------------------------------------

    @contextmanager
    def forward(self, length: int = 0, decoding: bool = False, turn: int | None = None,
                positions: TurnPositions | None = None, held: int = 0, vision_end: int | None = None,
                probe_until: int | None = None, batch: int = 1, device=None):
        """Open one forward of `length` new tokens (`held` of them a held-back answer token in front of the turn,
        whose own positions are `positions`, default text); yields the `Forward`, whose `kwargs` the model call
        takes. A decode step neither opens a turn nor refreshes prompt statistics; a probe stops before layer
        `probe_until`. Scoped to that forward: a paused answer leaves no decode step open."""
        kwargs, incoming = self.rope.turn(self, length - held, positions, held, batch, device)
        if vision_end is not None:
            self.vision_seen = True
        previous = self.current
        fwd = Forward(self, decoding, previous.turn if turn is None else turn, incoming, vision_end, self.vision_seen,
                      probe_until)
        # found once per forward, not per layer: Inf-MLLM's window observer skips decode steps, and a step of a
        # layer nothing observes goes straight to SDPA, as streaming_llm's does
        fwd.observers = [obs for obs in self.observers if obs.queries(fwd, 1)] if decoding else self.observers
        fwd.kwargs = {FORWARD_KWARG: fwd, **kwargs}
        self.current = fwd
        try:
            yield fwd
        finally:
            self.current = Forward(self, turn=fwd.turn, vision_seen=self.vision_seen)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """The model's call for layer `layer_idx`'s new K/V: the layer gets the forward under way as an argument."""
        return self.layers[layer_idx].update(key_states, value_states, self.current)

    @property
    def decode_observers(self) -> list:
        """The observers that score a decode step (H2O's accumulated attention)."""
        probe = Forward(self, decoding=True)
        return [obs for obs in self.observers if obs.queries(probe, 1)]

    @property
    def multimodal(self) -> bool:
        return self.rope.multimodal

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The position the next token takes: the same for every layer, whatever each one holds."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is None or not layer.is_initialized:
            return 0
        return layer.start + layer.get_seq_length()

    @property
    def rope_end(self) -> int:
        """Multimodal RoPE: the position the next token takes (get_seq_length counts stored tokens there)."""
        return self.layers[0].pos.end if self.layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    # --- buffers, for a compiled step ------------------------------------------------------------------

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's whole K and V buffers (B, H, capacity, D): the cache is their first rows."""
        return [layer.buffers() for layer in self.layers]

    def release(self) -> None:
        """Its session is closed: its buffers go now, not at the garbage collector's next full pass (a server opening
        and closing sessions would hold every closed session's cache until then, ~14 MB each for tiny-vlm at budget
        256). No layer is in a reference cycle (it knows its `LayerSetup`, not the cache; its positions and
        statistics know it weakly), so letting go of the layers frees them. The cache is not used again."""
        self.layers, self.current = [], Forward()

    def free_rows(self) -> int:
        """Rows every layer's buffers still have past the cache."""
        return min(layer.capacity - layer.get_seq_length() for layer in self.layers)

    def written(self, new: int) -> None:
        """`new` rows were written past the cache, into the buffers, by a compiled step: they are the cache's now."""
        for layer in self.layers:
            layer.written(new, self.current)

    # --- turn boundaries -------------------------------------------------------------------------------

    def mark(self) -> list[tuple]:
        return [layer.mark() for layer in self.layers]

    def rollback(self, marks: list[tuple]) -> None:
        """Back to `mark()`: every layer as it was, whatever part of a forward ran since."""
        for layer, mark in zip(self.layers, marks, strict=True):
            layer.rollback(mark)

    def evict(self, policy: Policy | None = None) -> None:
        """Turn boundary: the allocator splits the budgets, then each layer keeps (or merges down to) its
        share, chosen by the policy (`policy` overrides the cache's, e.g. a fallback without scores).

        On torch's whole thread pool: under the short OpenMP spin `streaming` sets, 2 CPU threads evict SmolLM2's
        30 layers in ~15 ms against ~22 on one, with the same bits. One thread was the remedy for purely passive
        waiting, where each of an eviction's hundreds of small ops woke the pool."""
        if self.budgets is None or not all(layer.is_initialized for layer in self.layers):
            return
        policy = policy or self.policy
        views = [layer.view() for layer in self.layers]
        budgets = policy.allocator.allocate(policy, views, self.budgets)
        for layer, budget in zip(self.layers, budgets, strict=True):
            layer.budget = budget
        self._apply(policy.select_layers(views, budgets), views, policy.reducer)

    def shrink(self, budgets: list[int]) -> None:
        """Tighten the budgets and evict down to them now (an out-of-memory retry). When the policy's
        prompt statistics are spent (by the last eviction, or stale once answer tokens came in), the
        attention sinks and the newest tokens stay: StreamingLLM's choice needs no scores."""
        self.budgets = list(budgets)
        fresh = all(layer.has_scores(self.policy) for layer in self.layers if layer.is_initialized)
        self.evict(None if fresh else build(PolicySpec("streaming_llm")))
        self.reserve(self.headroom)
        for layer in self.layers:
            layer.fit()

    def reserve(self, headroom: int) -> None:
        """Buffers sized once: each layer's take its budget plus `headroom` rows (the longest turn plus the
        longest answer), now or at their first write, so their shape holds for the whole stream, as a compiled
        decode step needs (a new shape is a new compile; on a GPU, a new CUDA graph). A floor, not a cap: a
        longer turn, or recall linking spans in, still grows them. No-op for an unbounded cache."""
        self.headroom = headroom
        if self.budgets is None:
            return
        for layer, budget in zip(self.layers, self.budgets, strict=True):
            layer.reserve(budget + headroom if headroom else 0)

    def step(self) -> None:
        """After a decode step: policies that evict while decoding (H2O, Elastic's fixed-point
        elimination) bring each layer back to its last budget."""
        if not self.policy.evict_while_decoding or self.budgets is None:
            return
        views = [layer.view() for layer in self.layers]
        budgets = self.budgets if isinstance(self.policy.allocator, Uniform) else self.layer_budgets
        plans = [self.policy.decode_select(view, budget) if view.n > budget else None
                 for view, budget in zip(views, budgets, strict=True)]
        self._apply(plans, views, "evict")

    def _apply(self, plans: list, views: list[LayerView], reducer: str) -> None:
        """Every layer reduced to its plan, all ending at one position: the longest layer starts at 0."""
        if all(plan is None for plan in plans):
            return
        kept = [view.n if plan is None else plan.shape[-1] for plan, view in zip(plans, views, strict=True)]
        end = max(kept)
        rope_end = self.rope.common_end(self.layers, plans)  # multimodal: where every layer's units close up to
        for layer, plan, k in zip(self.layers, plans, kept, strict=True):
            layer.apply(plan, reducer, end - k, rope_end)

    # --- sizes ---------------------------------------------------------------------------------------

    @property
    def layer_budgets(self) -> list[int] | None:
        """What each layer was last allocated (the nominal budgets before the first eviction)."""
        if self.budgets is None:
            return None
        pairs = zip(self.layers, self.budgets, strict=True)
        return [layer.budget if layer.budget is not None else b for layer, b in pairs]

    @property
    def kv_tokens(self) -> int:
        """Tokens per layer, averaged over layers (rounded up): with budgets that differ per layer this,
        not the longest layer, is what the bytes and the nominal budget measure."""
        lengths = [layer.get_seq_length() for layer in self.layers]
        return -(-sum(lengths) // len(lengths)) if lengths else 0

    @property
    def kv_bytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )
