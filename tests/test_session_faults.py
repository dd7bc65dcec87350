"""Fault injection over every write a session folder sees, as SQLite tests its journal.

A short `stream-qa --session` run (the real tiny-vlm on the bundled clip, in this process) is made
once cleanly, counting the write primitives of `inf_mllm.diskio` (folder and file creation, each write, fsync,
rename, append, the lock). Then, for every one of those points, the run is repeated with a fault
there: a crash (the process "dies": a half-written buffer is left on disk, nothing runs afterwards,
its descriptors and locks are dropped as the kernel would) or a full disk (ENOSPC from that point
on). After each, the session is resumed (or, when the crash came before any settings were saved,
started again in the same folder) and must answer. What is checked at every point:

- no answer printed before the crash is missing from the transcript;
- no clip whose file was completely written is lost when the session reopens;
- with a full disk the run itself goes on and prints every answer, with at most one warning per
  thing that is no longer saved;
- the resumed (or restarted) session answers, and its transcript keeps every earlier answer.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from inf_mllm import diskio
from streaming.cli import main
from streaming.sources import bundled_clip

SHORT = ["--fast", "--clip-seconds", "5", "--max-new-tokens", "2", "--json",
         "--ask", "what is the color of the shape? @4s"]  # 2 clips of the bundled clip, an answer between them
LONG = ["--fast", "--clip-seconds", "2", "--max-new-tokens", "2", "--json",
        "--ask", "what is the color of the shape? @3s", "--ask", "is there a bicycle? @7s"]  # 5 clips, 2 answers
SPAN = re.compile(r"span_(\d{8})\.safetensors$")


class Crash(BaseException):
    """The process died here: not an Exception, so nothing in stream-qa catches it."""


class Faults:
    """`diskio.hook`: counts write primitives; from call `at` on, crashes (once, then every later write
    would not happen either) or fails with ENOSPC (the disk stays full)."""

    def __init__(self, at: int | None = None, mode: str = "crash"):
        self.at, self.mode, self.calls, self.dead = at, mode, [], False

    def __call__(self, op, path, fd, data):
        n = len(self.calls)
        self.calls.append((op, path))
        if self.dead:
            raise Crash("already dead")
        if self.at is None or n < self.at:
            return
        if self.mode == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        self.dead = True
        if op == "write" and data:  # a write torn in the middle: half of it reached the file
            os.write(fd, data[: len(data) // 2])
        raise Crash(f"crash at write {n}: {op} {path}")

    def completed_spans(self, under: str | None = None) -> set[int]:
        """Span ids whose file was completely in place (renamed) before the fault (in a folder named `under`)."""
        done = self.calls[: self.at] if self.at is not None else self.calls
        return {int(m.group(1)) for op, path in done if op == "rename" and (m := SPAN.search(path))
                and (under is None or under in Path(path).parts)}


ENCODED: dict = {}  # (frames, times) -> the clip as tiny-vlm encodes it: the same clips in every faulty run


@pytest.fixture
def shared_model(vlm, monkeypatch):
    """The session's tiny-vlm for every run, each clip encoded once for all of them: the runs differ only in their
    writes (encoding is pure; 150-odd runs would otherwise encode the same ten frames each)."""
    import models

    monkeypatch.setattr(models, "load_adapter", lambda name, path=None, device="cpu": vlm)
    encode = vlm.encode

    def encoded_once(frames, times):
        key = (hashlib.sha256(frames.tobytes()).hexdigest(), tuple(times))
        if key not in ENCODED:
            ENCODED[key] = encode(frames, times)
        return ENCODED[key]

    monkeypatch.setattr(vlm, "encode", encoded_once)
    return vlm


@pytest.fixture
def descriptors(monkeypatch):
    """Every lock and append log the session opens, so a simulated crash can drop them as process death would."""
    opened = []
    acquire, init = diskio.FolderLock.acquire, diskio.AppendLog.__init__

    def track_acquire(self):
        opened.append(self)
        return acquire(self)

    def track_init(self, path):
        opened.append(self)
        init(self, path)

    monkeypatch.setattr(diskio.FolderLock, "acquire", track_acquire)
    monkeypatch.setattr(diskio.AppendLog, "__init__", track_init)

    def die():
        for thing in opened:
            (thing.release if isinstance(thing, diskio.FolderLock) else thing.close)()
        opened.clear()

    return die


def run(argv, capsys, faults=None, monkeypatch=None):
    """stream-qa in this process; (exit code or 'crash', answers printed as whole JSON lines, stderr)."""
    if faults is not None:
        monkeypatch.setattr(diskio, "hook", faults)
    try:
        code = main(argv)
    except Crash:
        code = "crash"
    finally:
        if faults is not None:
            monkeypatch.setattr(diskio, "hook", None)
    captured = capsys.readouterr()
    answers = []
    for line in captured.out.splitlines():
        with contextlib.suppress(ValueError):  # a line the crash cut short was never printed whole
            answers.append(json.loads(line))
    return code, answers, captured.err


def transcript(folder) -> list[dict]:
    """The answers' records as printed (a row's `exchange`, what the cache took, is the transcript's own)."""
    path = folder / "transcript.jsonl"
    rows = []
    for line in path.read_bytes().split(b"\n") if path.exists() else []:
        with contextlib.suppress(ValueError):  # a torn last line
            row = json.loads(line)
            row.pop("exchange", None)
            rows.append(row)
    return rows


def stored_spans(folder) -> set[int]:
    from inf_mllm.store import SpanStore

    store = SpanStore(folder / "store")
    try:
        return set(store.spans)
    finally:
        store.close()


def check_point(tmp_path, at, mode, args, capsys, monkeypatch, die) -> dict:
    folder = tmp_path / f"{mode}-{at}"
    faults = Faults(at, mode)
    code, printed, err = run([str(bundled_clip()), "--session", str(folder), *args], capsys, faults, monkeypatch)
    die()  # the process is gone: its locks and descriptors with it
    where = f"{mode} at write {at} ({faults.calls[at] if at < len(faults.calls) else 'none'})"
    if mode == "crash":
        assert code == "crash", (where, code, err[-800:])
    else:  # a full disk never stops the answers
        assert code == 0, (where, err[-800:])
        assert len(printed) == args.count("--ask"), (where, err[-800:])
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        said = ("RAM only", "not saved", "cannot be", "nothing of this session is saved")
        assert len(warnings) <= 3 and all(any(s in w for s in said) for w in warnings), (where, warnings)
        assert "Traceback" not in err and "internal error" not in err, (where, err[-800:])
    kept = transcript(folder)
    if mode == "crash":  # every answer printed is in it, in order; at most the one being printed when it died
        assert kept[: len(printed)] == printed and len(kept) <= len(printed) + 1, (where, printed, kept)
    else:  # the answers saved until the disk filled, in order
        assert kept == printed[: len(kept)], (where, kept, printed)
    spans = stored_spans(folder) if (folder / "store").exists() else set()
    assert faults.completed_spans() <= spans, (where, faults.completed_spans(), spans)
    again = ["--resume", str(folder)] if (folder / "session.json").exists() else ["--session", str(folder)]
    tail = ["--json", "--max-new-tokens", "2", "--ask", "what is in the video?"]
    source = [] if again[0] == "--resume" else [str(bundled_clip()), "--fast", "--clip-seconds", "5"]
    code2, printed2, err2 = run([*source, *again, *tail], capsys)
    assert code2 == 0 and printed2 and printed2[-1]["answer"], (where, again[0], err2[-800:])
    after = transcript(folder)
    assert after[: len(kept)] == kept and after[-1] == printed2[-1], (where, after)
    assert faults.completed_spans() <= stored_spans(folder), where
    return {"point": at, "mode": mode, "op": faults.calls[at][0] if at < len(faults.calls) else None}


def first_write_of_each_file(calls) -> list[int]:
    """One point per kind of file the folder writes (lock, settings, span file, index, transcript): its first write."""
    firsts = {}
    for n, (_, path) in enumerate(calls):
        firsts.setdefault((Path(path).parent.name == "store", re.sub(r"\d+", "N", Path(path).name)), n)
    return sorted(firsts.values())


def inject(tmp_path, args, capsys, monkeypatch, die, modes, every: bool = True, alternate: bool = False,
           skip: float = 0.0) -> list[dict]:
    """A clean run counts the writes; then a fault at every one of them (or, `every=False`, at the first write
    of each kind of file), each followed by a resume. `alternate`: one fault per point, the modes taking turns.
    `skip`: the share of the writes at the start faulted only at the first write of each kind of file."""
    clean = Faults()
    code, printed, err = run([str(bundled_clip()), "--session", str(tmp_path / "clean"), *args], capsys, clean,
                             monkeypatch)
    die()
    assert code == 0 and len(printed) == args.count("--ask"), err[-800:]
    ops = {op for op, _ in clean.calls}
    assert {"mkdir", "lock", "create", "write", "fsync", "rename", "open"} <= ops, ops
    firsts = first_write_of_each_file(clean.calls)
    points = sorted(set(firsts) | set(range(int(len(clean.calls) * skip), len(clean.calls)))) if every else firsts
    runs = [(modes[i % len(modes)], at) for i, at in enumerate(points)] if alternate else \
        [(mode, at) for mode in modes for at in points]
    results = [check_point(tmp_path, at, mode, args, capsys, monkeypatch, die) for mode, at in runs]
    assert len(results) == len(runs) >= len(points)
    with capsys.disabled():
        print(f"\nsession fault injection ({', '.join(modes)}): {len(points)} of {len(clean.calls)} write points, "
              f"{len(results)} faulty runs, each resumed; 0 answers and 0 completed clips lost")
    return results


@pytest.mark.slow  # over a minute on 2 cores: run by `make test-slow` in CI
def test_a_crash_at_any_write_loses_no_answer_and_no_stored_clip(tmp_path, capsys, monkeypatch, shared_model,
                                                                  descriptors):
    """Every write point of a 2-clip session with one answer (about 24), each crashed and resumed."""
    inject(tmp_path, SHORT, capsys, monkeypatch, descriptors, ("crash",))


@pytest.mark.slow
def test_a_full_disk_at_each_kind_of_write_keeps_the_answers_coming(tmp_path, capsys, monkeypatch, shared_model,
                                                                      descriptors):
    """ENOSPC from the first write of each file on (lock, settings, span file, index, transcript); every point in
    the longer variant. Slow: the fast suite has ENOSPC and EROFS per file in tests/test_session_dir.py."""
    inject(tmp_path, SHORT, capsys, monkeypatch, descriptors, ("enospc",), every=False)


@pytest.mark.slow
def test_every_write_of_a_longer_session_crashes_and_fills_the_disk(tmp_path, capsys, monkeypatch, shared_model,
                                                                      descriptors):
    """5 clips and 2 answers: a crash or a full disk at every write point after the first third (whose clips the
    2-clip session above is crashed at every point of) and at the first write of each file, taking turns."""
    inject(tmp_path, LONG, capsys, monkeypatch, descriptors, ("crash", "enospc"), alternate=True, skip=1 / 3)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the simulated death, per stream
def test_a_crash_of_a_run_of_two_streams_loses_no_answer_and_no_stored_clip(tmp_path, capsys, monkeypatch,
                                                                             shared_model, descriptors):
    """`stream-qa a.mp4 b.mp4 --session DIR` (each stream in DIR/stream-N) crashed at the first write of each kind of
    file, and at every write of the run's middle third; then `--resume DIR`. Both streams write at once, so a point
    is a count of writes, whichever stream makes it; the process dies there for both. Checked for each stream: every
    answer printed is in its transcript, every clip file completed is in its store, and the resumed run answers. A
    crash before every stream's settings were saved leaves nothing answered (checked) and nothing to resume."""
    videos = [str(bundled_clip("bikes.mp4")), str(bundled_clip("carphone_pristine.mp4"))]

    def two(folder, faults=None):
        return run([*videos, "--session", str(folder), *SHORT], capsys, faults, monkeypatch)

    clean = Faults()
    code, printed, err = two(tmp_path / "clean", clean)
    descriptors()
    assert code == 0 and sorted(r["stream"] for r in printed) == [1, 2], err[-800:]
    third = len(clean.calls) // 3
    points = sorted(set(first_write_of_each_file(clean.calls)) | set(range(third, 2 * third)))
    resumed = 0
    for at in points:
        folder, faults = tmp_path / f"crash-{at}", Faults(at)
        code, printed, err = two(folder, faults)
        descriptors()
        where = f"crash at write {at} ({faults.calls[at] if at < len(faults.calls) else 'none'})"
        assert code in ("crash", 0), (where, code, err[-800:])  # a stream's thread dies; the run may still end
        streams = [folder / "stream-1", folder / "stream-2"]
        for n, stream in enumerate(streams, start=1):
            said = [{k: v for k, v in r.items() if k not in ("stream", "input")} for r in printed if r["stream"] == n]
            kept = transcript(stream)
            assert kept[: len(said)] == said, (where, n, said, kept)
            spans = stored_spans(stream) if (stream / "store").exists() else set()
            assert faults.completed_spans(under=stream.name) <= spans, (where, n, spans)
        if not all((s / "session.json").exists() for s in streams):
            assert not printed, where  # nothing was answered before every stream had its settings
            continue
        code2, printed2, err2 = run(["--resume", str(folder), "--json", "--max-new-tokens", "2", "--ask",
                                     "what is in the video?"], capsys)
        descriptors()
        assert code2 == 0 and sorted(r["stream"] for r in printed2) == [1, 2], (where, err2[-800:])
        for n, stream in enumerate(streams, start=1):
            said = [{k: v for k, v in r.items() if k not in ("stream", "input")} for r in printed if r["stream"] == n]
            assert transcript(stream)[: len(said)] == said, (where, n)
        resumed += 1
    assert resumed >= len(points) // 2
    with capsys.disabled():
        print(f"\ntwo streams' session fault injection: {len(points)} of {len(clean.calls)} write points crashed, "
              f"{resumed} resumed; 0 answers and 0 completed clips lost")
