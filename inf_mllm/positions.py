"""Positions for models whose tokens do not take one position each (Qwen-VL's multimodal RoPE).

With 1-D RoPE every token is one position, so a layer's tokens sit at start..start+n-1 and nothing more
need be kept (cache.py). Multimodal RoPE gives each token three position ids (time, height, width); a
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
