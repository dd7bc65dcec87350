"""Many streams' decode steps as one step on fixed shapes: each stream's K/V in a slot of one buffer per layer
(issue 46, item 2).

`compiled.py` compiles one session's decode step on its own buffers. A pool (pool.py) advances many answers at once,
and their caches are separate tensors, so that batched step (rows.py) runs eagerly, row by row in attention. Here
each stream's cache keeps its K/V in slot s of an arena, one tensor (slots, H, capacity, D) per layer: the cache's
buffers (buffer.py) become views of its slot, written in place as before. One forward then advances every slot:
slot s writes its new row at its own index `rows[s]`, its position is `rows[s]`, and a (slots, 1, 1, capacity)
mask hides the rows past it. The shapes never change, so `torch.compile` traces the step once per arena (a CUDA
graph on a GPU), and the weights are read once for all the streams.

A slot whose stream is not answering now still runs through the step: it writes one row at its first free index,
past its cache, which its next turn writes over (the lone step's `launch` without `commit` does the same), and its
logits are dropped. So the step costs the same with one answer in progress as with every slot's: the arena is
sized to the streams the pool expects, not to the most it could hold.

A cache stays in its slot while its buffers do: a turn that needs more rows than the slot has makes the buffer grow
out of it (buffer.py allocates), `holds` sees that, and the stream's steps go back to the eager batched forward.
"""

import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .compiled import CompiledDecode, failed


class SlotArena:
    """`slots` streams' K/V, one (slots, H, capacity, D) tensor per layer for keys and one for values, made at the
    first `bind` in that cache's buffers' shape (its capacity: its budget plus its reserved headroom)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.holders: list = [None] * slots  # the cache in each slot (None: free)
        self._views: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per slot, per layer: (keys, values)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def slot(self, cache) -> int | None:
        """The slot holding `cache`'s K/V now (None: none; a cache whose buffers grew out of its slot has left it)."""
        s = next((s for s, holder in enumerate(self.holders) if holder is cache), None)
        if s is None or self.holds(s):
            return s
        self.holders[s] = None  # its buffers left: the slot is free again
        return None

    def holds(self, s: int) -> bool:
        cache = self.holders[s]
        return cache is not None and all(mine is view for layer, views in zip(cache.layers, self._views[s], strict=True)
                                         for mine, view in zip(layer.buffers(), views, strict=True))

    def bind(self, cache) -> int | None:
        """Move `cache`'s K/V into a free slot (once; they stay there while its buffers keep their shape); None when
        no slot is free or its buffers do not fit the arena's shape."""
        s = self.slot(cache)
        if s is not None:
            return s
        buffers = cache.buffers()
        if not self.keys:
            self._allocate(buffers)
        if any(k is None or not _fits(k, self.keys[i]) or not _fits(v, self.values[i])
               for i, (k, v) in enumerate(buffers)) or len(buffers) != len(self.keys):
            return None
        free = [s for s in range(self.slots) if self.holders[s] is None or not self.holds(s)]
        if not free:
            return None
        s = free[0]
        for layer, (k, v) in zip(cache.layers, self._views[s], strict=True):
            layer.adopt(k, v)
        self.holders[s] = cache
        return s

    def unbind(self, cache) -> None:
        """`cache`'s K/V back in buffers of its own (a stream that leaves the pool, or a slot the step cannot write)."""
        s = self.slot(cache)
        if s is None:
            return
        for layer in cache.layers:
            layer.adopt(*(buf.clone() for buf in layer.buffers()))
        self.holders[s] = None

    def _allocate(self, buffers) -> None:
        for k, v in buffers:
            self.keys.append(k.new_zeros((self.slots, *k.shape[1:])))  # zeros: masked rows must not be NaN
            self.values.append(v.new_zeros((self.slots, *v.shape[1:])))
        self._views = [[(k[s:s + 1], v[s:s + 1]) for k, v in zip(self.keys, self.values, strict=True)]
                       for s in range(self.slots)]


def _fits(buf: torch.Tensor, arena: torch.Tensor) -> bool:
    return (buf.shape[0] == 1 and buf.shape[1] == arena.shape[1] and buf.shape[3:] == arena.shape[3:]
            and buf.shape[2] <= arena.shape[2] and buf.dtype == arena.dtype and buf.device == arena.device)


class SlotView(CacheLayerMixin):
    """Layer i of the arena in a slot step: slot s's new row written at `rows[s]`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.rows = keys, values, rows
        slots, heads = keys.shape[:2]
        self.slot_index = torch.arange(slots, device=keys.device)[:, None]  # (slots, 1) and (1, heads): with
        self.head_index = torch.arange(heads, device=keys.device)[None, :]  # rows (slots, 1), one row per slot·head
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("a SlotView is bound to the arena before the step")

    def update(self, key_states, value_states, *args, **kwargs):
        # an indexed write on the arena tensor itself, not on a view of it: the H100 run of a write through a
        # flattened view (fc71867) moved about a whole slot per layer per step, as if the arena were copied
        at = (self.slot_index, self.head_index, self.rows[:, None])
        self.keys.index_put_(at, key_states[:, :, 0])
        self.values.index_put_(at, value_states[:, :, 0])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> torch.Tensor:
        return self.rows[0]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotDecode:
    """One decode step for every slot of `arena` (the module docstring), compiled when `compile` (on a GPU with
    CUDA graphs and autotuned kernels, as the lone step; `mode` overrides), else run as is: the same step, for
    tests and for a CPU, where compiling gains nothing (benchmarks compiled_decode)."""

    def __init__(self, model, arena: SlotArena, compile: bool = True, mode: str | None = None):
        self.model, self.arena = model, arena
        self.compile, self.mode = compile, mode
        self.steps = 0  # steps run, and the answer rows they advanced
        self.rows_advanced = 0
        self.failed: str | None = None  # why the step failed once: the pool decodes eagerly from then on
        self.timings: list[float] | None = None  # a benchmark's: each step's seconds, the device waited for
        # the fewest answer rows a step runs for (fewer: the caller's eager rows). The step carries every slot; on a
        # GPU an idle slot's row costs little beside the weights' read, but run as is on a CPU a linear's time grows
        # with its rows, and one eager row beat 4 slots (SmolLM2, 2 cores: 87 against 121 ms; 4 rows 150 against
        # 121), so there it runs only when every slot answers
        self.min_rows = 1 if compile else arena.slots
        self._forward = None
        self.view: Cache | None = None

    def _build(self) -> None:
        arena, device = self.arena, self.arena.keys[0].device
        self.rows = torch.zeros(arena.slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(arena.slots, 1, dtype=torch.long, device=device)
        self.columns = torch.arange(arena.capacity, device=device)
        self.view = Cache(layers=[SlotView(k, v, self.rows) for k, v in zip(arena.keys, arena.values, strict=True)])
        if device.type == "cuda":  # CUDA graphs replay on fixed addresses
            for t in [*arena.keys, *arena.values, self.rows, self.tokens]:
                torch._dynamo.mark_static_address(t)
        self._forward = self._step
        if self.compile:
            mode = self.mode or ("max-autotune" if device.type == "cuda" else None)
            self._forward = torch.compile(self._step, dynamic=False, mode=mode)

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.rows  # the views' too: one tensor, written before each step
        mask = (self.columns[None, :] <= rows[:, None])[:, None, None, :]
        return self.model(input_ids=tokens, past_key_values=self.view, attention_mask=mask,
                          position_ids=rows[:, None], cache_position=rows[:1], use_cache=True,
                          logits_to_keep=1).logits[:, -1]

    def plain(self, cache) -> bool:
        """Whether `cache`'s decode steps can run here (`CompiledDecode.why_not`, and a slot for it)."""
        return not self.failed and CompiledDecode.why_not(cache) is None and self.arena.bind(cache) is not None

    def run(self, caches: list, tokens: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each cache's logits (1, V) after its token (1,), written into its slot and counted (`cache.written`);
        None when the step cannot run (a cache out of its slot or without a free row, or the step failed) or would
        not pay (fewer than `min_rows`): nothing was committed, and the caller runs those rows eagerly (on their
        slots' buffers)."""
        if self.failed or len(caches) < self.min_rows:
            return None
        arena = self.arena
        slots = [arena.slot(cache) for cache in caches]
        if any(s is None or cache.free_rows() <= 0 for s, cache in zip(slots, caches, strict=True)):
            return None
        if self._forward is None:
            self._build()
        rows = [0] * arena.slots
        ids = [0] * arena.slots
        for s, holder in enumerate(arena.holders):  # each slot writes past its cache (one that left it: anywhere)
            if holder is not None:
                n = holder.layers[0].get_seq_length()
                if n < arena.capacity:
                    rows[s] = n
                else:  # an idle stream with no row to spare: out of the arena, not overwritten
                    arena.unbind(holder)
        for s, token in zip(slots, tokens, strict=True):
            ids[s] = int(token[0])
        self.rows.copy_(torch.tensor(rows))
        self.tokens.copy_(torch.tensor(ids)[:, None])
        if self.timings is not None:
            _sync(self.rows.device)
            t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = self._forward(self.tokens)
        except Exception as err:  # noqa: BLE001 - no compiler here, an op it cannot trace...: rows past every cache
            self.failed = failed("the pool's slot decode step", err)
            return None
        taken = logits[slots]  # a copy: a CUDA graph's output is overwritten at its next replay
        out = [taken[i:i + 1] for i in range(len(slots))]
        if self.timings is not None:
            _sync(self.rows.device)
            self.timings.append(time.perf_counter() - t0)
        for cache in caches:
            cache.written(1)
        self.steps += 1
        self.rows_advanced += len(caches)
        return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
