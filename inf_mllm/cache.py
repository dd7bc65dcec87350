"""A transformers Cache whose layers evict by policy at turn boundaries and keep positions contiguous.

Each `StreamingLayer` is a `DynamicLayer` that also keeps what its policy's observers record (the
window scores of the last prompt, accumulated attention, post-vision statistics), evicts or merges to
its budget when told, and re-rotates the kept keys so they sit at contiguous positions. Because the
kept tokens are always contiguous and every layer ends at the same position, the model's default
position ids (arange + cache length) and causal mask stay right after a shrink.
"""

from contextlib import contextmanager, nullcontext

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import attention
from .attention import use_observing_attention
from .budget import KVShape, layer_budgets
from .buffer import KVBuffer
from .observers import WindowObserver
from .policies import LayerView, Policy, Uniform, build
from .positions import compact
from .rope import RotationTable, multimodal_rope, rerotate, rope_inv_freq
from .scoring import window_scores
from .spec import PolicySpec, as_spec


class ProbeDone(Exception):
    """Ends a probe forward (`StreamingCache.probe_layers`) once its last wanted layer has run."""


class StreamingLayer(DynamicLayer):
    """One layer's K/V plus what its observers recorded (`seen`), evicted or merged when told.

    Its tokens sit at contiguous positions start..start+len-1; `start` is 0 unless budgets differ per
    layer, where every layer ends at the same position (the cache's `get_seq_length`), so the model's
    position ids and causal mask fit all layers (the attention function slices the mask per layer).

    `turn_ids` (B, H, n), kept when the cache tracks turns (recall), says which turn each token came from;
    linked (recalled) tokens carry -1 - span id. Under multimodal RoPE (`cache.multimodal`) `start` only
    aligns storage: the layer also keeps each token's unit base (`base`, (B, 1 or H, n)) and the next
    position (`end`, the same in every layer); see positions.py."""

    def __init__(self, layer_idx: int, cache: "StreamingCache"):
        # K/V and what is kept per token live in preallocated buffers (buffer.py), set before the base class
        # sets keys; every `self.keys = ...`, `self.turn_ids = ...`, `self.base = ...` below writes into them
        self._k, self._v, self._ids, self._base = (KVBuffer(cache.static) for _ in range(4))
        self._stats: dict[str, KVBuffer] = {}  # per-token observer statistics (`grow_seen`)
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.prompt_len = 0
        self.start = 0
        self.budget: int | None = None  # the last budget its allocator gave it
        self.seen: dict[str, torch.Tensor] = {}  # observer key -> statistic (see observers.py)
        self.end = 0  # multimodal RoPE: the position the next token takes
        self._wants: list = []  # (observer, queries) for the forward under way

    keys = property(lambda self: self._k.get(), lambda self, value: self._k.set(value))
    values = property(lambda self: self._v.get(), lambda self, value: self._v.set(value))
    turn_ids = property(lambda self: self._ids.get(), lambda self, value: self._ids.set(value))
    base = property(lambda self: self._base.get(), lambda self, value: self._base.set(value))

    def grow_seen(self, key: str, rows: torch.Tensor) -> None:
        """seen[key], a per-token statistic (B, H, n), with `rows` appended, in a buffer of its own: as the
        statistic was last set (an eviction gives a tensor of its own, copied in once; the buffer's own
        rows move nothing), not a new tensor per decode step."""
        buf = self._stats.get(key)
        if buf is None:
            buf = self._stats[key] = KVBuffer(self.cache.static)
            buf.least = self._k.least
        buf.set(self.seen.get(key))
        self.seen[key] = buf.append(rows)

    def _set_seen(self, key: str, value: torch.Tensor) -> None:
        """seen[key] = value, written into the statistic's buffer when it has one (an eviction's kept rows)."""
        buf = self._stats.get(key)
        if buf is not None:
            buf.set(value)
            value = buf.get()
        self.seen[key] = value

    @property
    def window_scores(self) -> torch.Tensor | None:
        return self.seen.get("window")

    def update(self, key_states, value_states, *args, **kwargs):
        if self.cache.probe_layers is not None and self.layer_idx >= self.cache.probe_layers:
            raise ProbeDone  # the probe has the keys it needs: the deeper layers need not run
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._k.append(key_states), self._v.append(value_states)
        new = key_states.shape[-2]
        if not self.cache.is_decoding:
            self.prompt_len = new
        self._grew(new)
        # announce even when nothing is observed: a layer of another cache left announced (a forward that
        # never reached attention) must not be taken for this one
        observed = self.cache.decode_observers if self.cache.is_decoding else self.cache.observers
        attention.announce(self if observed else None)
        return keys, values

    def written(self, new: int) -> None:
        """`new` rows were written into the buffers past the cache by a compiled decode step (compiled.py)."""
        self._k.n += new
        self._v.n += new
        self._grew(new)

    def _grew(self, new: int) -> None:
        """What the layer keeps per token besides K/V, grown by the `new` tokens just appended."""
        if self.cache.track_turns:
            keys = self.keys
            self._ids.append(torch.full((*keys.shape[:2], new), self.cache.turn, dtype=torch.long, device=keys.device))
        if self.cache.multimodal:
            self._place(new)
        for obs in self.cache.observers:
            obs.grow(self, new)

    def _place(self, new: int) -> None:
        """The new tokens' unit bases and the next position, as the forward's caller announced them."""
        incoming = self.cache.incoming
        if incoming is None or incoming[0].shape[-1] != new:
            raise ValueError("a multimodal-RoPE forward needs its positions: pass the turn's position ids "
                             "through StreamSession (positions=)")
        base, self.end = incoming
        rows = 1 if self.base is None else self.base.shape[1]
        self._base.append(base.expand(self._k.get().shape[0], rows, new))

    def window_len(self, q_len: int) -> int:
        """How many of this forward's last queries the observers want scored (0: none)."""
        decoding = self.cache.is_decoding
        self._wants = [(obs, obs.queries(self, q_len, decoding)) for obs in self.cache.observers]
        return max((want for _, want in self._wants), default=0)

    def observe_scores(self, scores: torch.Tensor, l: int, query: torch.Tensor | None = None,
                       keys: torch.Tensor | None = None, scaling: float | None = None) -> None:
        """Called by the attention function after `window_len` with (B, Hq, n) mean attention of the last l
        queries, and those queries (B, Hq, l, D), the layer's keys and the scale, for observers that want
        fewer queries or other statistics than the mean."""
        for obs, want in self._wants:
            if want == 0:
                continue
            own = scores if want == l else window_scores(query[:, :, -want:], keys, scaling)
            obs.record(self, own, want, None if query is None else query[:, :, -want:], keys, scaling)

    def view(self) -> LayerView:
        s = self.seen
        return LayerView(self.get_seq_length(), self.prompt_len, self.keys.shape[1], s.get("window"), s.get("acc"),
                         s.get("post"), s.get("sparsity"))

    def has_scores(self, policy: Policy) -> bool:
        """Whether the prompt statistics `policy` ranks by are current (not spent by an eviction, nor
        stale once answer tokens came in)."""
        n = self.get_seq_length()
        for obs in policy.observers():
            stat = self.seen.get(obs.key)
            if stat is None or (obs.key != "acc" and stat.shape[-1] != n):
                return False
        return True

    def apply(self, idx: torch.Tensor | None, reducer: str, start: int, end: int | None = None) -> None:
        """Reduce to the sorted indices idx (None: keep all), then sit at positions start..start+K-1 (under
        multimodal RoPE: stored from `start`, the kept units closing up to end at `end`)."""
        if idx is None:
            if start != self.start or (end is not None and end != self.end):
                self.shift(start, end)
            return
        if reducer == "merge":
            self.merge(idx, start, end)
        else:
            self.keep(idx, start, end)
        for key in ("window", "post", "sparsity"):  # prompt statistics are spent by an eviction
            self.seen.pop(key, None)

    def keep(self, idx: torch.Tensor, start: int | None = None, end: int | None = None) -> None:
        """Keep the tokens at sorted indices idx, (B, K) or (B, H, K), re-rotated to positions start..start+K-1
        (start: unchanged by default; multimodal RoPE: units closed up to end at `end`, by default where they
        end when they close up towards the first one)."""
        start = self.start if start is None else start
        b, h = self.keys.shape[:2]
        idx = idx.to(self.keys.device)
        # one index set for all heads stays (B, 1, K): its shifts and rotation angles are computed once per token
        idx = idx[:, None, :] if idx.dim() == 2 else idx
        keys = self._k.take(idx)
        if self.base is not None:
            old, new = self._closed_up(idx, end)
            self.keys = rerotate(keys, new - old, self.cache.inv_freq)
        else:
            delta = torch.arange(idx.shape[-1], device=idx.device) + (start - self.start) - idx  # new - old position
            front = self._k.front(idx.shape[-1])  # its rows were taken: free to write
            with self._k.writing() if front is not None else nullcontext():
                self.keys = self._moved(keys, delta, start, out=front)
        self.values = self._v.take(idx)
        if "acc" in self.seen:
            self._set_seen("acc", self.seen["acc"].gather(-1, idx.expand(b, h, -1)))
        if self.turn_ids is not None:
            self.turn_ids = self._ids.take(idx)
        self.start = start

    def _closed_up(self, idx: torch.Tensor, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE: the kept tokens' (old, new) unit bases, their units closed up to end at `end`
        (None: each row's first kept unit stays where it is, the rows ending together); sets base and end."""
        old, new, total = compact(self.base, self.end, idx)
        if end is None:
            end = int((old[..., 0] + total).max())
        new = new + (end - total)[..., None]
        self.base, self.end = new, end
        return old, new

    def extent(self, idx: torch.Tensor | None) -> int:
        """Multimodal RoPE: the positions this layer's tokens (those at idx, if given) take when closed up."""
        if idx is None:
            return self.end - int(self.base[..., 0].min())
        idx = idx.to(self.base.device)
        return int(compact(self.base, self.end, idx[:, None, :] if idx.dim() == 2 else idx)[2].max())

    def merge(self, idx: torch.Tensor, start: int, end: int | None = None) -> None:
        """Elastic Cache's merging (its Eq. 2-3): the kept indices are anchors; every token joins the bucket
        of its nearest anchor (boundaries at the floor of the midpoints between neighbouring anchors) and
        each bucket's K and V become the means of its members. Keys are cached after RoPE, so each member
        key is first rotated to the position its bucket will occupy (the anchor's, after re-assignment):
        the mean is taken among keys at one position, as if every member sat where its anchor sits.
        Accumulated attention is summed per bucket; a bucket keeps its anchor's turn id."""
        b, h, n, d = self.keys.shape
        idx = idx.to(self.keys.device)
        idx = idx[:, None, :] if idx.dim() == 2 else idx  # (B, 1 or H, K)
        k, g = idx.shape[-1], idx.shape[1]
        mids = torch.div(idx[..., :-1] + idx[..., 1:], 2, rounding_mode="floor").contiguous()
        pos = torch.arange(n, device=idx.device).expand(b, g, n).contiguous()
        bucket = torch.searchsorted(mids, pos)  # how many boundaries lie before each token: (B, g, n)
        if self.base is not None:  # each member moves as its anchor's unit does
            base = self.base
            _, new = self._closed_up(idx, end)
            rows = new.shape[1]
            moved = new.gather(-1, bucket.expand(b, rows, n)) - base.expand(b, rows, n)
            keys = rerotate(self.keys, moved, self.cache.inv_freq).float()
        else:
            delta = bucket + (start - self.start) - pos
            keys = self._moved(self.keys, delta, start).float()
        ones = torch.ones_like(bucket, dtype=torch.float32)
        count = torch.zeros(b, g, k, device=idx.device).scatter_add_(-1, bucket, ones)
        spread = bucket.expand(b, h, n)
        where = spread.unsqueeze(-1).expand(b, h, n, d)
        mean = count.expand(b, h, k).unsqueeze(-1)
        zeros = torch.zeros(b, h, k, d, device=idx.device)
        self.keys = (zeros.scatter_add(2, where, keys) / mean).to(self.keys.dtype)
        self.values = (zeros.scatter_add(2, where, self.values.float()) / mean).to(self.values.dtype)
        if "acc" in self.seen:
            self._set_seen("acc", torch.zeros(b, h, k, device=idx.device).scatter_add_(-1, spread, self.seen["acc"]))
        if self.turn_ids is not None:
            self.turn_ids = self._ids.take(idx)
        self.start = start

    def shift(self, start: int, end: int | None = None) -> None:
        """Move every token by start - self.start positions (budgets that differ per layer); under multimodal
        RoPE, stored from `start` and moved by end - self.end positions."""
        n = self.get_seq_length()
        if self.base is not None:
            if end is not None and end != self.end:
                self.keys = rerotate(self.keys, torch.full((1, 1, n), end - self.end, device=self.keys.device),
                                     self.cache.inv_freq)
                self.base, self.end = self.base + (end - self.end), end
        else:
            delta = torch.full((1, 1, n), start - self.start, device=self.keys.device)
            self.keys = self._moved(self.keys, delta, start)
        self.start = start

    def fit(self) -> None:
        """Give back the buffer capacity a larger budget had reserved."""
        self._k.fit()
        self._v.fit()

    def reserve(self, rows: int) -> None:
        """Every buffer of the layer takes at least `rows` rows when it allocates."""
        for buf in (self._k, self._v, self._ids, self._base, *self._stats.values()):
            buf.reserve(rows)

    def _moved(self, keys: torch.Tensor, delta: torch.Tensor, start: int, out: torch.Tensor | None = None):
        """Keys re-rotated by `delta` as the layer's tokens move to sit from `start` (into `out` if given). A token
        never moves right by more than the start moved (only tokens before it drop out) nor left by more than
        the layer's length plus what the start moved back, so the bounds come from the host's counts, without
        reading `delta`."""
        reach = self.keys.shape[-2] + max(0, self.start - start)
        return self.cache.rotations.rotate(keys, delta, reach, forward=start > self.start, out=out)

    def insert(self, at: int, keys: torch.Tensor, values: torch.Tensor, tags: torch.Tensor,
               bases: torch.Tensor | None = None) -> None:
        """Link a stored block (B, H, m, d) whose keys sit at positions 0..m-1 in at index `at`; the
        tokens after it move right by m (keys re-rotated), so positions stay contiguous. Under multimodal
        RoPE, `bases` (m + 1,) holds the block's unit bases from 0 and then its extent, which the block's
        keys move to and the tokens after it move by."""
        m = keys.shape[2]
        inv_freq = self.cache.inv_freq
        head_k, tail_k = self.keys[:, :, :at], self.keys[:, :, at:]
        if self.base is not None:
            to, shift = self._open(at, bases[:-1].to(self.base.device), int(bases[-1]))  # bases: host memory
            block = rerotate(keys.to(self.keys), to, inv_freq)
        else:
            to, shift = self.start + at, m
            block = keys if not to else rerotate(keys.to(self.keys), torch.full((1, 1, m), to, device=keys.device),
                                                 inv_freq)
        if tail_k.shape[2]:
            tail_k = rerotate(tail_k, torch.full((1, 1, tail_k.shape[2]), shift, device=keys.device), inv_freq)
        self.keys = torch.cat([head_k, block.to(self.keys.dtype), tail_k], dim=2)
        self.values = torch.cat([self.values[:, :, :at], values.to(self.values), self.values[:, :, at:]], dim=2)
        b, h = self.keys.shape[:2]
        if self.turn_ids is not None:
            ids = tags.to(self.turn_ids.device).expand(b, h, m)
            self.turn_ids = torch.cat([self.turn_ids[..., :at], ids, self.turn_ids[..., at:]], dim=-1)
        acc = self.seen.get("acc")
        if acc is not None:
            zeros = torch.zeros((b, h, m), dtype=acc.dtype, device=acc.device)
            self._set_seen("acc", torch.cat([acc[..., :at], zeros, acc[..., at:]], dim=-1))

    def _open(self, at: int, bases: torch.Tensor, extent: int) -> tuple[torch.Tensor, int]:
        """Multimodal RoPE: room for a block of unit bases `bases` and `extent` positions at index `at`, which
        must begin a unit in every row; returns where the block's first unit sits, (B, rows, 1), and its extent."""
        n = self.base.shape[-1]
        if 0 < at < n and bool((self.base[..., at] == self.base[..., at - 1]).any()):
            raise ValueError(f"cannot link a span at index {at}: it falls inside a vision block")
        rows = self.base.shape[:2]
        to = self.base[..., at:at + 1] if at < n else self.base.new_full((*rows, 1), self.end)
        self.base = torch.cat([self.base[..., :at], to + bases, self.base[..., at:] + extent], dim=-1)
        self.end += extent
        return to, extent

    def mark(self) -> tuple:
        """What `rollback` needs to undo the forwards that follow (a probe, or a turn that failed)."""
        seen = {k: v.clone() if k == "acc" else v for k, v in self.seen.items()}
        return self.get_seq_length(), self.prompt_len, seen, self.start, self.end

    def rollback(self, mark: tuple) -> None:
        n, self.prompt_len, self.seen, self.start, self.end = mark
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        if self.turn_ids is not None:
            self.turn_ids = self.turn_ids[..., :n]
        if self.base is not None:
            self.base = self.base[..., :n] if n else None

    def positions(self, first: int) -> torch.Tensor:
        """The positions of the tokens from index `first` on, (rows, L): for the text tokens they are
        meant for (a question's keys), a token's unit base is its position."""
        if self.base is not None:
            return self.base[0, :, first:]
        n = self.get_seq_length()
        return (self.start + torch.arange(first, n, device=self.keys.device))[None]


class StreamingCache(Cache):
    """Bounded KV cache for streams: `evict()` at each turn boundary, `step()` after each decode step.

    Whether a forward is a prompt or a decode step is explicit per forward (`phase`, set by
    `decode_step()` around one decode forward), never a flag held while an answer is paused."""

    def __init__(self, policy: Policy, budgets: list[int] | None, inv_freq: torch.Tensor, num_layers: int,
                 static: bool = True, multimodal: bool = False):
        super().__init__(layers=[])
        self.static = static  # K/V in preallocated buffers written in place (False: transformers' torch.cat)
        # multimodal RoPE (positions.py): each forward's caller announces its tokens' unit bases and the
        # position after them (`incoming`); layers keep them
        self.multimodal = multimodal
        self.incoming: tuple[torch.Tensor, int] | None = None
        self.layers = [StreamingLayer(i, self) for i in range(num_layers)]
        self.policy = policy
        self.budgets = budgets  # nominal per-layer budgets; the allocator splits their sum at each eviction
        self.headroom = 0  # rows reserved beyond each budget (`reserve`)
        self.observers = policy.all_observers()
        self.inv_freq = inv_freq
        self.rotations = RotationTable(inv_freq)
        self.phase = "prompt"
        self.decode_observers: list = []  # those that score decode steps (H2O's accumulated attention), per step
        # the current prompt's vision span end (tokens of the turn up to the last visual one), if announced
        self.vision_end: int | None = None
        self.vision_seen = False  # some turn held visual tokens
        # Time spent on scores since the last pop_score_time(). With measure_overhead (benchmarks), it is
        # the cost beyond plain SDPA, found by also running SDPA on the window queries (probe_s).
        self.score_s = self.probe_s = 0.0
        self.measure_overhead = False
        # recall (see recall.py): turn ids per token, window scores for every turn, captured queries
        self.track_turns = False
        self.turn = 0
        self.recall_window = 0
        self.probe_layers: int | None = None  # a probe forward stops before this layer
        if budgets is not None:
            for budget in budgets:
                policy.check(budget)

    @classmethod
    def for_model(cls, model, policy: PolicySpec | Policy | str = "inf_mllm", budget=None, batch: int = 1,
                  static: bool = True, **options):
        """Build a cache for `model`; `budget` is tokens, bytes ("512MB") or a per-layer list."""
        if not isinstance(policy, Policy):
            policy = build(as_spec(policy, **options))
        inv_freq = rope_inv_freq(model)
        shape = KVShape.from_config(model.config, torch.finfo(model.dtype).bits // 8, batch)
        budgets = layer_budgets(budget, shape) if type(policy).name != "full" else None
        if policy.all_observers() or not isinstance(policy.allocator, Uniform):
            use_observing_attention(model)  # also slices the causal mask for layers of different lengths
        return cls(policy, budgets, inv_freq, shape.num_layers, static, multimodal_rope(model))

    def enable_recall(self, model, window: int) -> None:
        """Track which turn each token came from and observe every turn's window (recall needs both)."""
        self.track_turns, self.recall_window = True, window
        if not any(obs.key in ("window", "acc") for obs in self.observers):  # recall reads the window scores
            self.observers.append(WindowObserver(window=window))
        use_observing_attention(model)

    @property
    def is_decoding(self) -> bool:
        return self.phase == "decode"

    @contextmanager
    def decode_step(self):
        """Mark the one forward inside as a decode step: it neither opens a new turn nor refreshes the
        window scores. Scoped to that forward, so a paused answer leaves the cache in the prompt phase."""
        self.phase = "decode"
        # found once per step, not per layer: Inf-MLLM's window observer skips decode steps, and a step of a
        # layer nothing observes goes straight to SDPA, as streaming_llm's does
        self.decode_observers = [obs for obs in self.observers if obs.queries(self.layers[0], 1, True)]
        try:
            yield self
        finally:
            self.phase = "prompt"

    def announce_vision(self, end: int | None) -> None:
        """The next prompt's tokens up to index `end` (exclusive) end with its last visual token (None: a
        text turn). VL-Cache's post-vision queries are the tokens after it."""
        self.vision_end = end
        self.vision_seen = self.vision_seen or end is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The position the next token takes: the same for every layer, whatever each one holds."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is None or not layer.is_initialized:
            return 0
        return layer.start + layer.get_seq_length()

    @property
    def rope_end(self) -> int:
        """Multimodal RoPE: the position the next token takes (get_seq_length counts stored tokens there)."""
        return self.layers[0].end if self.layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

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
        # multimodal RoPE: every layer's units close up to end where the longest layer's do
        rope_end = max(layer.extent(plan) for layer, plan in zip(self.layers, plans, strict=True)) \
            if self.multimodal else None
        for layer, plan, k in zip(self.layers, plans, kept, strict=True):
            layer.apply(plan, reducer, end - k, rope_end)

    @property
    def layer_budgets(self) -> list[int] | None:
        """What each layer was last allocated (the nominal budgets before the first eviction)."""
        if self.budgets is None:
            return None
        pairs = zip(self.layers, self.budgets, strict=True)
        return [layer.budget if layer.budget is not None else b for layer, b in pairs]

    def pop_score_time(self) -> tuple[float, float]:
        """(score seconds, probe seconds) since the last call; probe time is measurement, not work."""
        spent, self.score_s, probe, self.probe_s = self.score_s, 0.0, self.probe_s, 0.0
        return spent, probe

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
