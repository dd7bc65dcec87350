"""`python -m benchmarks.score_stats`: why the paper's bias turns Inf-MLLM into recency on a small model.

Streams 1.5K tokens of the corpus with no eviction, then, at the next 64-token turn, prints per
layer the window scores' scale (mean, median, max, attention-sink mass) and, for several biases b,
how much of Algorithm 1's kept set is the plain recency set and how many of the 4 first tokens
survive. Averaged window attention is about 1/n, so any b much above 1/n decides by age alone.
"""

from inf_mllm import StreamSession, load_model
from inf_mllm.policies import recency_bias

from .corpus import token_stream

BIASES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1)


def main(n: int = 1600, budget: int = 1024, window: int = 64, layers=(0, 5, 15, 29)):
    model, tok = load_model()
    ids = token_stream(tok, n)
    session = StreamSession(model, tok, "inf_mllm", budget=budget, window=window, bias=0.0)
    for start in range(0, n, window):
        session.append(ids[start:start + window][None], evict=False)
    header = "| layer | mean S | median S | max S | sink mass (4 first) | " + " | ".join(
        f"b={b:g}: recency overlap / sinks kept" for b in BIASES) + " |"
    print(header + "\n|" + "---|" * (5 + len(BIASES)))
    for index in layers:
        layer = session.cache.layers[index]
        c = layer.get_seq_length() - window
        s = layer.stats["window"][0, :, :c].mean(0)
        r = budget - window
        recency = set(range(c - r, c))
        cells = []
        for b in BIASES:
            kept = set((s + recency_bias(c, b, s.device)).topk(r).indices.tolist())
            cells.append(f"{len(kept & recency) / r:.2f} / {sum(i in kept for i in range(4))}")
        print(f"| {index} | {s.mean():.1e} | {s.median():.1e} | {s.max():.3f} | {s[:4].sum():.3f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
