"""easy-VQA (MIT; one coloured shape per 64-px image) as tiny-vlm's training and test data.

Frame features are computed once per split with the frozen encoder and cached as safetensors
(keyed by a hash of the split's files), so training and evaluation only run the LLM.
"""

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from inf_mllm import AssetError
from inf_mllm.loader import cache_dir

COLOURS = ("red", "green", "blue", "yellow", "teal", "black", "gray", "brown")
SHAPES = ("circle", "rectangle", "triangle")


def answer_type(answer: str) -> str:
    return "colour" if answer in COLOURS else "shape" if answer in SHAPES else "yes/no"


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    image: int


def _package_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("easy_vqa")
    if spec is None or spec.origin is None:
        raise AssetError("easy-VQA data not found: run `pip install easy-vqa==1.0`")
    return Path(spec.origin).parent / "data"


def questions(split: str) -> list[Question]:
    rows = json.loads((_package_dir() / split / "questions.json").read_text())
    return [Question(text, answer, int(image)) for text, answer, image in rows]


def image_paths(split: str) -> dict[int, Path]:
    return {int(p.stem): p for p in (_package_dir() / split / "images").glob("*.png")}


def load_image(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def data_hash(split: str) -> str:
    """sha256 over the split's questions and images, in a fixed order."""
    h = hashlib.sha256((_package_dir() / split / "questions.json").read_bytes())
    for _, path in sorted(image_paths(split).items()):
        h.update(path.read_bytes())
    return h.hexdigest()


def features(split: str, encoder=None) -> dict[int, torch.Tensor]:
    """image id → (tokens, FEATURE_DIM) float16 frame features, computed once and cached."""
    from .encoder import VERSION

    digest = data_hash(split)
    path = cache_dir() / "tiny_vlm" / f"easyvqa-{split}-{digest[:16]}-v{VERSION}.safetensors"
    if path.exists():
        return {int(k): v for k, v in load_file(path).items()}
    from .encoder import FrameEncoder

    encoder = encoder or FrameEncoder()
    paths = sorted(image_paths(split).items())
    out = {}
    for start in tqdm(range(0, len(paths), 64), desc=f"encoding easy-vqa {split}", unit="batch"):
        batch = paths[start:start + 64]
        feats = encoder(np.stack([load_image(p) for _, p in batch]))
        out.update({i: f.half() for (i, _), f in zip(batch, feats, strict=True)})
    save_atomic(path, {str(k): v for k, v in out.items()})
    return out


def save_atomic(path: Path, tensors: dict) -> None:
    """A safetensors cache file written whole or not at all (a stopped run leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def named(question: Question, clip: int) -> str:
    """The question about clip `clip` of a video, e.g. 'In clip 3, what is the color of the shape?'."""
    return named_text(question.text, clip)


def named_text(text: str, clip: int) -> str:
    return f"In clip {clip}, {text}"


@dataclass
class Episode:
    """A video made of easy-VQA images: clips in order, with questions asked after some of them.

    `turns` is a list of ("clip", image id) and ("ask", question text, answer) in stream order;
    the first clip is called `first` (a long stream has clips numbered in the hundreds).
    """

    turns: list
    first: int = 1


def image_labels(qs: list[Question]) -> dict[int, tuple[str, str]]:
    """image id → (colour, shape), read from the image's own colour and shape questions."""
    colour, shape = {}, {}
    for q in qs:
        kind = answer_type(q.answer)
        if kind != "yes/no":
            (colour if kind == "colour" else shape)[q.image] = q.answer
    return {i: (colour[i], shape[i]) for i in colour.keys() & shape.keys()}


class YesNoQuestions:
    """Balanced yes/no questions in easy-VQA's own wordings, about any colour or shape.

    easy-VQA's yes/no answers follow the wording ("is there a red shape?" is mostly no, "is there
    not …" mostly yes), so a model trained on them answers from the wording. Each wording is learnt
    from a train question with its polarity (does "yes" mean the named word is there?); a question
    is then asked about the image's own colour or shape or another one, half and half.
    """

    def __init__(self, qs: list[Question]):
        self.labels = image_labels(qs)
        wordings = set()
        for q in qs:
            words = q.text.rstrip("?").split()
            named = [(w, 0) for w in words if w in COLOURS] + [(w, 1) for w in words if w in SHAPES]
            if q.image not in self.labels or answer_type(q.answer) != "yes/no" or len(named) != 1:
                continue
            (word, part), = named
            present = word == self.labels[q.image][part]
            wordings.add((re.sub(rf"\b{word}\b", "{}", q.text), part, (q.answer == "yes") == present))
        self.wordings = sorted(wordings)

    def __call__(self, rng: random.Random, image: int) -> Question:
        text, part, yes_if_present = rng.choice(self.wordings)
        truth = self.labels[image][part]
        word = truth if rng.random() < 0.5 else rng.choice([w for w in (COLOURS, SHAPES)[part] if w != truth])
        return Question(text.format(word), "yes" if (word == truth) == yes_if_present else "no", image)


def pick_question(rng: random.Random, candidates: list[Question], type_weights: dict[str, float] | None,
                  yes_no: YesNoQuestions | None = None) -> Question:
    """A question on one image. With `type_weights`, its answer type is drawn first, then its answer
    uniformly: easy-VQA is 74% yes/no and 13% colour, and its yes/no answers follow the wording
    ("is there a red shape?" is mostly no, "is there not …" mostly yes), so a model trained on
    uniform draws learns colour names slowly and answers yes/no from the wording alone."""
    if type_weights:
        kind = rng.choices(list(type_weights), weights=list(type_weights.values()))[0]
        if kind == "yes/no" and yes_no and candidates[0].image in yes_no.labels:
            return yes_no(rng, candidates[0].image)
        candidates = [q for q in candidates if answer_type(q.answer) == kind] or candidates
        answer = rng.choice(sorted({q.answer for q in candidates}))
        candidates = [q for q in candidates if q.answer == answer]
    return rng.choice(candidates)


def asks_after(rng: random.Random, k: int, clips: int, asks_per_clip: float, final_asks: int = 1) -> int:
    """How many questions follow clip `k` of `clips`: `asks_per_clip` on average, at least `final_asks`
    after the last. Below one per clip, runs of clips arrive with no question between them, as a
    stream does between a user's questions (weights trained on exactly one question per clip answered
    nothing after ten unasked-about clips of real footage)."""
    n = int(asks_per_clip) + (rng.random() < asks_per_clip % 1)
    return max(n, final_asks) if k == clips else n


def sample_episode(rng: random.Random, by_image: dict[int, list[Question]], clips: int,
                   asks_per_clip: float = 0.6, plain_share: float = 0.3, max_first: int = 1,
                   type_weights: dict[str, float] | None = None, yes_no: YesNoQuestions | None = None,
                   final_asks: int = 1) -> Episode:
    """`clips` clips; after each, about `asks_per_clip` questions on the current or an earlier clip
    (at least `final_asks` after the last; see `asks_after`). A question on the current clip is
    sometimes asked without naming it, as a viewer would ask about what is on screen now. Half the
    episodes number their clips from 1, the others from a random start up to `max_first`. With `yes_no`, only the first
    question about a clip may be yes/no: an earlier answer about it ("red") left in the context lets
    the model compare the question with that word instead of the picture, which a test never allows."""
    images = rng.sample(sorted(by_image), clips)
    first = 1 if max_first <= 1 or rng.random() < 0.5 else rng.randint(2, max_first)
    turns, answered = [], set()
    for k, image in enumerate(images, start=1):
        turns.append(("clip", image))
        for _ in range(asks_after(rng, k, clips, asks_per_clip, final_asks)):
            j = k if rng.random() < 0.4 else rng.randint(1, k)
            weights = type_weights
            if yes_no and type_weights and j in answered:
                weights = {kind: w for kind, w in type_weights.items() if kind != "yes/no"}
            answered.add(j)
            q = pick_question(rng, by_image[images[j - 1]], weights, yes_no)
            text = q.text if j == k and rng.random() < plain_share else named(q, first + j - 1)
            turns.append(("ask", text, q.answer))
    return Episode(turns, first)


def group_by_image(qs: list[Question]) -> dict[int, list[Question]]:
    out: dict[int, list[Question]] = {}
    for q in qs:
        out.setdefault(q.image, []).append(q)
    return out
