"""A store of turns' KV, position-independent, so an evicted turn can be linked back later (MPIC).

Every stored turn (a *span*) keeps its keys as the cache held them, with the position each layer held its
first token at (`origin`; files from before it have keys de-rotated to 0..k-1, origin 0), so storing rotates
nothing and linking rotates once; its values; and a small summary for scoring: per layer and KV head, `r`
representative keys with RoPE removed (picked by the attention the turn's own window paid them, as InfLLM
picks block representatives). Summaries always stay in RAM, stacked once for scoring; the KV lives in a RAM
tier with a byte cap and, when the store has a folder, in safetensors files written through on arrival
(atomic rename, SHA-256 checked on load), so a session survives a restart. Both tiers drop their least
recently used spans past their caps; a disk that fills up (or turns read-only) degrades the store to RAM
only, with one warning.

The folder's writes (serialising, hashing, fsync) run on a writer thread of the store, in the order they were
asked for, so the model's thread does not wait for the disk. `flush()` waits for them: what a caller was told
is written after a `flush()` survives a crash of the process (a session folder flushes before it records an
answer, and on close). A span stays in RAM until its file is written; warnings of the writer are given on the
caller's thread, at its next call.

One process writes a store folder at a time (a lock, `diskio.FolderLock`; a folder that cannot be
written is opened read-only). The index is crash-safe (`store_index`): a torn or damaged record is
cut off with one warning, span files without a good record are re-indexed from their own metadata,
and span ids are never reused, even for spans that were dropped.
"""

import hashlib
import json
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load, save

from . import diskio, store_index
from .spec import parse_bytes
from .summaries import SummaryStack
from .writer import Writer


@dataclass
class Span:
    id: int
    length: int
    summary: torch.Tensor  # (layers, Hkv, r, d): representative keys without RoPE
    meta: dict = field(default_factory=dict)
    keys: torch.Tensor | None = None  # (layers, Hkv, k, d) at positions 0..k-1
    values: torch.Tensor | None = None
    bases: torch.Tensor | None = None  # multimodal RoPE: (k + 1,) its tokens' unit bases from 0, then its extent
    origin: torch.Tensor | None = None  # (layers,) the position of its first token in each layer (None: 0)
    # what a linked turn's recompute starts from (recall.recompute_rows): its input embeddings (k, hidden), kept with
    # its KV, and where its visual tokens sit in it, (start, end) (None: it has none, or the store was not asked)
    inputs: torch.Tensor | None = None
    vision: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.inputs is None else self.inputs.nbytes
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes + extra


def _size(cap) -> int | None:
    if cap is None:
        return None
    return parse_bytes(cap) if isinstance(cap, str) else int(cap)


class SpanStore:
    """Spans by id: summaries for every span, KV in RAM (LRU, `ram_bytes`) and on disk (`disk_bytes`)."""

    INDEX = "index.jsonl"

    def __init__(self, folder: str | Path | None = None, ram_bytes="1GiB", disk_bytes="8GiB"):
        """A folder that cannot be created or written is read (if it holds spans) but never written: new
        spans stay in RAM, with one warning. A folder another live process has open raises `FolderBusy`."""
        self.ram_cap, self.disk_cap = _size(ram_bytes), _size(disk_bytes)
        self.folder = Path(folder) if folder is not None else None
        self.spans: OrderedDict[int, Span] = OrderedDict()  # every known span, least recently used first
        self._in_ram: OrderedDict[int, None] = OrderedDict()  # the spans holding their KV, in the same order
        self._ram = self._disk = 0  # bytes of KV in RAM and on disk, kept as they change (not summed per add)
        self.on_disk: dict[int, tuple[str, str, int]] = {}  # id -> (file, sha256, bytes)
        self._stack = SummaryStack()
        self._next_id = 0  # above every id the folder ever indexed: ids are never reused
        self._clip_log: dict[int, dict] = {}  # every clip turn's meta this store took or reopened, dropped or not
        self.writable, self._lock, self._index = False, None, None
        self._writer = Writer()
        self._pending: set[int] = set()  # spans whose file the writer has yet to write
        self._state = threading.Lock()  # on_disk and _pending, shared with the writer
        if self.folder is not None:
            self._open_folder()

    # --- adding and reading ---------------------------------------------------------------------

    def add(self, span: Span) -> None:
        self._writer.check()
        if span.id in self.spans:  # stored again: the old one's bytes go
            self._let_go(self.spans[span.id])
        self.spans[span.id] = span
        self._log_clip(span)
        self._hold(span)
        self._stack.add(span)
        if self.folder is not None and self.writable:
            with self._state:
                self._pending.add(span.id)
            self._writer.submit(self._write, span)
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
            span.keys, span.values, span.inputs = tensors["keys"], tensors["values"], tensors.get("inputs")
            self._hold(span)
            self._enforce()
        else:
            self._in_ram.move_to_end(span_id)
        return span.keys, span.values

    def drop(self, span_id: int) -> None:
        span = self.spans.pop(span_id, None)
        if span is not None:
            self._let_go(span)
        self._stack.drop(span_id)
        with self._state:
            entry = self.on_disk.pop(span_id, None)
            self._disk -= entry[2] if entry is not None else 0
        if entry is not None:
            self._forget(span_id, entry[0])

    def _hold(self, span: Span) -> None:
        """`span`'s KV is in RAM (and the most recently used)."""
        if span.keys is not None:
            self._in_ram[span.id] = None
            self._in_ram.move_to_end(span.id)
            self._ram += span.nbytes

    def _let_go(self, span: Span, keep_meta: bool = False) -> None:
        """`span`'s KV leaves RAM (keep_meta: it stays known, its file on disk)."""
        if span.keys is not None and self._in_ram.pop(span.id, 0) is None:
            self._ram -= span.nbytes
        if keep_meta:
            span.keys = span.values = span.inputs = None

    def summary_rows(self, span_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of `span_ids` in the stacked summaries, and the stack (N, layers, Hkv, r, d) in id order, as
        scoring reads it: unit keys in fp32 (found by id, not searched)."""
        return self._stack.rows(span_ids), self._stack.all()[1]

    def clips(self) -> list[dict]:
        """The meta of every clip turn stored, in clip order, those the caps have dropped since too (a question about
        them still resolves to them, as the engine's own log does): the clip log a question is resolved against."""
        return sorted(self._clip_log.values(), key=lambda m: m["clip"])

    def _log_clip(self, span: Span) -> None:
        if "clip" in span.meta:
            self._clip_log[span.meta["clip"]] = span.meta

    def __len__(self) -> int:
        return len(self.spans)

    def __contains__(self, span_id: int) -> bool:
        return span_id in self.spans

    @property
    def ram_bytes(self) -> int:
        return self._ram

    @property
    def disk_bytes(self) -> int:
        return self._disk

    # --- caps -----------------------------------------------------------------------------------

    def _enforce(self) -> None:
        """Both tiers back under their caps, least recently used first: a span leaves RAM for its file (or, with no
        file, altogether), a file leaves the disk (its span too, unless its KV is still in RAM). A span stays in RAM
        until its file is written."""
        self._said()
        if self.ram_cap is not None and self._ram > self.ram_cap:
            with self._state:
                written, pending = set(self.on_disk), set(self._pending)
            for span_id in list(self._in_ram):
                if self._ram <= self.ram_cap:
                    break
                if span_id in pending:
                    continue
                if span_id in written:
                    self._let_go(self.spans[span_id], keep_meta=True)  # still on disk
                else:
                    self.drop(span_id)
        if self.disk_cap is not None and self._disk > self.disk_cap:
            with self._state:
                on_disk = dict(self.on_disk)
            for span_id in [i for i in self.spans if i in on_disk]:
                if self._disk <= self.disk_cap:
                    break
                if self.spans[span_id].keys is None:
                    self.drop(span_id)
                else:  # stays in RAM only
                    with self._state:
                        self._disk -= self.on_disk.pop(span_id)[2]
                    self._forget(span_id, on_disk[span_id][0])

    # --- disk tier (on the writer thread) -------------------------------------------------------

    def _write(self, span: Span) -> None:
        try:
            if not self.writable:
                return
            name = f"span_{span.id:08d}.safetensors"
            tensors = {"keys": span.keys.contiguous(), "values": span.values.contiguous(),
                       "summary": span.summary.contiguous()}
            for key in ("bases", "origin", "inputs", "vision"):
                if getattr(span, key) is not None:
                    tensors[key] = getattr(span, key).contiguous()
            data = save(tensors,
                        metadata={"meta": json.dumps(span.meta), "length": str(span.length), "id": str(span.id)})
            digest = hashlib.sha256(data).hexdigest()
            try:
                diskio.write_atomic(self.folder / name, data)
                self._index.append(store_index.encode({"id": span.id, "file": name, "sha256": digest,
                                                       "bytes": len(data)}))
            except OSError as err:  # a file without its record is re-indexed when the folder is reopened
                self._stop_writing(f"{diskio.why(err)} ({self.folder})")
                return
            with self._state:
                self.on_disk[span.id] = (name, digest, len(data))
                self._disk += len(data)
        finally:
            with self._state:
                self._pending.discard(span.id)

    def _forget(self, span_id: int, name: str) -> None:
        """A span's file leaves the disk: first a tombstone record, which keeps its id from being reused and
        its file from being re-indexed, then the file (on the writer thread, after the writes before it)."""
        if self.writable:
            self._writer.submit(self._forget_now, span_id, name)

    def _forget_now(self, span_id: int, name: str) -> None:
        if not self.writable:
            return
        try:
            self._index.append(store_index.encode(store_index.tombstone(span_id, name)))
            diskio.remove(self.folder / name)
        except OSError as err:
            self._stop_writing(diskio.why(err))

    def _stop_writing(self, why: str) -> None:
        self.writable = False
        self._writer.say(f"span store: {why}; new clips are kept in RAM only from now on (those already on disk "
                         f"stay readable)")

    def _said(self) -> None:
        """The writer's warnings, given on the caller's thread."""
        for text in self._writer.told():
            warnings.warn(text, stacklevel=4)

    def flush(self) -> None:
        """Wait until every write asked for so far is on disk (or given up, with its warning); an error the writer
        met (not a full or read-only disk, which it handles) is raised here."""
        self._writer.flush()
        self._enforce()  # the caps apply to spans whose files have just been written (a file it drops: one more write)
        self._writer.flush()

    def close(self) -> None:
        """Finish the writes, then release the folder for another process (spans on disk stay readable through
        this store)."""
        try:
            self.flush()
        finally:
            if self._index is not None:
                self._index.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _read(self, span_id: int) -> dict | None:
        with self._state:
            name, digest, _ = self.on_disk.get(span_id, (None, None, 0))
        if name is None:
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

    def _open_folder(self) -> None:
        try:
            diskio.make_folder(self.folder)
        except OSError as err:
            if not self.folder.is_dir():  # one that exists is read, whatever its disk allows
                warnings.warn(f"span store: cannot create {self.folder} ({diskio.why(err)}); clips are kept in RAM "
                              f"only", stacklevel=4)
                return
        self._lock = diskio.FolderLock(self.folder)
        self.writable = self._lock.acquire()
        self._index = diskio.AppendLog(self.folder / self.INDEX)
        try:
            for tmp in self.folder.glob("*.tmp") if self.writable else []:  # a write a crash cut short
                diskio.remove(tmp)
        except OSError as err:
            self._stop_writing(diskio.why(err))
        self._read_index()
        if not self.writable and self.folder.exists():
            warnings.warn(f"span store: {self.folder} cannot be written (read-only disk or no permission); "
                          f"its clips are read, new ones kept in RAM only", stacklevel=4)

    def _read_index(self) -> None:
        """Reopen a store folder (resume): spans whose file checks out come back, others are dropped. Bad
        index records are cut off and span files without a good record re-indexed (one warning)."""
        index = store_index.read(self.folder / self.INDEX)
        records = {r["id"]: r for r in index.records}  # a later record of an id wins (a tombstone)
        adopted = [store_index.adopt(self.folder, i, name) for i, name in store_index.span_files(self.folder).items()
                   if i not in records]
        adopted = [r for r in adopted if r is not None]
        self._next_id = max([index.max_id, *(r["id"] for r in adopted)]) + 1
        for record in sorted([*records.values(), *adopted], key=lambda r: r["id"]):
            if record.get("dropped"):
                continue
            self.on_disk[record["id"]] = (record["file"], record["sha256"], record["bytes"])
            self._disk += record["bytes"]
            tensors = self._read(record["id"])
            if tensors is None:
                continue
            meta = json.loads(store_index.tensors_meta(self.folder / record["file"]).get("meta", "{}"))
            span = Span(record["id"], tensors["keys"].shape[2], tensors["summary"], meta,
                        bases=tensors.get("bases"), origin=tensors.get("origin"), vision=tensors.get("vision"))
            self.spans[record["id"]] = span
            self._log_clip(span)
            self._stack.add(span)
        if not index.clean or adopted:
            self._repair_index(index, adopted)
        self._enforce()

    def _repair_index(self, index, adopted: list[dict]) -> None:
        what = [f"{index.bad} damaged or torn record(s) cut off"] if index.bad else []
        what += [f"{len(adopted)} span file(s) re-indexed from their own metadata"] if adopted else []
        rows = store_index.rebuilt([*index.records, *adopted], self.on_disk)
        if self.writable:
            try:
                diskio.write_atomic(self.folder / self.INDEX, b"".join(map(store_index.encode, rows)))
            except OSError as err:
                self._stop_writing(f"the repaired index cannot be written ({diskio.why(err)})")
        warnings.warn(f"span store: {self.folder / self.INDEX}: {'; '.join(what)} (a write cut short by a crash or a "
                      f"full disk); {len(self.spans)} clip(s) readable", stacklevel=4)

    @property
    def next_id(self) -> int:
        return max(self._next_id, max(self.spans, default=-1) + 1)

