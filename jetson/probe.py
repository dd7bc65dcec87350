"""`python -m jetson probe`: one memory reading with everything this device can tell.

`streaming.memory.probe` gives the device-neutral part (RSS, torch allocator, MemAvailable, swap,
NvMap, NVML); on a Jetson this adds the latest tegrastats line and the nvpmodel power mode.
"""

import json
import time

from streaming.memory import auto_budget, probe

from .tegrastats import Tegrastats, power_mode


def probe_all(device: str = "cpu", tegrastats: Tegrastats | None = None) -> dict:
    sample = probe(device)
    out = sample.as_dict()
    if tegrastats is not None and tegrastats.latest:
        out["tegrastats"] = tegrastats.latest
    mode = power_mode()
    if mode:
        out["power_mode"] = mode
    auto = auto_budget(sample)
    out["auto_budget_mb"] = round(auto.bytes / 2**20, 1)
    out["auto_budget"] = auto.explain()
    return out


def describe(reading: dict) -> str:
    """A few human lines for one reading."""
    r = reading
    lines = [f"device {r['kind']}: process RSS {r['rss_mb']:.0f} MB; system {r['mem_available_mb']:.0f} of "
             f"{r['mem_total_mb']:.0f} MB available; swap {r['swap_used_mb']:.0f} of {r['swap_total_mb']:.0f} MB used"]
    if r.get("torch_allocated_mb") is not None:
        lines.append(f"torch CUDA allocator: {r['torch_allocated_mb']:.0f} MB allocated, "
                     f"{r['torch_reserved_mb']:.0f} MB reserved, {r['torch_peak_mb']:.0f} MB peak; "
                     f"GPU {r['gpu_free_mb']:.0f} of "
                     f"{r['gpu_total_mb']:.0f} MB free")
    else:
        lines.append("torch allocator: CPU tensors (counted in RSS; no CUDA allocator in use)")
    if r.get("nvmap_used_mb") is not None:
        lines.append(f"NvMap (GPU/engine buffers in shared memory): {r['nvmap_used_mb']:.0f} MB")
    if "nvml_used_mb" in r:
        lines.append(f"NVML: {r['nvml_used_mb']:.0f} of {r['nvml_total_mb']:.0f} MB used on the GPU")
    if "tegrastats" in r:
        t = r["tegrastats"]
        lines.append(f"tegrastats: RAM {t.get('ram_used_mb')}/{t.get('ram_total_mb')} MB, GPU {t.get('gpu_load_pct')}%")
    if "power_mode" in r:
        lines.append(f"power mode: {r['power_mode'].get('name')} ({r['power_mode'].get('id')})")
    lines.append(f"--budget auto: {r['auto_budget']}")
    return "\n".join(lines)


def run(args) -> int:
    with Tegrastats(interval_ms=500) as teg:
        if teg.available:
            time.sleep(1.2)  # one line from tegrastats
        for i in range(args.count):
            if i:
                time.sleep(args.interval)
            reading = probe_all(args.device, teg)
            print(json.dumps(reading) if args.json else describe(reading), flush=True)
    return 0
