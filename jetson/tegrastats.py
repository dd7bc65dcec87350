"""Jetson-only readings: tegrastats lines and the nvpmodel power mode.

`tegrastats` prints one line per interval (RAM and swap as the kernel sees them, per-core load, GPU
load, temperatures, power rails); its format differs between JetPack releases and modules, so the
parser takes each field where it is present and ignores what it does not know.
"""

import re
import shutil
import subprocess
import threading

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB(?: \(lfb (\d+)x(\d+)MB\))?")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB(?: \(cached (\d+)MB\))?")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_GPU = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?(\d+)(?:,\d+)*\]?)?")
_EMC = re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?")
_TEMP = re.compile(r"\b([A-Za-z][\w]*)@(-?\d+(?:\.\d+)?)C\b")
_RAIL = re.compile(r"\b((?:VDD|VIN)_\w+) (\d+)(?:mW)?/(\d+)(?:mW)?\b")
_STAMP = re.compile(r"^(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d) ")


def parse_tegrastats(line: str) -> dict:
    """One tegrastats line → {"ram_used_mb", "ram_total_mb", "swap_used_mb", "cpu", "gpu_load_pct",
    "temps_c", "power_mw", …}; fields missing from the line are missing from the dict."""
    out: dict = {}
    if m := _STAMP.match(line):
        out["timestamp"] = m.group(1)
    if m := _RAM.search(line):
        out["ram_used_mb"], out["ram_total_mb"] = int(m.group(1)), int(m.group(2))
        if m.group(3):  # largest free blocks: fragmentation of the memory the GPU allocates from
            out["lfb_blocks"], out["lfb_block_mb"] = int(m.group(3)), int(m.group(4))
    if m := _SWAP.search(line):
        out["swap_used_mb"], out["swap_total_mb"] = int(m.group(1)), int(m.group(2))
        if m.group(3):
            out["swap_cached_mb"] = int(m.group(3))
    if m := _CPU.search(line):
        cores = []
        for core in m.group(1).split(","):
            c = re.fullmatch(r"(\d+)%@(\d+)", core.strip())
            cores.append({"load_pct": int(c.group(1)), "mhz": int(c.group(2))} if c else None)  # None: off
        out["cpu"] = cores
    if m := _GPU.search(line):
        out["gpu_load_pct"] = int(m.group(1))
        if m.group(2):
            out["gpu_mhz"] = int(m.group(2))
    if m := _EMC.search(line):
        out["emc_load_pct"] = int(m.group(1))
    temps = {name.lower(): float(v) for name, v in _TEMP.findall(line) if float(v) > -200}  # -256C: no sensor
    if temps:
        out["temps_c"] = temps
    rails = {name: {"now": int(now), "avg": int(avg)} for name, now, avg in _RAIL.findall(line)}
    if rails:
        out["power_mw"] = rails
    return out


def parse_nvpmodel(text: str) -> dict:
    """`nvpmodel -q` output ("NV Power Mode: MAXN" then the mode id) → {"name", "id"}."""
    out: dict = {}
    if m := re.search(r"NV Power Mode:\s*(\S+)", text):
        out["name"] = m.group(1)
    if m := re.search(r"^\s*(\d+)\s*$", text, re.M):
        out["id"] = int(m.group(1))
    return out


def power_mode() -> dict:
    """The current nvpmodel mode, or {} off a Jetson."""
    exe = shutil.which("nvpmodel")
    if exe is None:
        return {}
    try:
        done = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_nvpmodel(done.stdout)


class Tegrastats:
    """`tegrastats --interval MS` on a thread, keeping its latest parsed line; inert where it is absent."""

    def __init__(self, interval_ms: int = 1000, exe: str | None = None):
        self.exe = exe or shutil.which("tegrastats")
        self.interval_ms, self.latest, self.proc = interval_ms, {}, None

    @property
    def available(self) -> bool:
        return self.exe is not None

    def start(self) -> "Tegrastats":
        if self.exe and self.proc is None:
            self.proc = subprocess.Popen([self.exe, "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True, name="tegrastats").start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            parsed = parse_tegrastats(line)
            if parsed:
                self.latest = parsed

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=5)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
