"""tiny-vlm accuracy on held-out easy-VQA questions: one image (all and per answer type) and one named
image among 2, 4 or 8 in context; and on questions answered from the clips' classifier labels
(held-out scene frames with label sets, one clip and a named one among 8). Each clip turn carries its
classifier labels, as at inference. The full cache holds the whole context; this measures the model.
"""

from models.tiny_vlm.data import features
from models.tiny_vlm.episodes import EpisodeBuilder
from models.tiny_vlm.evaluate import evaluate, evaluate_labels
from models.tiny_vlm.model import TinyVLM
from models.tiny_vlm.scenes import easy_labels, scene_frames

from .common import print_table, pyplot, record, write

EASY = ("all", "colour", "shape", "yes/no", "ctx2", "ctx4", "ctx8")
ORDER = EASY + ("labels_what", "labels_is", "labels_which", "labels_ctx8")
GOALS = {"all": 0.93, "colour": 0.90, "shape": 0.90, "yes/no": 0.90, "ctx8": 0.85}


def run(args):
    n = args.tokens or (100 if args.quick else 1000)  # --tokens: questions per setting
    vlm = TinyVLM()
    held_feats, held_labels = scene_frames("test")
    builder = EpisodeBuilder(vlm, features("test") | held_feats, easy_labels("test"))
    accuracy = evaluate(vlm, builder, n=n)
    if vlm.label_mode != "none":
        accuracy |= evaluate_labels(vlm, builder, held_labels, n=n)
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
