"""tiny-vlm accuracy on held-out easy-VQA questions: one image (all and per answer type) and one named
image among 2, 4 or 8 in context. The full cache holds the whole context; this measures the model.
"""

from models.tiny_vlm.data import features
from models.tiny_vlm.episodes import EpisodeBuilder
from models.tiny_vlm.evaluate import evaluate
from models.tiny_vlm.model import TinyVLM

from .common import print_table, record, write

ORDER = ("all", "colour", "shape", "yes/no", "ctx2", "ctx4", "ctx8")
GOALS = {"all": 0.90, "colour": 0.85, "shape": 0.85, "yes/no": 0.85, "ctx8": 0.85}


def run(args):
    n = args.tokens or (100 if args.quick else 1000)  # --tokens: questions per setting
    vlm = TinyVLM()
    accuracy = evaluate(vlm, EpisodeBuilder(vlm, features("test")), n=n)
    records = [record("tiny_vlm", "full", None, "accuracy", accuracy[x], x) for x in ORDER]
    print(f"{n} held-out questions per setting")
    print_table(records, ["accuracy"])
    path = write(args.out, "tiny_vlm", records, [])
    plot(path.with_suffix(".png"), records, n)


def plot(path, records, n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = [r["x"] for r in records]
    bars = ax.bar(xs, [r["value"] for r in records], color=["#4c72b0"] * 4 + ["#dd8452"] * 3)
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for i, x in enumerate(xs):
        if x in GOALS:
            ax.hlines(GOALS[x], i - 0.4, i + 0.4, colors="k", linestyles="--", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact match")
    ax.set_title(f"tiny-vlm on easy-VQA test ({n} questions per bar; dashes: goals)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
