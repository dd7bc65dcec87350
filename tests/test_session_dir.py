"""A session folder's safety without the model: one writer at a time (a lock naming its holder, taken over
from a dead one), the store's crash-safe index (torn and damaged records, re-indexed files, ids never
reused), disk faults that cost saving but not answers, hand-edited settings, and stdout that cannot take
the answers. All of these are decided before the model loads, so each case runs in well under a second."""

import errno
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from inf_mllm import diskio, store_index
from inf_mllm.store import Span, SpanStore
from streaming.cli import main
from streaming.engine import Answer
from streaming.errors import environment_fault
from streaming.session_dir import SessionDir
from streaming.sources import bundled_clip

HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("diskio", sys.argv[2])  # the module alone: no torch to import
diskio = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diskio)
lock = diskio.FolderLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the session folder's lock, as a second stream-qa would."""
    procs = []

    def start(folder):
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), diskio.__file__], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def span(i: int, n: int = 6) -> Span:
    kv = torch.randn(2, 1, n, 8)
    return Span(i, n, torch.randn(2, 1, 3, 8), {"clip": i, "start": 2.0 * i, "end": 2.0 * i + 2}, kv, kv.clone())


def filled(folder, ids=(1, 2, 3, 4)) -> dict:
    store = SpanStore(folder)
    spans = {i: span(i) for i in ids}
    for s in spans.values():
        store.add(s)
    store.close()
    return spans


def reopen(folder):
    """The store reopened, with the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = SpanStore(folder)
    return store, [str(w.message) for w in caught]


# --- one writer per session -----------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--session", "--resume"])
def test_a_second_writer_is_refused_in_one_line_naming_the_holder(option, tmp_path, holder, capsys):
    folder = tmp_path / "s"
    proc = holder(folder)
    if option == "--resume":
        (folder / "session.json").write_text(json.dumps({"fps": 1.0}))
    code = main([str(bundled_clip()), option, str(folder)] if option == "--session" else [option, str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == (f"stream-qa: {option} {folder}: another stream-qa (pid {proc.pid}) is writing this session; "
                      f"one writer at a time: wait for it to end or stop it")


def test_the_library_store_is_one_writer_too(tmp_path):
    first = SpanStore(tmp_path)
    with pytest.raises(diskio.FolderBusy, match=f"process {os.getpid()}, which is still running"):
        SpanStore(tmp_path)
    first.close()
    SpanStore(tmp_path).close()  # released: the next writer gets it


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, holder):
    folder = tmp_path / "s"
    proc = holder(folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / "lock").read_text().strip() == str(proc.pid)  # the dead holder's pid is still in the file
    session = SessionDir(folder, resume=False)
    assert session.saving["transcript"] and (folder / "lock").read_text().strip() == str(os.getpid())
    session.close()


# --- the crash-safe index -------------------------------------------------------------------------


def test_index_records_are_checksummed_lines():
    line = store_index.encode({"id": 3, "file": "span_00000003.safetensors", "sha256": "ab", "bytes": 10})
    body, crc = line.rstrip(b"\n").split(b"\t")
    assert json.loads(body)["id"] == 3 and len(crc) == 8 and line.endswith(b"\n")


def test_a_torn_last_record_is_cut_back_with_one_warning_and_its_clip_kept(tmp_path):
    filled(tmp_path)
    index = tmp_path / "index.jsonl"
    data = index.read_bytes()
    index.write_bytes(data[: len(data) - 40])  # a crash in the middle of the last append
    store, said = reopen(tmp_path)
    assert sorted(store.spans) == [1, 2, 3, 4]  # span 4's file is whole: re-indexed from its own metadata
    assert len(said) == 1 and "1 damaged or torn record(s) cut off" in said[0]
    assert "1 span file(s) re-indexed" in said[0]
    read = store_index.read(index)
    assert read.clean and [r["id"] for r in read.records] == [1, 2, 3, 4]
    store.add(span(5))  # appends after a whole record, not onto a torn one
    store.close()
    again, said = reopen(tmp_path)
    assert sorted(again.spans) == [1, 2, 3, 4, 5] and not said


def test_an_invalid_utf8_byte_costs_no_clip_and_blames_nothing_else(tmp_path):
    spans = filled(tmp_path)
    index = tmp_path / "index.jsonl"
    data = bytearray(index.read_bytes())
    second = data.index(b"\n") + 10
    data[second] = 0xFF  # inside the second record
    index.write_bytes(bytes(data))
    store, said = reopen(tmp_path)
    assert sorted(store.spans) == [1, 2, 3, 4] and len(said) == 1 and "1 span file(s) re-indexed" in said[0]
    assert torch.equal(store.kv(2)[0], spans[2].keys) and store.spans[2].meta == spans[2].meta


def test_a_corrupt_record_in_the_middle_does_not_drop_its_neighbours(tmp_path):
    filled(tmp_path)
    index = tmp_path / "index.jsonl"
    lines = index.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"id":2', b'"id":9')  # the checksum no longer matches
    index.write_bytes(b"\n".join(lines))
    store, said = reopen(tmp_path)
    assert sorted(store.spans) == [1, 2, 3, 4] and len(said) == 1 and "1 damaged" in said[0]


def test_span_ids_are_never_reused_even_after_a_drop(tmp_path):
    filled(tmp_path)
    victim = tmp_path / "span_00000004.safetensors"
    victim.write_bytes(victim.read_bytes()[:-5] + b"XXXXX")
    store, said = reopen(tmp_path)
    assert sorted(store.spans) == [1, 2, 3] and any("corrupt" in w for w in said)
    assert store.next_id == 5  # 4 was used; a new span is 5
    store.close()
    again, said = reopen(tmp_path)  # the tombstone keeps 4 taken, with no new warning
    assert again.next_id == 5 and not said


def test_an_index_written_before_checksums_still_opens(tmp_path):
    filled(tmp_path)
    index = tmp_path / "index.jsonl"
    records = store_index.read(index).records
    index.write_text("".join(json.dumps(r) + "\n" for r in records))  # the old format: plain JSON lines
    store, said = reopen(tmp_path)
    assert sorted(store.spans) == [1, 2, 3, 4] and not said


# --- disk faults ----------------------------------------------------------------------------------


def fail(kind: int, paths: str = ""):
    def hook(op, path, fd, data):
        if paths in path:
            raise OSError(kind, os.strerror(kind), path)

    return hook


def answered(text: str) -> Answer:
    return Answer(video_t=1.0, question="q", answer=text, ttft_s=0.1, tokens_per_s=9.0, kv_tokens=4, kv_mb=0.1,
                  rss_mb=9.0)


@pytest.mark.parametrize("kind", [errno.ENOSPC, errno.EROFS])
def test_a_transcript_that_cannot_be_written_warns_once_and_answers_go_on(kind, tmp_path, monkeypatch):
    said = []
    folder = SessionDir(tmp_path / "s", resume=False, warn=said.append)
    folder.save_settings({"fps": 1.0})
    folder.write_answer(answered("one"))
    monkeypatch.setattr(diskio, "hook", fail(kind, "transcript"))
    folder.write_answer(answered("two"))
    folder.write_answer(answered("three"))
    monkeypatch.setattr(diskio, "hook", None)
    folder.write_clip({"t0": 0.0, "t1": 1.0})  # a full disk stopped the clip log with the same one warning
    assert (tmp_path / "s" / "clips.jsonl").exists() == (kind != errno.ENOSPC)
    assert [r["answer"] for r in folder.answered()] == ["one"]
    names = "transcript.jsonl and clips.jsonl" if kind == errno.ENOSPC else "transcript.jsonl"
    assert len(said) == 1, said
    assert f"{names} cannot be written" in said[0] and "printed but not saved" in said[0]
    assert diskio.why(OSError(kind, "")) in said[0]
    folder.close()


def test_settings_that_cannot_be_written_say_the_session_cannot_be_resumed(tmp_path, monkeypatch):
    said = []
    folder = SessionDir(tmp_path / "s", resume=False, warn=said.append)
    monkeypatch.setattr(diskio, "hook", fail(errno.ENOSPC, "session.json"))
    folder.save_settings({"fps": 1.0})
    assert len(said) == 1 and "cannot be resumed" in said[0] and not (tmp_path / "s" / "session.json").exists()
    assert not list((tmp_path / "s").glob("*.tmp"))
    folder.close()


def test_a_read_only_session_is_resumed_read_only(tmp_path, monkeypatch):
    folder = tmp_path / "s"
    first = SessionDir(folder, resume=False)
    first.save_settings({"fps": 1.0})
    first.write_answer(answered("one"))
    first.close()
    filled(folder / "store", ids=(1, 2))
    monkeypatch.setattr(diskio, "hook", fail(errno.EROFS))  # every write the folder would see fails
    said = []
    again = SessionDir(folder, resume=True, warn=said.append)
    assert len(said) == 1 and "running read-only" in said[0] and not any(again.saving.values())
    again.write_answer(answered("two"))  # not saved, and no error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = again.open_store()
    assert not caught  # said once already
    assert sorted(store.spans) == [1, 2] and not store.writable
    store.add(span(3))
    assert store.kv(3) is not None and 3 not in store.on_disk  # kept in RAM
    again.close(store)
    assert [r["answer"] for r in again.answered()] == ["one"]


def test_a_hand_edited_setting_is_refused_before_the_model_loads(tmp_path, capsys):
    folder = tmp_path / "s"
    first = SessionDir(folder, resume=False)
    first.save_settings({"fps": "2", "policy": "inf_mllm+recall"})
    first.close()
    code = main(["--resume", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "session.json: 'fps' cannot be \"2\" (edited by hand?); expected int or float" in err[0]


def test_an_environment_fault_is_not_called_a_bug():
    err = OSError(errno.EROFS, "Read-only file system", "/models/cache")
    wrapped = RuntimeError("could not convert the weights")
    wrapped.__cause__ = err
    for e in (err, wrapped):
        text = environment_fault(e)
        assert text.startswith("Read-only file system (/models/cache): a fault of this machine's disk or files")
    assert environment_fault(ValueError("too many values to unpack")) is None
    assert environment_fault(FileNotFoundError(errno.ENOENT, "No such file")) is None  # no path: not the disk


# --- stdout ---------------------------------------------------------------------------------------

CHECK = ("import sys; from streaming.cli import main; rc = main(sys.argv[1:]); "
         "print(rc, 'torch' in sys.modules, file=sys.stderr)")


def test_a_closed_stdout_is_one_line_before_the_model_loads():
    out = subprocess.run([sys.executable, "-c", CHECK, str(bundled_clip())], stderr=subprocess.PIPE, text=True,
                         timeout=60, stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    *lines, last = out.stderr.strip().splitlines()
    assert last == "2 False" and len(lines) == 1
    assert lines[0].startswith("stream-qa: stdout is closed (>&-)")


def test_stdout_on_a_full_device_is_one_line_before_the_model_loads():
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-c", CHECK, str(bundled_clip())], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
    *lines, last = out.stderr.strip().splitlines()
    assert last == "2 False" and len(lines) == 1 and lines[0].startswith("stream-qa: stdout goes to a full disk")
