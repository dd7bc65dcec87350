"""tiny-vlm on real photographs: `python -m benchmarks real_scenes`.

The photos are scikit-image's sample data (shipped in its wheel: a cat, a coffee cup, a rocket, a
cameraman, a motorcycle, a clock, an astronaut, a horse silhouette and three textures). Each becomes
a clip of four frames, a slow zoom into its centre; three short videos of four clips each stream
through a tiny-vlm session (full cache). After each clip the viewer asks what is in the video, whether
the clip's object is there, whether another photo's object is there, and which animal or vehicle it
saw; after the last clip, about each earlier clip by number. Answers are scored against hand-written
synonym lists.

Reported: accuracy per kind of question; the same over the clips whose classifier top-5 (mean
probabilities over the clip's frames) names the object, the subset the issue's goal is about; and
the share of answers free of hallucination, where an answer hallucinates when it names a thing
(an ImageNet class or its everyday word) the clip's labels do not contain, or says "yes" to a thing
they do not contain. Then, for every ordered pair of photos whose turns name their thing, a clip of
each and "is there a X?" about the latest, X the earlier one's thing (`earlier_things`;
`real_scenes_pairs.json`). `python -m benchmarks.real_scenes --weights DIR` runs other weights.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .common import machine, print_table, record, write

FRAMES = 4  # frames per clip: zoom 1.0, 0.9, 0.8, 0.7 into the centre
SIZE = 256


@dataclass(frozen=True)
class Photo:
    name: str  # skimage.data function
    thing: str | None  # the word a viewer uses for it ("is there a cat?"); None for textures
    synonyms: tuple[str, ...] = ()  # answers that name it rightly
    kind: str | None = None  # "animal" or "vehicle": asked "what animal/vehicle did you see?"


PHOTOS = {
    "chelsea": Photo("chelsea", "cat", ("cat", "egyptian mau", "tabby", "tiger cat"), "animal"),
    "coffee": Photo("coffee", "cup", ("cup", "coffee", "espresso", "mug")),
    "rocket": Photo("rocket", "rocket", ("rocket", "missile", "projectile", "space shuttle")),
    "camera": Photo("camera", "camera", ("camera",)),
    "motorcycle": Photo("stereo_motorcycle", "motorcycle", ("motorcycle", "moped", "scooter", "motorbike"), "vehicle"),
    "clock": Photo("clock", "clock", ("clock",)),
    "astronaut": Photo("astronaut", "astronaut", ("astronaut", "person", "man", "woman", "space suit")),
    "horse": Photo("horse", "horse", ("horse", "sorrel"), "animal"),
    "brick": Photo("brick", None),
    "grass": Photo("grass", None),
    "gravel": Photo("gravel", None),
}
VIDEOS = (("chelsea", "coffee", "rocket", "camera"), ("motorcycle", "clock", "astronaut", "horse"),
          ("brick", "grass", "gravel", "chelsea"))
OTHER = {"chelsea": "bicycle", "coffee": "dog", "rocket": "cat", "camera": "car", "motorcycle": "cat",
         "clock": "horse", "astronaut": "bird", "horse": "cup", "brick": "cat", "grass": "dog", "gravel": "car"}


def photo(name: str) -> np.ndarray:
    """A sample photo as uint8 RGB (grey and binary images repeated over the channels)."""
    from skimage import data  # scikit-image is optional (the `data` extra): only this benchmark needs it

    image = getattr(data, PHOTOS[name].name)()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    image = np.asarray(image)
    if image.dtype == bool:
        image = image.astype(np.uint8) * 255
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return np.ascontiguousarray(image[..., :3].astype(np.uint8))


def clip_frames(image: np.ndarray, frames: int = FRAMES) -> np.ndarray:
    """A slow zoom into the photo's centre: (frames, SIZE, SIZE, 3) uint8."""
    h, w = image.shape[:2]
    out = []
    for k in range(frames):
        side = int(min(h, w) * (1.0 - 0.1 * k))
        top, left = (h - side) // 2, (w - side) // 2
        crop = Image.fromarray(image[top:top + side, left:left + side])
        out.append(np.asarray(crop.resize((SIZE, SIZE), Image.BILINEAR)))
    return np.stack(out)


def names_any(answer: str, synonyms) -> bool:
    answer = answer.lower()
    return any(s in answer for s in synonyms)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def questions_now(p: Photo) -> list[tuple[str, str, str]]:
    """(kind, question, expected) asked right after clip of photo `p`; expected "yes"/"no"/"thing"/"none"."""
    out = [("what", "what is in the video?", "thing" if p.thing else "-")]
    if p.thing:
        out.append(("is_there", f"is there {article(p.thing)} {p.thing}?", "yes"))
    other = OTHER[next(k for k, v in PHOTOS.items() if v == p)]
    out.append(("is_there", f"is there {article(other)} {other}?", "no"))
    if p.kind:
        out.append(("which", f"what {p.kind} did you see?", "thing"))
    else:  # present tense: the training's questions are about the clip they name, or the latest one
        out.append(("which", "what animal is in the video?", "none"))
    return out


def score(answer: str, expected: str, p: Photo) -> bool | None:
    """None where nothing is expected (what a texture shows)."""
    a = answer.strip().lower()
    if expected == "yes":
        return a.startswith("yes")
    if expected == "no":
        return a.startswith("no")
    if expected == "none":
        return a.startswith("no ") or a == "nothing recognised"
    if expected == "thing":
        return names_any(a, p.synonyms)
    return None


def hallucinates(question: str, answer: str, labels, more: bool = False) -> bool:
    from models.tiny_vlm.labels import unsupported  # models load torch: the CLI checks its arguments first

    a = answer.strip().lower()
    if question.startswith("is there") or ", is there" in question:
        if not a.startswith("yes"):
            return False
        thing = question.rstrip("?").split("is there ", 1)[1].split(" ", 1)[1]
        return bool(unsupported(thing, labels, more))
    return bool(unsupported(a, labels, more))


def evaluate(vlm, progress: bool = True) -> tuple[dict, list[dict]]:
    """Scores by kind (`what`, `is_there`, `which`, `earlier`, `all`, `top5_<same>`, `free_of_hallucination`)
    and the transcript."""
    from models.tiny_vlm.labels import listing, names  # torch, as in `hallucinates`

    rows, more = [], vlm.perception.more_words
    for v, video in enumerate(VIDEOS, start=1):
        session = vlm.new_session("full")
        clips = []
        for k, name in enumerate(video, start=1):
            p = PHOTOS[name]
            frames = clip_frames(photo(name))
            visual, probs = vlm.encode_parts(frames)
            labels = vlm.fit_labels(vlm.perceive(frames, probs))  # what the turn carries
            top5 = [names()[i].lower() for i in probs.mean(dim=0).topk(5).indices.tolist()]
            in_top5 = bool(p.thing) and any(s in n for n in top5 for s in p.synonyms)
            vlm.append_clip(session, vlm.encoded(visual, labels), k, float(2 * (k - 1)), float(2 * k))
            clips.append((name, labels, in_top5))
            for kind, question, expected in questions_now(p):
                rows.append(_ask(vlm, session, v, k, name, kind, question, expected, labels, in_top5, top5))
                if progress:
                    r = rows[-1]
                    print(f"video {v} clip {k} [{listing(labels, more)}] {question} → {r['answer']!r} "
                          f"({'right' if r['right'] else 'wrong' if r['right'] is False else '-'})", flush=True)
        for k, (name, labels, in_top5) in enumerate(clips[:-1], start=1):
            p = PHOTOS[name]
            if not p.thing:
                continue
            for question, expected in ((f"In clip {k}, what do you see?", "thing"),
                                       (f"In clip {k}, is there {article(p.thing)} {p.thing}?", "yes")):
                rows.append(_ask(vlm, session, v, k, name, "earlier", question, expected, labels, in_top5, []))
                if progress:
                    print(f"video {v} (after clip {len(video)}) {question} → {rows[-1]['answer']!r}", flush=True)
    scores: dict[str, float] = {}
    for subset, keep in (("", lambda r: True), ("top5_", lambda r: r["in_top5"])):
        chosen = [r for r in rows if r["right"] is not None and keep(r)]
        for kind in ("what", "is_there", "which", "earlier"):
            hits = [r["right"] for r in chosen if r["kind"] == kind]
            if hits:
                scores[f"{subset}{kind}"] = sum(hits) / len(hits)
        if chosen:
            scores[f"{subset}all"] = sum(r["right"] for r in chosen) / len(chosen)
        named = [r["right"] for r in chosen if r["kind"] in ("what", "is_there", "earlier")]
        if named:  # the goal: "what is in the clip?" / "is there a X?", now and about earlier clips
            scores[f"{subset}what_or_is"] = sum(named) / len(named)
    scores["free_of_hallucination"] = 1 - sum(r["hallucination"] for r in rows) / len(rows)
    scores["questions"] = len(rows)
    return scores, rows


def _ask(vlm, session, video, clip, name, kind, question, expected, labels, in_top5, top5) -> dict:
    from models.tiny_vlm.labels import listing  # torch, as in `hallucinates`

    answer = vlm.answer(session, question, max_new_tokens=40)
    right = score(answer, expected, PHOTOS[name])
    more = vlm.perception.more_words
    return {"video": video, "clip": clip, "photo": name, "labels": listing(labels, more), "top5": top5,
            "in_top5": in_top5, "kind": kind, "question": question, "answer": answer, "expected": expected,
            "right": right, "hallucination": hallucinates(question, answer, labels, more)}


def earlier_things(vlm) -> tuple[dict, list[dict]]:
    """"is there a X?" about the latest of two clips, X the earlier clip's thing, for every ordered pair of
    photos whose turns name their thing (and where the latest's does not): {"latest_not_earlier": share
    answered no, "latest_thing": share of the latest clip's own thing answered yes}. The training's other
    negatives name random classes, almost never one in context; this asks the one that is."""
    from itertools import permutations

    from models.tiny_vlm.labels import words_of_all
    from models.tiny_vlm.scenes import absent

    turns = {}
    for name, p in PHOTOS.items():
        if p.thing:
            frames = clip_frames(photo(name))
            visual, probs = vlm.encode_parts(frames)
            turns[name] = (visual, vlm.fit_labels(vlm.perceive(frames, probs)))
    more = vlm.perception.more_words

    def names(labels, thing: str) -> bool:
        return not absent(thing, words_of_all(labels, more))

    rows = []
    for first, latest in permutations([n for n, (_, labels) in turns.items() if names(labels, PHOTOS[n].thing)], 2):
        if names(turns[latest][1], PHOTOS[first].thing):
            continue
        session = vlm.new_session("full")
        for k, name in enumerate((first, latest), start=1):
            vlm.append_clip(session, vlm.encoded(*turns[name]), k, float(2 * (k - 1)), float(2 * k))
        for thing, expected in ((PHOTOS[first].thing, "no"), (PHOTOS[latest].thing, "yes")):
            answer = vlm.answer(session, f"is there {article(thing)} {thing}?", max_new_tokens=8)
            rows.append({"first": first, "latest": latest, "thing": thing, "answer": answer, "expected": expected,
                         "right": answer.strip().lower().startswith(expected)})
    scores = {}
    for key, expected in (("latest_not_earlier", "no"), ("latest_thing", "yes")):
        hits = [r["right"] for r in rows if r["expected"] == expected]
        scores[key] = sum(hits) / len(hits) if hits else float("nan")
    return scores, rows


ORDER = ("what", "is_there", "which", "earlier", "what_or_is", "all", "top5_what", "top5_is_there", "top5_which",
         "top5_earlier", "top5_what_or_is", "top5_all", "free_of_hallucination", "latest_not_earlier", "latest_thing")


def run(args):
    from models.tiny_vlm.model import WEIGHTS, TinyVLM  # torch, as in `hallucinates`

    weights = Path(getattr(args, "weights", None) or WEIGHTS)
    vlm = TinyVLM(weights, perception=getattr(args, "perception", None))
    scores, rows = evaluate(vlm)
    pairs, pair_rows = earlier_things(vlm)
    scores |= pairs
    records = [record("real_scenes", "full", None, "accuracy", scores[x], x) for x in ORDER if x in scores]
    print(f"{scores['questions']} questions on {sum(map(len, VIDEOS))} clips of real photos ({weights}, "
          f"perception {vlm.perception})")
    print_table(records, ["accuracy"])
    path = write(args.out, "real_scenes", records, [])
    where = machine()
    path.with_name("real_scenes_answers.json").write_text(json.dumps({"machine": where, "answers": rows}, indent=1))
    path.with_name("real_scenes_pairs.json").write_text(json.dumps({"machine": where, "pairs": pair_rows}, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_scenes", description=__doc__.splitlines()[0])
    parser.add_argument("--weights", help="a tiny-vlm weights folder (default: the committed weights)")
    parser.add_argument("--perception", help="a perception preset (models/tiny_vlm/perception.py)")
    parser.add_argument("--out", default="benchmarks/results")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
