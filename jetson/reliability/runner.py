"""Running one case the way a user meets it: its own `stream-qa` process (a pseudo-terminal, a pipe
closed after one line, a signal mid-answer or `kill -9` where the case needs one), or a library call in
this process; and `run`, the whole table for `python -m jetson reliability`.
"""

import json
import os
import pty
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cases import CASES, PLAYS, Case
from .report import expected_text, judge, write


def run_subprocess(case: Case, tmp: Path, timeout: float = 300) -> dict:
    """The case as a user meets it: its own `stream-qa` process."""
    argv = [sys.executable, "-m", "streaming.cli", *case.build(tmp)]
    env = {**os.environ, "STREAM_QA_LOG_DIR": str(tmp / "logs")}  # a bug report stays with its case (read as TMP)
    for name, value in (case.env(tmp) if case.env else {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    if case.fault:
        argv[1:3] = ["-m", "jetson.faults", *map(str, case.fault), "--"]
    start = time.monotonic()
    if case.where in ("cli signal", "cli kill"):
        result = (_interrupted if case.where == "cli signal" else _killed)(case, argv, tmp, timeout, env)
        result["seconds"] = round(time.monotonic() - start, 1)
        return result
    try:
        if case.where == "cli tty":
            master, slave = pty.openpty()
            proc = subprocess.Popen(argv, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            os.close(slave)
            out, err = proc.communicate(timeout=timeout)
            os.close(master)
        elif case.where == "cli pipe":  # `| head -1`: read one line, then close the pipe
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env)
            first = proc.stdout.readline()
            proc.stdout.close()
            err = proc.stderr.read()
            proc.wait(timeout=timeout)
            out = first
        elif case.where == "cli stdout":  # stdout closed (`>&-`) or on a full device (/dev/full)
            closed = case.meta["stdout"] == "closed"
            with open(os.devnull if closed else case.meta["stdout"], "wb") as sink:
                proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.PIPE, env=env,
                                      timeout=timeout, preexec_fn=(lambda: os.close(1)) if closed else None)
            out, err = b"", proc.stderr
        else:
            stdin = case.stdin(tmp) if callable(case.stdin) else case.stdin
            done = subprocess.run(argv, input=stdin if stdin is not None else b"", capture_output=True,
                                  timeout=timeout, stdin=None, env=env)
            proc, out, err = done, done.stdout, done.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"ok": False, "exit": None, "observed": f"HANG: no exit in {timeout:.0f} s", "answers": 0,
                "traceback": False, "seconds": round(time.monotonic() - start, 1)}
    err = err.decode(errors="replace").replace(str(tmp), "TMP")  # before the message is cut to length
    result = judge(case, code, out.decode(errors="replace"), err)
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _interrupted(case: Case, argv: list, tmp: Path, timeout: float, env: dict) -> dict:
    """A stop signal once the second question is on stdout and its answer has not ended: exit 128+n, every
    answer ended before it whole on stdout, nothing after it, the one "stopped" line on stderr."""
    def default_sigint():  # a shell's background job ignores SIGINT, and its children would inherit that
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=default_sigint)
    seen, questions = [], 0
    try:
        while questions < 2:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            questions += b"] Q: " in line
        proc.send_signal(getattr(signal, case.meta["signal"]))
        rest, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"ok": False, "exit": None, "observed": f"HANG: no exit in {timeout:.0f} s after the signal",
                "answers": 0, "traceback": False}
    out = b"".join(seen) + rest
    result = judge(case, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    text = out.decode(errors="replace")
    ended = text.count("s to first token")
    mid = questions == 2 and ended == 1  # the signal came before the second answer ended
    stopped = "stopped; every answer given so far is above" in err.decode(errors="replace")
    result["ok"] = result["ok"] and ended >= 1 and stopped
    result["answers"] = ended
    result["observed"] = (f"exit {proc.returncode}, {ended} answer(s) whole on stdout, signal "
                          f"{'mid-answer' if mid else 'between answers'}" + ("" if stopped else ", no 'stopped' line")
                          + (" [TRACEBACK]" if result["traceback"] else ""))
    return result


def _killed(case: Case, argv: list, tmp: Path, timeout: float, env: dict) -> dict:
    """`kill -9` once two answers are in the file stdout goes to: every line in it is a whole JSON answer."""
    path = tmp / "transcript.jsonl"
    with open(path, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and path.read_bytes().count(b"\n") < case.meta.get("answers", 1):
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.kill()
        err = proc.communicate()[1].decode(errors="replace")
    data = path.read_bytes()
    lines = data.decode(errors="replace").splitlines()
    whole = 0
    for line in lines:
        try:
            whole += "answer" in json.loads(line)
        except json.JSONDecodeError:
            break
    ends = not data or data.endswith(b"\n")
    intact = whole == len(lines) and ends
    traceback = "Traceback (most recent call last)" in err
    ok = proc.returncode == case.exit_code and intact and whole >= case.meta.get("answers", 1) and not traceback
    return {"ok": ok, "exit": proc.returncode, "answers": whole, "traceback": traceback,
            "observed": f"exit {proc.returncode}, {whole} of {len(lines)} line(s) whole JSON answers, "
                        f"{'ends on a line break' if ends else 'a cut last line'}"}


def run_library(case: Case, tmp: Path, adapter) -> dict:
    """The call must raise an error matching `expected`, or, for PLAYS, return (what it says is observed)."""
    try:
        said = case.call(adapter, *case.build(tmp))
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        ok = case.expected != PLAYS and re.search(case.expected, text) is not None
        return {"ok": ok, "exit": None, "observed": f"{type(err).__name__}: {text[:160]}", "answers": 0,
                "traceback": False}
    ok = case.expected == PLAYS
    return {"ok": ok, "exit": None, "observed": str(said)[:200] if ok else "no error raised", "answers": 0,
            "traceback": False}


def server_rows(folder: Path, only: str | None) -> list[dict]:
    """The server's rows (server.py), against one `python -m serve` of their own."""
    from . import server, serving

    if only and not any(re.search(only, row.name) for row in server.ROWS):
        return []
    tmp = folder / "server"
    tmp.mkdir()
    with serving.serving(tmp) as (url, media, process):
        rows = server.run_rows(url, media, only, pid=process.pid)
        alive = process.poll() is None
    for row in rows:
        row["traceback"] = "Traceback" in row["observed"]
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['input']}: {row['observed']}", flush=True)
    if not alive:
        rows.append({"input": "the server after every row", "where": "server", "expected": "still running",
                     "observed": "exited", "ok": False, "traceback": False})
    return rows


def run(args) -> int:
    """Every case as its own process (library cases in this one); JSON and Markdown under --out."""
    from models import load_adapter  # torch, for the library cases only: the others run in their own processes

    adapter = None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in [] if getattr(args, "server", False) else CASES:
            if args.only and not re.search(args.only, case.name):
                continue
            tmp = Path(folder) / re.sub(r"\W+", "_", case.name)
            tmp.mkdir()
            if case.where == "library":
                adapter = adapter or load_adapter("tiny-vlm")
                result = run_library(case, tmp, adapter)
            else:
                result = run_subprocess(case, tmp)
            result["observed"] = result["observed"].replace(str(tmp), "TMP")  # no machine-specific paths
            row = {"input": case.name, "where": case.where, "expected": expected_text(case), **result}
            rows.append(row)
            print(f"{'ok ' if result['ok'] else 'BAD'} {case.name}: {result['observed']}", flush=True)
        rows += server_rows(Path(folder), args.only)
    rows = write(rows, Path(args.out), partial=bool(args.only or getattr(args, "server", False)))
    bad = [r for r in rows if not r["ok"]]
    hangs = sum(r["observed"].startswith("HANG") for r in rows)
    print(f"reliability: {len(rows) - len(bad)} of {len(rows)} cases as expected; "
          f"{sum(r.get('traceback', False) for r in rows)} tracebacks, {hangs} hangs", file=sys.stderr)
    return 1 if bad else 0
