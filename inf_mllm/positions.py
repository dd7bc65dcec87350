"""Where a layer's tokens sit, as a strategy the cache chooses once: `LinearRoPE` (1-D RoPE) or
`MultimodalRoPE` (Qwen-VL's). A layer (layer.py) asks its strategy whenever its tokens move: kept, merged,
shifted, a stored block opened into it, rolled back; the strategy re-rotates the keys.

With 1-D RoPE every token is one position, so a layer's tokens sit at start..start+n-1 and nothing more
need be kept. Multimodal RoPE gives each token three position ids (time, height, width); a
vision block of N tokens at base b has ids b + (t, h, w) offsets and advances the next token's position
by its *extent* (max(h, w) grid cells for Qwen2-VL), not by N. So the cache keeps, per token, the base of
its *unit*: a text token is a unit of extent 1, a vision block one unit. Units tile the positions from
the first kept unit's base to the layer's end without gaps, so a unit's extent is the next unit's base
minus its own.

Re-assigning positions then moves whole units: after an eviction each unit with a kept token keeps its
extent, the kept units close up in order and end at the cache's end, and every token of a unit moves by
the same shift. A shift that is the same on the three axes rotates every rotary dimension by the same
angle as a 1-D shift would (each dimension's angle is its axis's position times its frequency), so the
1-D re-rotation of rope.py moves multimodal keys exactly, and the geometry inside a vision block is
kept.
"""

from dataclasses import dataclass

import torch

from .rope import rerotate


@dataclass
class TurnPositions:
    """A turn's position ids relative to its first token: `ids` (axes, L), each token's unit base
    `base` (L,), and `extent`, the positions the turn advances the next one by."""

    ids: torch.Tensor
    base: torch.Tensor
    extent: int

    @classmethod
    def text(cls, length: int) -> "TurnPositions":
        ar = torch.arange(length)
        return cls(ar.expand(3, length), ar, length)

    def after(self, held: int) -> "TurnPositions":
        """The turn with `held` text tokens (a held-back answer token) in front of it."""
        if not held:
            return self
        head = torch.arange(held)
        ids = torch.cat([head.expand(self.ids.shape[0], held), self.ids + held], dim=1)
        return TurnPositions(ids, torch.cat([head, self.base + held]), self.extent + held)


def extents(base: torch.Tensor, end: int) -> torch.Tensor:
    """Each token's unit extent, from the tiling: the next unit's base (or `end`) minus its own. `base`
    (..., n) is non-decreasing along its last axis."""
    base = base.contiguous()
    after = torch.searchsorted(base, base, right=True)  # the first token of the next unit
    padded = torch.cat([base, base.new_full((*base.shape[:-1], 1), end)], dim=-1)
    return padded.gather(-1, after) - base


def compact(base: torch.Tensor, end: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept tokens' units closed up, relative to where the first one will sit: (old base of each kept
    token, its new base counted from 0, each row's total extent). `base` (B, g, n), `idx` (B, g', K) sorted."""
    rows = max(base.shape[1], idx.shape[1])
    b = base.expand(base.shape[0], rows, -1)
    idx = idx.expand(idx.shape[0], rows, -1)
    old = b.gather(-1, idx)
    ext = extents(b, end).gather(-1, idx)
    first = torch.ones_like(old, dtype=torch.bool)
    first[..., 1:] = old[..., 1:] != old[..., :-1]
    taken = ext * first
    return old, taken.cumsum(-1) - ext, taken.sum(-1)


class LinearRoPE:
    """1-D RoPE: a layer's i-th token sits at `start` + i, so the layer's start is all there is to keep. Kept keys
    are re-rotated through the cache's table of shifts (`rope.RotationTable`)."""

    multimodal = False

    def __init__(self, layer):
        self.layer = layer

    def __getstate__(self) -> dict:
        """Pickled without its layer, which points it back at itself when unpickled (`StreamingLayer.__setstate__`)."""
        return {k: v for k, v in vars(self).items() if k != "layer"}

    # --- what the cache asks once per forward or eviction ----------------------------------------

    @staticmethod
    def turn(cache, length: int, positions: TurnPositions | None, held: int, batch: int, device) -> tuple[dict, None]:
        """The model's default position ids (arange + cache length) are right: nothing to pass, nothing to announce."""
        return {}, None

    @staticmethod
    def common_end(layers, plans) -> None:
        return None

    @staticmethod
    def span(cache, length: int) -> tuple[list[int], torch.Tensor, None]:
        """The last `length` tokens of every layer: the position each layer holds the first at, their offsets
        from it, and (multimodal only) their unit bases and extent."""
        return [layer.start + layer.get_seq_length() - length for layer in cache.layers], torch.arange(length), None

    # --- the layer's tokens moving ---------------------------------------------------------------

    def place(self, new: int, incoming) -> None:
        pass

    def moved(self, keys: torch.Tensor, delta: torch.Tensor, start: int, out: torch.Tensor | None = None):
        """Keys re-rotated by `delta` as the layer's tokens move to sit from `start` (into `out` if given). A token
        never moves right by more than the start moved (only tokens before it drop out) nor left by more than
        the layer's length plus what the start moved back, so the bounds come from the host's counts, without
        reading `delta`."""
        layer = self.layer
        reach = layer.keys.shape[-2] + max(0, layer.start - start)
        return layer.setup.rotations.rotate(keys, delta, reach, forward=start > layer.start, out=out)

    def keep(self, keys: torch.Tensor, idx: torch.Tensor, start: int, end: int | None) -> None:
        """The layer's keys become `keys`, taken at idx (B, g, K), re-rotated to sit at start..start+K-1."""
        layer = self.layer
        delta = torch.arange(idx.shape[-1], device=idx.device) + (start - layer.start) - idx  # new - old position
        layer.keys_from(idx.shape[-1], lambda out: self.moved(keys, delta, start, out=out))

    def merged(self, keys, idx, bucket, pos, start: int, end: int | None) -> torch.Tensor:
        """All the layer's keys, each moved to where its bucket (`bucket`, (B, g, n)) will sit."""
        return self.moved(keys, bucket + (start - self.layer.start) - pos, start)

    def shift(self, start: int, end: int | None) -> None:
        layer = self.layer
        delta = torch.full((1, 1, layer.get_seq_length()), start - layer.start, device=layer.keys.device)
        layer.keys = self.moved(layer.keys, delta, start)

    def open(self, at: int, bases: torch.Tensor, m: int) -> tuple[int, int]:
        """Room for a block of m tokens at index `at`: where its first token sits, and how far the tokens after it
        move."""
        return self.layer.start + at, m

    def positions(self, first: int) -> torch.Tensor:
        """The positions of the tokens from index `first` on, (rows, L)."""
        layer = self.layer
        return (layer.start + torch.arange(first, layer.get_seq_length(), device=layer.keys.device))[None]

    def mark(self):
        return None

    def rollback(self, mark, n: int) -> None:
        pass

    def buffers(self) -> tuple:
        return ()


class MultimodalRoPE:
    """Multimodal RoPE (above): the layer also keeps each token's unit base (`base`, (B, 1 or H, n)) and the next
    position (`end`, the same in every layer); its start only aligns storage for the causal mask. Keys are
    re-rotated by `rope.rerotate` directly: shifts come from the units, not from a table of counts."""

    multimodal = True

    def __init__(self, layer):
        from .buffer import KVBuffer

        self.layer = layer
        self._base = KVBuffer(layer.setup.static)
        self.end = 0

    def __getstate__(self) -> dict:
        """Pickled without its layer, which points it back at itself when unpickled (`StreamingLayer.__setstate__`)."""
        return {k: v for k, v in vars(self).items() if k != "layer"}

    base = property(lambda self: self._base.get(), lambda self, value: self._base.set(value))

    @staticmethod
    def turn(cache, length: int, positions: TurnPositions | None, held: int, batch: int, device) -> tuple[dict, tuple]:
        """The forward's explicit position ids (axes, B, L), its turn placed at the cache's end, and what the layers
        keep of them (the tokens' unit bases and the next position), moved to the device once, not per layer."""
        turn = (positions or TurnPositions.text(length)).after(held)
        end = cache.rope_end
        incoming = ((turn.base + end).to(device), end + turn.extent)
        return {"position_ids": (turn.ids + end)[:, None].expand(-1, batch, -1).to(device)}, incoming

    @staticmethod
    def common_end(layers, plans) -> int:
        """Where every layer's kept units end after an eviction: where the longest layer's close up to."""
        return max(layer.pos.extent(plan) for layer, plan in zip(layers, plans, strict=True))

    @staticmethod
    def span(cache, length: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        top = cache.layers[0]
        turn = top.pos.base[0, 0, top.get_seq_length() - length:].cpu()  # the same in every layer
        start = int(turn[0])
        own = turn - start
        return [start] * len(cache.layers), own, torch.cat([own, torch.tensor([top.pos.end - start])])

    def place(self, new: int, incoming) -> None:
        """The new tokens' unit bases and the next position, as the forward announced them."""
        if incoming is None or incoming[0].shape[-1] != new:
            raise ValueError("a multimodal-RoPE forward needs its positions: pass the turn's position ids "
                             "through StreamSession (positions=)")
        base, self.end = incoming
        rows = 1 if self.base is None else self.base.shape[1]
        self._base.append(base.expand(self.layer.keys.shape[0], rows, new))

    def closed_up(self, idx: torch.Tensor, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept tokens' (old, new) unit bases, their units closed up to end at `end` (None: each row's first
        kept unit stays where it is, the rows ending together); sets base and end."""
        old, new, total = compact(self.base, self.end, idx)
        if end is None:
            end = int((old[..., 0] + total).max())
        new = new + (end - total)[..., None]
        self.base, self.end = new, end
        return old, new

    def keep(self, keys, idx, start, end) -> None:
        old, new = self.closed_up(idx, end)
        self.layer.keys = rerotate(keys, new - old, self.layer.setup.inv_freq)

    def merged(self, keys, idx, bucket, pos, start, end) -> torch.Tensor:
        """Each member moves as its anchor's unit does."""
        b, n = keys.shape[0], keys.shape[2]
        base = self.base
        _, new = self.closed_up(idx, end)
        rows = new.shape[1]
        moved = new.gather(-1, bucket.expand(b, rows, n)) - base.expand(b, rows, n)
        return rerotate(keys, moved, self.layer.setup.inv_freq)

    def shift(self, start, end) -> None:
        """Moved by end - self.end positions (stored from `start`, which the layer sets)."""
        layer = self.layer
        if end is not None and end != self.end:
            n = layer.get_seq_length()
            layer.keys = rerotate(layer.keys, torch.full((1, 1, n), end - self.end, device=layer.keys.device),
                                  layer.setup.inv_freq)
            self.base, self.end = self.base + (end - self.end), end

    def extent(self, idx: torch.Tensor | None) -> int:
        """The positions this layer's tokens (those at idx, if given) take when closed up."""
        if idx is None:
            return self.end - int(self.base[..., 0].min())
        idx = idx.to(self.base.device)
        return int(compact(self.base, self.end, idx[:, None, :] if idx.dim() == 2 else idx)[2].max())

    def open(self, at: int, bases: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
        """Room for a block of unit bases `bases` ((m + 1,): from 0, then its extent) at index `at`, which must begin
        a unit in every row; returns where the block's first unit sits, (B, rows, 1), and its extent."""
        # nothing cached yet (a restored session that opens with no turn): one row, as recall links at batch 1
        base = self.base if self.base is not None else torch.zeros((1, 1, 0), dtype=torch.long,
                                                                   device=self.layer.keys.device)
        bases, extent = bases[:-1].to(base.device), int(bases[-1])  # bases: host memory
        n = base.shape[-1]
        if 0 < at < n and bool((base[..., at] == base[..., at - 1]).any()):
            raise ValueError(f"cannot link a span at index {at}: it falls inside a vision block")
        to = base[..., at:at + 1] if at < n else base.new_full((*base.shape[:2], 1), self.end)
        self.base = torch.cat([base[..., :at], to + bases, base[..., at:] + extent], dim=-1)
        self.end += extent
        return to, extent

    def positions(self, first: int) -> torch.Tensor:
        """For the text tokens they are meant for (a question's keys), a token's unit base is its position."""
        return self.base[0, :, first:]

    def mark(self):
        return self.end

    def rollback(self, mark, n: int) -> None:
        self.end = mark
        if self.base is not None:
            self.base = self.base[..., :n] if n else None

    def buffers(self) -> tuple:
        return (self._base,)
