"""Judging a case's outcome and writing the table.

A case passes only on the exit code it expects, one clean `stream-qa:` line (or the answers it
expects) and no traceback anywhere: a right exit code with a traceback above it is still a bug a user
sees. The table is `reliability.json` (one row per case) and the same rows as Markdown for the README.
"""

import json
import re
from pathlib import Path

from streaming.records import machine

from .cases import PLAYS, Case


def _answers(stdout: str) -> int:
    n = 0
    for line in stdout.splitlines():
        try:
            n += "answer" in json.loads(line)
        except (json.JSONDecodeError, TypeError):
            n += line.startswith("[") and "Q:" in line
    return n


def judge(case: Case, code: int, stdout: str, stderr: str) -> dict:
    """What happened, and whether it is what the case expects: the right exit, one clean line, no traceback."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    traceback = "Traceback (most recent call last)" in stderr or "Fatal Python error" in stderr
    answers = _answers(stdout)
    if case.expected == PLAYS:
        ok = code == case.exit_code and not traceback and answers >= case.meta.get("answers", 1)
        observed = f"exit {code}, {answers} answer(s)"
        if case.warns:
            warning = next((line for line in lines if re.search(case.warns, line)), None)
            ok = ok and warning is not None
            observed += f"; {warning[:200] if warning else 'no warning matching the case'}"
    else:
        ok = (code == case.exit_code and not traceback and last.startswith("stream-qa: ")
              and re.search(case.expected, last) is not None)
        observed = f"exit {code}: {last[:160]}"
    return {"ok": ok, "exit": code, "observed": observed + (" [TRACEBACK]" if traceback else ""),
            "answers": answers, "traceback": traceback}


def expected_text(case: Case) -> str:
    if case.expected == PLAYS and case.where == "library":
        return f"returns, no error ({case.notes})"
    if case.expected == PLAYS:
        return f"exit {case.exit_code}" + (", answers" if case.meta.get("answers", 1) else "") + \
            (f" ({case.notes})" if case.notes else "")
    if case.where == "library":
        return f"error matching /{case.expected}/"
    return f"exit {case.exit_code}, one line matching /{case.expected}/"


def markdown(rows: list[dict]) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("`", "'")

    head = "| # | input | where | expected | observed | ok |\n|---|---|---|---|---|---|\n"
    lines = [f"| {i} | {cell(r['input'])} | {r['where']} | {cell(r['expected'])} | {cell(r['observed'])} | "
             f"{'yes' if r['ok'] else '**no**'} |\n" for i, r in enumerate(rows, 1)]
    return head + "".join(lines)


def write(rows: list[dict], out: Path, partial: bool) -> list[dict]:
    """`reliability.json` and `.md` under `out`; a partial run (`--only`) updates the committed rows in
    place and appends new ones, so re-running one case does not drop the rest. Returns the rows written."""
    out.mkdir(parents=True, exist_ok=True)
    if partial and (out / "reliability.json").exists():
        fresh = {r["input"]: r for r in rows}
        old = json.loads((out / "reliability.json").read_text())
        old = old["records"] if isinstance(old, dict) else old  # files before the machine header: a bare list
        rows = [fresh.pop(r["input"], r) for r in old] + list(fresh.values())
    (out / "reliability.json").write_text(json.dumps({"machine": machine(), "records": rows}, indent=1) + "\n")
    (out / "reliability.md").write_text(markdown(rows))
    return rows
