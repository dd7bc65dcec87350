"""A store of turns' KV, position-independent, so an evicted turn can be linked back later (MPIC).

Every stored turn (a *span*) keeps its keys de-rotated to its own positions 0..k-1, its values, and
a small summary for scoring: per layer and KV head, `r` representative keys with RoPE removed
(picked by the attention the turn's own window paid them, as InfLLM picks block representatives).
Summaries always stay in RAM; the KV lives in a RAM tier with a byte cap and, when the store has a
folder, in safetensors files written through on arrival (atomic rename, SHA-256 checked on load),
so a session survives a restart. Both tiers drop their least recently used spans past their caps;
a disk that fills up degrades the store to RAM only, with one warning.
"""

import errno
import hashlib
import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load, save

from .budget import parse_bytes


@dataclass
class Span:
    id: int
    length: int
    summary: torch.Tensor  # (layers, Hkv, r, d): representative keys without RoPE
    meta: dict = field(default_factory=dict)
    keys: torch.Tensor | None = None  # (layers, Hkv, k, d) at positions 0..k-1
    values: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _size(cap) -> int | None:
    if cap is None:
        return None
    return parse_bytes(cap) if isinstance(cap, str) else int(cap)


class SpanStore:
    """Spans by id: summaries for every span, KV in RAM (LRU, `ram_bytes`) and on disk (`disk_bytes`)."""

    INDEX = "index.jsonl"

    def __init__(self, folder: str | Path | None = None, ram_bytes="1GiB", disk_bytes="8GiB"):
        self.ram_cap, self.disk_cap = _size(ram_bytes), _size(disk_bytes)
        self.folder = Path(folder) if folder is not None else None
        self.spans: OrderedDict[int, Span] = OrderedDict()  # every known span, least recently used first
        self.on_disk: dict[int, tuple[str, str, int]] = {}  # id -> (file, sha256, bytes)
        self._summaries: tuple[list[int], torch.Tensor] | None = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._read_index()

    # --- adding and reading ---------------------------------------------------------------------

    def add(self, span: Span) -> None:
        self.spans[span.id] = span
        self._summaries = None
        if self.folder is not None:
            self._write(span)
        self._enforce()

    def kv(self, span_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The span's (keys, values), from RAM or disk; None if it is gone or its file is corrupt."""
        span = self.spans.get(span_id)
        if span is None:
            return None
        self.spans.move_to_end(span_id)
        if span.keys is None:
            tensors = self._read(span_id)
            if tensors is None:
                return None
            span.keys, span.values = tensors["keys"], tensors["values"]
            self._enforce()
        return span.keys, span.values

    def drop(self, span_id: int) -> None:
        self.spans.pop(span_id, None)
        self._summaries = None
        entry = self.on_disk.pop(span_id, None)
        if entry is not None and self.folder is not None:
            (self.folder / entry[0]).unlink(missing_ok=True)

    def summaries(self) -> tuple[list[int], torch.Tensor | None]:
        """Ids and their stacked summaries (N, layers, Hkv, r, d), in id order."""
        if self._summaries is None:
            ids = sorted(self.spans)
            stacked = torch.stack([self.spans[i].summary for i in ids]) if ids else None
            self._summaries = (ids, stacked)
        return self._summaries

    def __len__(self) -> int:
        return len(self.spans)

    def __contains__(self, span_id: int) -> bool:
        return span_id in self.spans

    @property
    def ram_bytes(self) -> int:
        return sum(s.nbytes for s in self.spans.values())

    @property
    def disk_bytes(self) -> int:
        return sum(b for _, _, b in self.on_disk.values())

    # --- caps -----------------------------------------------------------------------------------

    def _enforce(self) -> None:
        if self.ram_cap is not None:
            ram = self.ram_bytes
            for span in list(self.spans.values()):  # least recently used first
                if ram <= self.ram_cap:
                    break
                if span.keys is None:
                    continue
                ram -= span.nbytes
                if span.id in self.on_disk:
                    span.keys = span.values = None  # still on disk
                else:
                    self.drop(span.id)
        if self.disk_cap is not None and self.on_disk:
            disk = self.disk_bytes
            for span_id in [i for i in self.spans if i in self.on_disk]:
                if disk <= self.disk_cap:
                    break
                disk -= self.on_disk[span_id][2]
                if self.spans[span_id].keys is None:
                    self.drop(span_id)
                else:  # stays in RAM only
                    entry = self.on_disk.pop(span_id)
                    (self.folder / entry[0]).unlink(missing_ok=True)

    # --- disk tier ------------------------------------------------------------------------------

    def _write(self, span: Span) -> None:
        name = f"span_{span.id:08d}.safetensors"
        data = save({"keys": span.keys.contiguous(), "values": span.values.contiguous(),
                     "summary": span.summary.contiguous()},
                    metadata={"meta": json.dumps(span.meta), "length": str(span.length), "id": str(span.id)})
        digest = hashlib.sha256(data).hexdigest()
        tmp = self.folder / (name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.folder / name)
            with open(self.folder / self.INDEX, "a") as f:
                f.write(json.dumps({"id": span.id, "file": name, "sha256": digest, "bytes": len(data)}) + "\n")
                f.flush()
        except OSError as err:
            tmp.unlink(missing_ok=True)
            why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else str(err)
            warnings.warn(f"span store: {why}; keeping spans in RAM only from now on", stacklevel=3)
            self.folder = None
            return
        self.on_disk[span.id] = (name, digest, len(data))

    def _read(self, span_id: int) -> dict | None:
        name, digest, _ = self.on_disk.get(span_id, (None, None, 0))
        if name is None or self.folder is None:
            self.drop(span_id)
            return None
        try:
            data = (self.folder / name).read_bytes()
        except OSError:
            data = b""
        if hashlib.sha256(data).hexdigest() != digest:
            warnings.warn(f"span store: {name} is missing or corrupt (checksum mismatch); span dropped", stacklevel=3)
            self.drop(span_id)
            return None
        return load(data)

    def _read_index(self) -> None:
        """Reopen a store folder (resume): spans whose file checks out come back, others are dropped."""
        index = self.folder / self.INDEX
        if not index.exists():
            return
        for line in index.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short by a kill: the span's file was never indexed
                continue
            self.on_disk[entry["id"]] = (entry["file"], entry["sha256"], entry["bytes"])
            tensors = self._read(entry["id"])
            if tensors is None:
                continue
            meta = json.loads(tensors_meta(self.folder / entry["file"]).get("meta", "{}"))
            self.spans[entry["id"]] = Span(entry["id"], tensors["keys"].shape[2], tensors["summary"], meta)
        self._enforce()

    @property
    def next_id(self) -> int:
        return max(self.spans, default=-1) + 1


def tensors_meta(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}
