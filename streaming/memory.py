"""Memory probes and `--budget auto`, device-neutral: CPU, a discrete CUDA GPU, or a Jetson Orin.

One `probe()` reports what a long stream needs watched: process RSS, torch's CUDA allocator
(allocated, reserved, peak), system MemAvailable and swap, and per device kind its own view — NVML on
x86 CUDA when `nvidia-ml-py` is installed, `NvMapMemUsed` on a Jetson (CPU and GPU share one
memory, so MemAvailable is the GPU's free memory too). `jetson/` adds tegrastats and power modes.

`auto_budget` turns free memory into a KV budget in bytes, keeping a reserve and a share of the
rest for everything else; the margins are per device kind because an out-of-memory kill on an Orin
takes the whole device's workload with it, while a discrete GPU's memory is the GPU's alone.
"""

import ctypes
import ctypes.util
import functools
import os
import re
import time
from dataclasses import asdict, dataclass, field

import psutil

MB = 2**20
GIB = 2**30

# kind: (bytes always left free, share of the rest the KV cache may take)
MARGINS = {
    "cpu": (1 * GIB, 0.5),
    "orin": (int(1.5 * GIB), 0.4),  # unified memory: the GPU allocates from MemAvailable too
    "cuda": (512 * MB, 0.7),  # free device memory after the model is loaded; host RAM is not at stake
}


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per key ("MemAvailable: 123 kB" → 125952); unitless counts stay counts."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\w()]+):\s+(\d+)(?:\s+(kB))?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    try:
        with open(path) as f:
            return parse_meminfo(f.read())
    except OSError:  # not Linux: psutil below still answers
        return {}


def _torch():
    """torch if it is already imported or importable; probes never fail for want of it."""
    try:
        import torch  # lazy: the CPU probe and `stream-qa`'s early checks run before (or without) torch

        return torch
    except ImportError:
        return None


def device_kind(device: str | None = "cpu") -> str:
    """"cpu", "cuda" (a discrete GPU) or "orin" (an integrated GPU sharing system memory)."""
    if device is None or not str(device).startswith("cuda"):
        return "cpu"
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return "cpu"
    index = torch.device(device).index or 0
    return "orin" if torch.cuda.get_device_properties(index).is_integrated else "cuda"


def _nvml(index: int) -> dict:
    """Device memory from NVML (x86 CUDA); {} where nvidia-ml-py is not installed or NVML fails."""
    try:
        import pynvml  # optional: nvidia-ml-py is there only on CUDA machines that installed it
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return {"nvml_used_mb": info.used / MB, "nvml_total_mb": info.total / MB}
    except pynvml.NVMLError:
        return {}


@dataclass
class MemorySample:
    """One reading; None where the device kind has no such number."""

    kind: str
    rss_mb: float
    mem_total_mb: float
    mem_available_mb: float
    swap_total_mb: float
    swap_used_mb: float
    t: float = field(default_factory=time.time)
    torch_allocated_mb: float | None = None  # CUDA caching allocator (CPU tensors live in RSS)
    torch_reserved_mb: float | None = None
    torch_peak_mb: float | None = None
    gpu_free_mb: float | None = None  # discrete GPU: cudaMemGetInfo
    gpu_total_mb: float | None = None
    nvmap_used_mb: float | None = None  # Jetson: memory pinned for the GPU and engines
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in {**d, **extra}.items()}


def probe(device: str | None = "cpu", meminfo: dict[str, int] | None = None) -> MemorySample:
    """Read memory now. `meminfo` replaces /proc/meminfo (recorded samples in tests)."""
    kind = device_kind(device)
    info = read_meminfo() if meminfo is None else meminfo
    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    total = info.get("MemTotal", vm.total)
    available = info.get("MemAvailable", vm.available)
    swap_total = info.get("SwapTotal", swap.total)
    swap_used = swap_total - info["SwapFree"] if "SwapFree" in info else swap.used
    sample = MemorySample(kind, psutil.Process(os.getpid()).memory_info().rss / MB, total / MB, available / MB,
                          swap_total / MB, swap_used / MB)
    if "NvMapMemUsed" in info:
        sample.nvmap_used_mb = info["NvMapMemUsed"] / MB
    if kind != "cpu":
        torch = _torch()
        index = torch.device(device).index or 0
        sample.torch_allocated_mb = torch.cuda.memory_allocated(index) / MB
        sample.torch_reserved_mb = torch.cuda.memory_reserved(index) / MB
        sample.torch_peak_mb = torch.cuda.max_memory_allocated(index) / MB
        free, gpu_total = torch.cuda.mem_get_info(index)
        sample.gpu_free_mb, sample.gpu_total_mb = free / MB, gpu_total / MB
        if kind == "cuda":
            sample.extra.update(_nvml(index))
    return sample


@dataclass(frozen=True)
class AutoBudget:
    bytes: int
    free_bytes: int
    kind: str
    reserve_bytes: int
    share: float

    def explain(self) -> str:
        return (f"{self.bytes / MB:.0f} MB for the KV cache: {self.share:.0%} of the {self.free_bytes / MB:.0f} MB "
                f"free on {self.kind} after keeping {self.reserve_bytes / MB:.0f} MB in reserve")


def free_bytes(sample: MemorySample) -> int:
    """What the KV cache could still take: device memory on a discrete GPU, MemAvailable otherwise
    (on an Orin that is the GPU's memory too; swap is not counted, the GPU cannot use it)."""
    if sample.kind == "cuda" and sample.gpu_free_mb is not None:
        return int(sample.gpu_free_mb * MB)
    return int(sample.mem_available_mb * MB)


def auto_budget(sample: MemorySample | None = None, device: str | None = "cpu") -> AutoBudget:
    """The KV budget in bytes from free memory now (call it after the model has loaded)."""
    sample = sample or probe(device)
    reserve, share = MARGINS[sample.kind]
    free = free_bytes(sample)
    return AutoBudget(int(max(free - reserve, 0) * share), free, sample.kind, reserve, share)


def budget_tokens(auto: AutoBudget, bytes_per_token: int, context_length: int, headroom: int) -> int:
    """Tokens per layer for an auto budget: its bytes over the cache's bytes per token (all layers),
    capped so budget + one turn + one answer (`headroom`) stays inside the model's trained context."""
    return max(0, min(auto.bytes // max(bytes_per_token, 1), context_length - headroom))


# glibc's own, adaptive mmap threshold is left as it is. A fixed one of 256 KiB (set by stream-qa and the
# soak until stop 38) gave each of the vision encoder's activations a fresh mapping, page-faulted anew on
# every op: ingest of bikes.mp4 ran at 2.2-2.9x real time instead of 5-6x, a soak round took 0.59 s instead
# of 0.42 s. Without it a 1,000-round soak is as flat (+0.0009 ± 0.0025 MB/round) and holds ~90 MB more.
# What stays tuned is the number of arenas (`limit_malloc_arenas`, called on `import streaming`).
@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the OS (glibc's `malloc_trim`; False elsewhere), so that an RSS
    reading taken for a leak check shows live memory, not what the allocator kept after threads came
    and went (±30 MB of noise between readings without it, ±10 MB with it)."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim and trim(0))


def limit_malloc_arenas(count: int = 2) -> bool:
    """glibc gives new threads new malloc arenas (up to 8 per core), and an arena keeps what its thread
    freed: with an ingest thread per engine, RSS grew 58 MB over 80 engines in one run of five
    (`test_100_engines_…`), and 3-10 MB with two arenas. A user's MALLOC_ARENA_MAX wins; False where
    nothing was set (that, or not glibc)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if "MALLOC_ARENA_MAX" in os.environ or mallopt is None:
        return False
    m_arena_max = -8
    return bool(mallopt(m_arena_max, count))
