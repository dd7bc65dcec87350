"""The span store's summaries, stacked for scoring (recall.span_scores reads them all at once).

Each summary key is kept as scoring reads it, in fp32 and of unit length: normalising the fp16 summaries of
1,000 spans at every question took ~40 ms on 2 CPU cores, more than scoring them."""

import torch


class SummaryStack:
    """Every span's summary, unit keys in fp32, stacked once and grown in place (capacity doubling), with each id's
    row in a dict: an add copies one summary, a lookup is O(1), scoring reads one tensor. A drop, or an id out of
    order, leaves the stack to be rebuilt (in id order) at the next read."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.row: dict[int, int] = {}  # id -> row, in id order unless `dirty`
        self.count = 0  # rows used
        self.dirty = False

    def add(self, span) -> None:
        summary = torch.nn.functional.normalize(span.summary.float(), dim=-1)
        if span.id in self.row or (self.row and span.id < next(reversed(self.row))):
            self.dirty = True  # a replaced row is left as a hole
        if self.data is None:
            self.data = summary.new_empty((16, *summary.shape))
        elif self.count == self.data.shape[0]:
            grown = self.data.new_empty((2 * self.count, *self.data.shape[1:]))
            grown[:self.count] = self.data
            self.data = grown
        self.data[self.count] = summary
        self.row[span.id] = self.count
        self.count += 1

    def drop(self, span_id: int) -> None:
        if self.row.pop(span_id, None) is not None:
            self.dirty = True

    def all(self) -> tuple[list[int], torch.Tensor | None]:
        """Ids in id order and their stacked unit summaries (N, layers, Hkv, r, d), fp32."""
        if self.dirty:
            ids = sorted(self.row)
            rows = torch.stack([self.data[self.row[i]] for i in ids]) if ids else None
            self.data = None if rows is None else torch.cat([rows, rows.new_empty(rows.shape)])
            self.row, self.count, self.dirty = {i: j for j, i in enumerate(ids)}, len(ids), False
        return list(self.row), (self.data[:self.count] if self.row else None)

    def rows(self, span_ids: list[int]) -> torch.Tensor:
        self.all()
        return torch.tensor([self.row[i] for i in span_ids], dtype=torch.long)
