"""The README as a newcomer meets it: every command in it, run verbatim, in order, from the repository's root, in a
shell whose PATH does not hold .venv/bin (the README says how to get there). `make test` is this suite (CI runs it);
a block that is only `make ui` or `make serve` starts that server, which the blocks after it talk to until the
next server starts or the README ends; a Python block runs with the venv's interpreter, as the README says."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"```(sh|python)\n(.*?)```", re.S)
QUIET = ("Loading weights", "XNNPACK", "Converting and de-quantizing")
SERVERS = {"make ui": "http://127.0.0.1:7860/", "make serve": "http://127.0.0.1:8000/healthz"}


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(README.read_text())


def commands(body: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip() and not line.startswith("#")]


def newcomer_env() -> dict:
    """The environment of a shell that has not activated .venv."""
    venv = str(ROOT / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p.rstrip("/") != venv)
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")} | {"PATH": path}


def test_the_readme_is_short_and_starts_with_the_two_commands_ci_runs():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150 and not re.search(r"\bissue \d", README.read_text())
    first = commands(blocks()[0][1])
    assert first == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()


class Server:
    """A server a README block starts, in its own process group so that stopping it stops make's children too."""

    def __init__(self, command: str, log: Path):
        self.url, self.log = SERVERS[command], log
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=newcomer_env(), start_new_session=True,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{command} ended: {log.read_text()[-2000:]}"
            try:
                if httpx.get(self.url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        raise AssertionError(f"{command} did not answer at {self.url}: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        said = self.log.read_text()
        assert not [noise for noise in (*QUIET, "Warning") if noise in said], said[-2000:]


def run_block(lang: str, body: str) -> subprocess.CompletedProcess:
    if lang == "python":
        argv = [str(ROOT / ".venv" / "bin" / "python"), "-c", body]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", body]
    return subprocess.run(argv, cwd=ROOT, env=newcomer_env(), capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_every_command_of_the_readme_runs_verbatim(tmp_path):
    """Each block exits 0 and prints; the demo answers its seven questions; the server's session answers."""
    server, outputs = None, []
    try:
        for i, (lang, body) in enumerate(blocks()):
            cmds = commands(body)
            if lang == "sh" and len(cmds) == 1 and cmds[0] in SERVERS:
                if server is not None:
                    server.stop()
                server = Server(cmds[0], tmp_path / f"server-{i}.log")
                continue
            if cmds == ["make demo", "make test"]:  # this suite is `make test`; the demo runs
                body = "make demo"
            run = run_block(lang, body)
            assert run.returncode == 0 and run.stdout.strip(), (body, run.stdout[-2000:], run.stderr[-2000:])
            assert "Traceback" not in run.stderr, (body, run.stderr[-3000:])
            for noise in QUIET:  # the loaders' progress bars and native INFO lines: -v shows them
                assert noise not in run.stderr, (body, noise)
            outputs.append(run.stdout)
    finally:
        if server is not None:
            server.stop()
    demo, own, watch = outputs[0], outputs[1], outputs[2]
    assert demo.count(" A: ") == 7 and own.count(" A: ") >= 2
    assert "ALERT a person: a person   (clip 2;" in watch and "ALERT the car leaves" in watch  # as the README shows
    assert '"answer":' in outputs[3] and '"video_t":0.0' in outputs[3]  # the pushed frame, asked about after it
    assert outputs[4].strip().split()[-1] == "9.0"  # OpenAI's client: the answer about the last of the 10 frames


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
