"""The span store's index (index.jsonl): one self-delimiting, checksummed record per stored span.

A record is one line: its JSON, a tab, the CRC-32 of that JSON in hex, a line break. A record is
good only if all of it is there and its checksum matches, so a line cut short by a crash during an
append, or bytes damaged later (invalid UTF-8 included), is recognised as bad on its own: its
neighbours stay good. Reading returns the good records and what was wrong; the store then cuts the
index back to its good records (one warning) and re-indexes span files that have no good record
from their own metadata, so a span whose file is whole is never lost to a bad line next to it.
Lines written before records had checksums (plain JSON) are still read.
"""

import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load

KEYS = ("id", "file", "sha256", "bytes")
SPAN_FILE = re.compile(r"span_(\d{8})\.safetensors")


def encode(record: dict) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{body}\t{zlib.crc32(body.encode()):08x}\n".encode()


def tombstone(span_id: int, name: str) -> dict:
    """The record of a span whose file was dropped: its id stays taken."""
    return {"id": span_id, "file": name, "sha256": "", "bytes": 0, "dropped": True}


def _decode(line: bytes) -> dict | None:
    body, tab, crc = line.rpartition(b"\t")
    if tab:
        if not re.fullmatch(rb"[0-9a-f]{8}", crc) or zlib.crc32(body) != int(crc, 16):
            return None
    else:  # an index written before records were checksummed
        body = line
    try:
        record = json.loads(body.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(record, dict) or not all(k in record for k in KEYS):
        return None
    if not isinstance(record["id"], int) or not SPAN_FILE.fullmatch(str(record["file"])):
        return None
    return record


@dataclass
class IndexRead:
    records: list = field(default_factory=list)  # good records, in file order
    bad: int = 0  # lines whose checksum, encoding or JSON failed (a torn last line included)
    torn: bool = False  # the file ends inside a record (a crash during an append)
    max_id: int = -1  # the highest span id any good record names

    @property
    def clean(self) -> bool:
        return not self.bad


def read(path: Path) -> IndexRead:
    out = IndexRead()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last line break: empty unless a record was cut short
    if tail:
        out.torn = True
        lines.append(tail)
    for line in lines:
        if not line.strip():
            continue
        record = _decode(line)
        if record is None:
            out.bad += 1
            continue
        out.records.append(record)
        out.max_id = max(out.max_id, record["id"])
    return out


def span_files(folder: Path) -> dict[int, str]:
    """Span id -> file name of every complete span file in the folder (temporary files excluded)."""
    found = {}
    for path in folder.iterdir():
        m = SPAN_FILE.fullmatch(path.name)
        if m:
            found[int(m.group(1))] = path.name
    return found


def tensors_meta(path: Path) -> dict:
    """A span file's own metadata (its id, length and meta), read without its tensors."""
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def adopt(folder: Path, span_id: int, name: str) -> dict | None:
    """A whole span file the index does not list (its record was torn or damaged): its record rebuilt from the
    file itself, if the file loads and names the same id."""
    try:
        data = (folder / name).read_bytes()
        ok = tensors_meta(folder / name).get("id") == str(span_id) and "keys" in load(data)
    except Exception:  # a damaged file: safetensors raises its own error types
        ok = False
    if not ok:
        return None
    return {"id": span_id, "file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def rebuilt(records: list[dict], on_disk: dict[int, tuple]) -> list[dict]:
    """The records of a repaired index: every id ever used keeps one (a tombstone where its file is gone)."""
    ids = sorted({r["id"] for r in records})
    return [dict(zip(KEYS, (i, *on_disk[i]), strict=True)) if i in on_disk
            else tombstone(i, f"span_{i:08d}.safetensors") for i in ids]
