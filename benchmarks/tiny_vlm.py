"""tiny-vlm accuracy on held-out easy-VQA questions: one image (all and per answer type) and one named
image among 2, 4 or 8 in context; and on questions answered from the clips' classifier labels
(held-out scene frames with label sets, one clip and a named one among 8). Each clip turn carries its
classifier labels, as at inference. The full cache holds the whole context; this measures the model.
"""

import numpy as np

from models.tiny_vlm.data import features, image_paths, load_image
from models.tiny_vlm.episodes import EpisodeBuilder
from models.tiny_vlm.evaluate import evaluate, evaluate_label_questions
from models.tiny_vlm.labels import label_text
from models.tiny_vlm.model import TinyVLM
from models.tiny_vlm.perception import Perception
from models.tiny_vlm.scenes import easy_labels, scene_frames

from .common import print_table, pyplot, record, write

EASY = ("all", "colour", "shape", "yes/no", "ctx2", "ctx4", "ctx8")
ORDER = EASY + ("labels_what", "labels_is", "labels_which", "labels_ctx8", "labels_distractor_no",
                "labels_distractor_yes")
GOALS = {"all": 0.93, "colour": 0.90, "shape": 0.90, "yes/no": 0.90, "ctx8": 0.85}


def perceived_labels(vlm, split: str = "test") -> dict[int, tuple[int, ...]]:
    """easy-VQA image id → the labels the model's perception gives it, each image a clip of one frame
    (`easy_labels` caches what the committed perception, `frame`, gives)."""
    from models.detector import shared
    from models.tiny_vlm.perception import clip_labels, merge_objects

    paths = sorted(image_paths(split).items())
    out = {}
    for start in range(0, len(paths), 64):
        batch = paths[start:start + 64]
        frames = np.stack([load_image(p) for _, p in batch])
        _, probs = vlm.encoder.encode(frames)
        for (i, _), candidates, frame in zip(batch, vlm.perceiver.candidates(frames, probs), frames, strict=True):
            out[i] = clip_labels([candidates], vlm.perception)
            if vlm.perception.detect:  # the object detector's things first, as a clip turn says them
                out[i] = merge_objects(shared().clip(frame[None]).counts, out[i])
    return out


def run(args):
    n = args.tokens or (100 if args.quick else 1000)  # --tokens: questions per setting
    vlm = TinyVLM(perception=getattr(args, "perception", None))
    held_feats, held_labels = scene_frames("test")
    labels = easy_labels("test")
    if vlm.perception != Perception():
        perceived = perceived_labels(vlm)
        changed = sum(vlm.label_text(perceived[i]) != label_text(labels.get(i, ())) for i in perceived)
        print(f"perception {vlm.perception}: {changed} of {len(perceived)} easy-VQA test images get another label "
              "text than the committed perception's")
        labels = perceived
    builder = EpisodeBuilder(vlm, features("test") | held_feats, labels)
    accuracy = evaluate(vlm, builder, n=n)
    if vlm.label_mode != "none":
        accuracy |= evaluate_label_questions(vlm, builder, held_labels, n=n)
    records = [record("tiny_vlm", "full", None, "accuracy", accuracy[x], x) for x in ORDER if x in accuracy]
    print(f"{n} held-out questions per setting")
    print_table(records, ["accuracy"])
    path = write(args.out, "tiny_vlm", records, [])
    plot(path.with_suffix(".png"), records, n)


def plot(path, records, n):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    xs = [r["x"] for r in records]
    colours = ["#4c72b0"] * 4 + ["#dd8452"] * 3 + ["#55a868"] * (len(xs) - 7)
    bars = ax.bar(xs, [r["value"] for r in records], color=colours)
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for i, x in enumerate(xs):
        if x in GOALS:
            ax.hlines(GOALS[x], i - 0.4, i + 0.4, colors="k", linestyles="--", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact match")
    ax.set_title(f"tiny-vlm: easy-VQA test, and questions on clip labels ({n} per bar; dashes: goals)")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
