"""A layer's per-token rows (keys, values, or a statistic kept per token) in a preallocated buffer, written in
place (issue 23).

transformers' `DynamicLayer` appends by `torch.cat`: every decode step copies the whole layer into a new
tensor. A bounded cache has a known largest size (its budget plus the longest turn and answer), so its
K/V can live in a buffer of that capacity, the cache being the first `n` rows: a decode step writes one
row, an eviction writes the kept rows back to the front, and once the buffer has seen the longest turn
and answer nothing is allocated again (`transformers.StaticLayer` is the model). Capacity grows in steps
of `GRAIN` rows when a turn needs more; the full cache grows the same way. A session that knows its longest
turn and answer reserves them from the first write (`least`), so the buffers keep one shape for the whole
stream: one compile, one CUDA graph. What a layer keeps per token
besides K/V ((B, H, n): turn ids, accumulated attention, multimodal unit bases) grows by decode steps as
well, so it lives in the same kind of buffer: dimension 2 is always the token.
"""

import torch

GRAIN = 256


class KVBuffer:
    """`get()` is the cache (B, H, n, ...), a view of the buffer; `set(t)` makes `t` the cache, copying it
    into the buffer (a prefix of the buffer itself, as a rollback gives, only moves `n`); `append(t)` adds
    rows after the last. `static=False` keeps the dynamic layer's behaviour (a new tensor each time), for
    comparison in the same run."""

    def __init__(self, static: bool = True):
        self.static = static
        self.buf: torch.Tensor | None = None
        self.n = 0
        self.empty: torch.Tensor | None = None  # what transformers' lazy initialisation sets before any row
        self.least = 0  # rows any allocation takes at least (StreamingCache.reserve)
        self._first, self._rows = None, 0  # `take`'s first row of each head, for a buffer of `_rows` rows

    def get(self) -> torch.Tensor | None:
        if self.buf is None:
            return self.empty
        return self.buf[:, :, :self.n] if self.static else self.buf

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[2]

    def set(self, value: torch.Tensor | None) -> None:
        if value is None or value.dim() < 3:  # transformers' lazy initialisation sets an empty 1-D tensor
            self.buf, self.n, self.empty = None, 0, value
            return
        if not self.static:
            self.buf, self.n = value, value.shape[2]
            return
        if self._is_prefix(value):
            self.n = value.shape[2]
            return
        if self.buf is not None and value.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr():
            value = value.clone()  # another view of the buffer: copied before the buffer is written over
        n = value.shape[2]
        if not self._fits(value, n):
            self._reserve(value, n, keep=0)
        self._write(0, value)
        self.n = n

    def append(self, new: torch.Tensor) -> torch.Tensor:
        if not self.static:
            self.set(new if self.buf is None else torch.cat([self.buf, new], dim=2))
            return self.get()
        n = self.n + new.shape[2]
        if not self._fits(new, n):
            self._reserve(new, n, keep=self.n)
        self._write(self.n, new)
        self.n = n
        return self.get()

    def insert(self, at: int, rows: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        """`rows` put in at index `at`, the rows after them moved down (or replaced by `tail`, what they become): at
        the end, an append; nothing before `at` is touched."""
        n = self.n
        if not self.static:
            cur = self.get()
            self.set(rows if self.buf is None else
                     torch.cat([cur[:, :, :at], rows, cur[:, :, at:] if tail is None else tail], dim=2))
            return
        moved = None if at == n else (self.buf[:, :, at:n].clone() if tail is None else tail)
        m = rows.shape[2]
        if not self._fits(rows, n + m):
            self._reserve(rows, n + m, keep=n)
        self._write(at, rows)
        if moved is not None:
            self._write(at + m, moved)
        self.n = n + m

    def cut(self, at: int, m: int, tail: torch.Tensor | None = None) -> None:
        """Rows at..at+m-1 taken out, the rows after them moved up (or replaced by `tail`, what they become)."""
        n = self.n
        if not self.static:
            cur = self.get()
            self.set(torch.cat([cur[:, :, :at], cur[:, :, at + m:] if tail is None else tail], dim=2))
            return
        if at + m < n:
            self._write(at, self.buf[:, :, at + m:n].clone() if tail is None else tail)
        self.n = n - m

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """The cache's rows at indices idx (B, 1 or H, K), every head its own: one `index_select` over the
        buffer's rows (B·H·capacity, D), several times faster on a CPU than `torch.gather` with an index
        expanded over D, which reads the index as often as the data."""
        buf = self.get() if not self.static else self.buf
        (b, h, rows), tail = buf.shape[:3], buf.shape[3:]
        if not buf.is_contiguous():
            return buf.gather(2, idx.expand(b, h, -1).view(b, h, -1, *(1,) * len(tail)).expand(b, h, -1, *tail))
        first = self._first
        if first is None or first.shape[:2] != (b, h) or first.device != idx.device or self._rows != rows:
            first = self._first = torch.arange(b * h, device=idx.device).view(b, h, 1) * rows  # each head's first row
            self._rows = rows
        return buf.view(b * h * rows, *tail).index_select(0, (first + idx).reshape(-1)).view(b, h, -1, *tail)

    def adopt(self, buf: torch.Tensor) -> None:
        """Keep the rows in `buf` from now on (a slot of a pool's arena, slots.py, or a copy of one), the cache's
        rows copied in; its capacity becomes the least any later allocation takes."""
        if self.buf is not buf:
            with torch.inference_mode(torch.is_inference(buf)):
                buf[:, :, :self.n].copy_(self.buf[:, :, :self.n])
        self.buf, self.least = buf, max(self.least, buf.shape[2])

    def front(self, n: int) -> torch.Tensor | None:
        """The buffer's first n rows, to be written (inside `writing()`) and then `set` as the cache (a prefix: no
        copy); None when the layer is dynamic or the buffer too small."""
        if not self.static or self.buf is None or n > self.capacity:
            return None
        return self.buf[:, :, :n]

    def writing(self):
        """The mode the buffer is written in: a buffer made under inference mode (every session's forward) can
        only be written there."""
        return torch.inference_mode(self.buf is not None and torch.is_inference(self.buf))

    def reserve(self, rows: int) -> None:
        """At least `rows` rows from now on (`least`), grown to at once if the buffer holds fewer."""
        self.least = rows
        if self.static and self.buf is not None and self.capacity < rows:
            self._reserve(self.buf, self.n, keep=self.n)

    def fit(self) -> None:
        """Give back the capacity beyond the cache's rows and `least` (rounded up to GRAIN): after a budget is
        tightened."""
        if self.static and self.buf is not None and self.capacity > _rounded(max(self.n, self.least, 1)):
            rows = self.get().clone()
            self.buf = None
            self.set(rows)

    def _is_prefix(self, value) -> bool:
        b = self.buf
        return (b is not None and value.data_ptr() == b.data_ptr() and value.stride() == b.stride()
                and value.shape[:2] == b.shape[:2] and value.shape[3:] == b.shape[3:])

    def _fits(self, like: torch.Tensor, n: int) -> bool:
        b = self.buf
        return (b is not None and n <= b.shape[2] and b.shape[:2] == like.shape[:2]
                and b.shape[3:] == like.shape[3:] and b.dtype == like.dtype and b.device == like.device)

    def _reserve(self, like: torch.Tensor, n: int, keep: int) -> None:
        """A new buffer for at least n rows, shaped like `like`, with the first `keep` rows of the old one."""
        (b, h), tail = like.shape[:2], like.shape[3:]
        # zeros, not empty: a compiled decode step (compiled.py) reads the rows past the cache, masked, and a
        # masked NaN still poisons attention (0 × NaN)
        grown = like.new_zeros((b, h, _rounded(max(n, self.least)), *tail))
        if keep:
            grown[:, :, :keep].copy_(self.buf[:, :, :keep])
        self.buf = grown

    def _write(self, at: int, rows: torch.Tensor) -> None:
        with self.writing():
            self.buf[:, :, at:at + rows.shape[2]].copy_(rows)


def _rounded(rows: int) -> int:
    return -(-rows // GRAIN) * GRAIN
