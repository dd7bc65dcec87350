"""One layer of the streaming cache: its K/V in buffers written in place, what its observers recorded, and the
moves an eviction, a merge, a linked block or a rollback make.

Where the tokens sit is the layer's position strategy (`pos`, positions.py: 1-D or multimodal RoPE), chosen
once by the cache; what is kept per token besides K/V (turn ids for recall, lasting statistics) follows the
tokens through every move. Elastic's merge, the other reducer, is merge.py.
"""

import copy
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from .buffer import KVBuffer
from .merge import merge
from .observers import Statistics
from .policies import LayerView, Policy
from .rope import rerotate
from .scoring import window_scores


class ProbeDone(Exception):
    """Ends a probe forward (`Forward.probe_until`) once its last wanted layer has run. An exception, as the loop over
    the decoder's layers is the model's own (transformers'): nothing the cache returns can end it, and running the
    first layers by hand would mean knowing every family's forward."""


SCATTERED = "scattered"  # `linked`: the linked tokens are somewhere, moved by an eviction or merge that split them


@dataclass(frozen=True)
class LayerSetup:
    """What every layer of one cache shares, fixed when the cache is built. It refers to nothing that refers back to
    a layer, so a layer is freed by reference counting alone once its cache lets go of it."""

    static: bool  # K/V in preallocated buffers written in place (False: transformers' torch.cat)
    rope: type  # the position strategy (positions.py)
    track_turns: bool  # every token's turn kept (recall)
    inv_freq: torch.Tensor
    rotations: object  # positions.RotationTable
    statistics: dict  # what the observers record, declared (observers.declared)
    policy: Policy


class StreamingLayer(DynamicLayer):
    """One layer's K/V plus what its observers recorded (`stats`), evicted or merged when told.

    Its tokens sit at contiguous positions start..start+len-1; `start` is 0 unless budgets differ per
    layer, where every layer ends at the same position (the cache's `get_seq_length`), so the model's
    position ids and causal mask fit all layers (the attention function slices the mask per layer).

    `turn_ids` (B, H, n), kept when the cache tracks turns (recall), says which turn each token came from;
    linked (recalled) tokens carry -1 - span id, and `linked` says where they sit, (index, count), so taking
    them out needs no look at the device (`SCATTERED`: somewhere, after a move that did not keep them together)."""

    def __init__(self, layer_idx: int, setup: LayerSetup):
        # K/V and what is kept per token live in preallocated buffers (buffer.py), set before the base class
        # sets keys; every `self.keys = ...`, `self.turn_ids = ...` below writes into them
        self._k, self._v, self._ids = (KVBuffer(setup.static) for _ in range(3))
        super().__init__()
        self.layer_idx = layer_idx
        self.setup = setup
        # its positions and statistics refer back to it weakly: no cycle keeps a released layer's buffers alive
        self.pos = setup.rope(weakref.proxy(self))
        self.stats = Statistics(weakref.proxy(self))
        self.prompt_len = 0
        self.start = 0
        self.budget: int | None = None  # the last budget its allocator gave it
        self.linked: tuple[int, int] | None = None
        self._wants: list = []  # (observer, queries) for the forward under way

    def __deepcopy__(self, memo):
        """A copy (a benchmark's clone of a cache) whose positions and statistics refer, weakly, to the copy."""
        other = self.__class__.__new__(self.__class__)
        memo[id(self)] = other
        other.__setstate__({key: copy.deepcopy(value, memo) for key, value in vars(self).items()})
        return other

    def __setstate__(self, state: dict) -> None:
        """Unpickled (a benchmark's checkpoint): its positions and statistics point back at it, weakly, again."""
        vars(self).update(state)
        self.pos.layer = self.stats.layer = weakref.proxy(self)

    keys = property(lambda self: self._k.get(), lambda self, value: self._k.set(value))
    values = property(lambda self: self._v.get(), lambda self, value: self._v.set(value))
    turn_ids = property(lambda self: self._ids.get(), lambda self, value: self._ids.set(value))

    @property
    def base(self) -> torch.Tensor | None:
        """Multimodal RoPE: each token's unit base (None under 1-D RoPE)."""
        return getattr(self.pos, "base", None)

    def update(self, key_states, value_states, forward):
        """Append this forward's new K/V (`forward`: the `cache.Forward` under way, which the cache passes down as
        transformers passes `cache_kwargs`)."""
        if forward.probe_until is not None and self.layer_idx >= forward.probe_until:
            raise ProbeDone  # the probe has the keys it needs: the deeper layers need not run
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if forward.rewrite is not None:
            key_states, value_states, copies = self._rewrite(forward, key_states, value_states)
            if copies is not None:
                return copies
        keys, values = self._k.append(key_states), self._v.append(value_states)
        new = key_states.shape[-2]
        if not forward.decoding:
            self.prompt_len = new
        self._grew(new, forward)
        return keys, values

    def _rewrite(self, forward, key_states, value_states):
        """The forward's first tokens are recomputed linked tokens (MPIC's selective attention: the stored block is
        the dummy cache their fresh K/V replace rows of): written over those rows, the rest left to append. A probe
        keeps the cache as it was: the rows are replaced in a copy, which its attention reads (and `fresh` keeps); its
        forward holds those rows alone."""
        s = forward.rewrite.numel()
        at = self.linked[0] + forward.rewrite
        k, v = key_states[:, :, :s], value_states[:, :, :s]
        if forward.probe_until is not None:
            forward.fresh[self.layer_idx] = (k, v)
            keys, values = self.keys.clone(), self.values.clone()
            keys[:, :, at], values[:, :, at] = k, v
            return None, None, (keys, values)
        self.keys[:, :, at], self.values[:, :, at] = k, v
        return key_states[:, :, s:], value_states[:, :, s:], None

    def written(self, new: int, forward) -> None:
        """`new` rows were written into the buffers past the cache by a compiled decode step (compiled.py)."""
        self._k.n += new
        self._v.n += new
        self._grew(new, forward)

    def _grew(self, new: int, forward) -> None:
        """What the layer keeps per token besides K/V, grown by the `new` tokens just appended."""
        if self.setup.track_turns:
            keys = self.keys
            self._ids.append(torch.full((*keys.shape[:2], new), forward.turn, dtype=torch.long, device=keys.device))
        self.pos.place(new, forward.incoming)
        self.stats.grow(new)

    def window_len(self, q_len: int, forward) -> int:
        """How many of `forward`'s last queries the observers want scored (0: none)."""
        self._wants = [(obs, obs.queries(forward, q_len)) for obs in forward.observers]
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
            obs.record(self.stats, own, want, None if query is None else query[:, :, -want:], keys, scaling)

    def view(self) -> LayerView:
        return LayerView(self.get_seq_length(), self.prompt_len, self.keys.shape[1], dict(self.stats))

    def has_scores(self, policy: Policy) -> bool:
        """Whether the statistics `policy` ranks by are current (not spent by an eviction, nor stale once answer
        tokens came in)."""
        n = self.get_seq_length()
        return all(self.stats.current(obs.key, n) for obs in policy.observers())

    # --- moves ------------------------------------------------------------------------------------

    def apply(self, idx: torch.Tensor | None, reducer: str, start: int, end: int | None = None) -> None:
        """Reduce to the sorted indices idx (None: keep all), then sit at positions start..start+K-1 (under
        multimodal RoPE: stored from `start`, the kept units closing up to end at `end`)."""
        if idx is None:
            if start != self.start or (end is not None and end != getattr(self.pos, "end", end)):
                self.shift(start, end)
            return
        if reducer == "merge":
            self.merge(idx, start, end)
        else:
            self.keep(idx, start, end)
        self.stats.spend()

    def keep(self, idx: torch.Tensor, start: int | None = None, end: int | None = None) -> None:
        """Keep the tokens at sorted indices idx, (B, K) or (B, H, K), re-rotated to positions start..start+K-1
        (start: unchanged by default; multimodal RoPE: units closed up to end at `end`, by default where they
        end when they close up towards the first one)."""
        start = self.start if start is None else start
        b, h = self.keys.shape[:2]
        idx = idx.to(self.keys.device)
        # one index set for all heads stays (B, 1, K): its shifts and rotation angles are computed once per token
        idx = idx[:, None, :] if idx.dim() == 2 else idx
        self.pos.keep(self._k.take(idx), idx, start, end)
        self.values = self._v.take(idx)
        for key, value in self.stats.lasting():
            self.stats.put(key, value.gather(-1, idx.expand(b, h, -1)))
        if self.turn_ids is not None:
            self.turn_ids = self._ids.take(idx)
        self.start = start
        if self.linked is not None:
            self.linked = SCATTERED

    def merge(self, idx: torch.Tensor, start: int, end: int | None = None) -> None:
        """Elastic Cache's merge down to the anchors at idx (merge.py)."""
        merge(self, idx, start, end)

    def shift(self, start: int, end: int | None = None) -> None:
        """Move every token by start - self.start positions (budgets that differ per layer); under multimodal
        RoPE, stored from `start` and moved by end - self.end positions."""
        self.pos.shift(start, end)
        self.start = start

    def insert(self, at: int, keys: torch.Tensor, values: torch.Tensor, tags: torch.Tensor,
               moves: torch.Tensor, bases: torch.Tensor | None = None, recalled: bool = True) -> None:
        """Link a stored block (B, H, m, d) in at index `at`: token j's key is rotated by moves[j] plus where the
        block begins (`moves`, (m,) on the host: where it sits in the block less where it sits as stored), so it
        is rotated once; the tokens after it move right by its extent (keys re-rotated), so positions stay
        contiguous. Under multimodal RoPE, `bases` (m + 1,) holds the block's unit bases from 0 and then its
        extent. A `recalled` block is remembered (`linked`) to be taken out again."""
        if not self.is_initialized:  # nothing cached before it (a restored session that opens with no turn)
            self.lazy_initialization(keys, values)
        m, (b, h), n = keys.shape[2], keys.shape[:2], self.get_seq_length()
        inv_freq = self.setup.inv_freq
        to, shift = self.pos.open(at, bases, m)
        if isinstance(to, int) and not to and not bool(moves.any()):
            block = keys
        else:
            block = rerotate_by(keys.to(self.keys), to, moves.to(self.keys.device), inv_freq)
        tail = None  # what follows the block moves right by its extent (at the end: nothing)
        if at < n:
            tail = rerotate(self.keys[:, :, at:], torch.full((1, 1, n - at), shift, device=keys.device), inv_freq)
        self._k.insert(at, block.to(self.keys.dtype), tail)
        self._v.insert(at, values.to(self.values))
        if self.setup.track_turns:
            self._ids.insert(at, tags.to(self.keys.device).expand(b, h, m))
        self.stats.insert(at, m)
        if recalled:
            self.linked = (at, m) if self.linked is None else SCATTERED

    def unlink(self) -> None:
        """Take the linked (recalled) tokens out; the rest close up to contiguous positions."""
        if self.linked is None:
            return
        if self.linked is SCATTERED or self.pos.multimodal:  # moved since (find them), or units to close up
            ids = self.turn_ids
            self.keep((ids[:, 0] >= 0).nonzero()[:, 1][None])  # linking is uniform over heads and batch 1
        else:  # the tokens after the block move up by its length: nothing before it is touched
            at, m = self.linked
            after = self.get_seq_length() - at - m
            tail = self.pos.moved(self.keys[:, :, at + m:], torch.full((1, 1, after), -m, device=self.keys.device),
                                  self.start) if after else None
            self._k.cut(at, m, tail)
            self._v.cut(at, m)
            if self.turn_ids is not None:
                self._ids.cut(at, m)
            self.stats.cut(at, m)
        self.linked = None

    # --- buffers and rollback ---------------------------------------------------------------------

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers (B, H, capacity, D): the layer's tokens are their first rows."""
        return self._k.buf, self._v.buf

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Move K/V into the given buffers (a slot of the arena, slots.py, or copies of its own)."""
        self._k.adopt(keys)
        self._v.adopt(values)

    @property
    def capacity(self) -> int:
        return self._k.capacity

    @property
    def least(self) -> int:
        """The fewest rows a buffer of this layer allocates (what `reserve` asked)."""
        return self._k.least

    def keys_from(self, n: int, make) -> None:
        """The layer's keys become `make(out)`'s n rows: written in place at the front of its buffer when the rows
        there were just taken (`out`), else a new tensor (`out` None)."""
        front = self._k.front(n)
        with self._k.writing() if front is not None else nullcontext():
            self.keys = make(front)

    def fit(self) -> None:
        """Give back the buffer capacity a larger budget had reserved."""
        self._k.fit()
        self._v.fit()

    def reserve(self, rows: int) -> None:
        """Every buffer of the layer takes at least `rows` rows when it allocates."""
        for buf in (self._k, self._v, self._ids, *self.pos.buffers(), *self.stats.buffers()):
            buf.reserve(rows)

    def mark(self) -> tuple:
        """What `rollback` needs to undo the forwards that follow (a probe, or a turn that failed)."""
        return self.get_seq_length(), self.prompt_len, self.stats.mark(), self.start, self.pos.mark(), self.linked

    def rollback(self, mark: tuple) -> None:
        n, self.prompt_len, stats, self.start, pos, self.linked = mark
        self.stats.restore(stats)
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        if self.turn_ids is not None:
            self.turn_ids = self.turn_ids[..., :n]
        self.pos.rollback(pos, n)

    def positions(self, first: int) -> torch.Tensor:
        """The positions of the tokens from index `first` on, (rows, L)."""
        return self.pos.positions(first)


def rerotate_by(keys: torch.Tensor, to, moves: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys rotated by `to` (an int, or (B, rows, 1) unit bases) plus each token's own move (m,)."""
    if isinstance(to, int):
        delta = (moves + to)[None, None]
    else:
        delta = to + moves[None, None]
    return rerotate(keys, delta, inv_freq)
