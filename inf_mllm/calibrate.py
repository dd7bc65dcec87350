"""PrefixKV's offline estimation: per-layer cumulative priority curves from a few calibration samples.

The paper finds the curves similar across samples, so it estimates them once and reuses them at run
time instead of searching on every prompt. `calibrate` runs the model over each sample (token ids,
or input embeddings such as clip turns) with every query's attention accumulated, takes each layer's
normalised importance curve (`policies.priority_curve`) at evenly spaced prefix ratios, and averages
the samples; `save` writes them as JSON, which `prefixkv_budgets` reads with `calibration=PATH`.

`python -m inf_mllm calibrate OUT [--text FILE] [--samples N] [--tokens T] [--model PATH]` does it
for a text model; without --text the samples are the text-stream demo's facts.
"""

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from .cache import StreamingCache
from .demo import WORDS
from .loader import SMOLLM2, load_model
from .policies import build
from .policies.priority import priority_curve, resample_curve
from .spec import PolicySpec

POINTS = 101  # prefix ratios 0, 0.01, ..., 1


@torch.inference_mode()
def calibrate(model, samples: list[torch.Tensor], points: int = POINTS) -> list[list[float]]:
    """Mean curve per layer over the samples: (1, T) token ids or (1, T, hidden) input embeddings."""
    if not samples:
        raise ValueError("calibration needs at least one sample")
    policy = build(PolicySpec("prefixkv"))
    total = None
    for sample in samples:
        cache = StreamingCache.for_model(model, policy, budget=None)  # no eviction: only accumulate
        key = "inputs_embeds" if sample.dim() == 3 else "input_ids"
        with cache.forward(sample.shape[1], device=model.device) as fwd:  # observed: its attention accumulates
            model(**{key: sample.to(model.device)}, past_key_values=cache, use_cache=True, **fwd.kwargs)
        curves = torch.stack([resample_curve(priority_curve(policy.importance(layer.view())), points)
                              for layer in cache.layers])
        total = curves if total is None else total + curves
    return (total / len(samples)).tolist()


def save(path: str | Path, curves: list[list[float]], about: dict) -> None:
    """Atomic JSON write: {"about": ..., "curves": [[P_l(o) for o in 0..1] per layer]}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"about": about, "curves": [[round(x, 6) for x in c] for c in curves]}, f)
    os.replace(tmp, path)


def demo_samples(tok, count: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """Streams of "word: number" facts, as `python -m inf_mllm demo` streams them."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = "\n".join(f"{rng.choice(WORDS)}: {rng.randint(100, 999)}" for _ in range(tokens))
        out.append(tok(text, return_tensors="pt").input_ids[:, :tokens])
    return out


def text_samples(tok, path: str, count: int, tokens: int) -> list[torch.Tensor]:
    ids = tok(Path(path).read_text(errors="replace"), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"{path} holds {ids.shape[1]} tokens, fewer than one sample of {tokens}")
    step = max(tokens, (ids.shape[1] - tokens) // max(1, count - 1))
    return [ids[:, s:s + tokens] for s in range(0, ids.shape[1] - tokens + 1, step)][:count]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m inf_mllm calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the calibration file to write (JSON)")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: SmolLM2-135M)")
    p.add_argument("--text", help="calibration text file (default: the demo's fact stream)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="tokens per sample")
    args = p.parse_args(argv)
    if args.samples < 1 or args.tokens < 8:
        p.error("--samples must be at least 1 and --tokens at least 8")
    model, tok = load_model(args.model or SMOLLM2)
    samples = (text_samples(tok, args.text, args.samples, args.tokens) if args.text
               else demo_samples(tok, args.samples, args.tokens))
    curves = calibrate(model, samples)
    save(args.out, curves, {"model": args.model or "SmolLM2-135M-Instruct", "samples": len(samples),
                            "tokens": args.tokens, "text": args.text or "demo facts"})
    print(f"{args.out}: {len(curves)} layers, {len(samples)} samples of {args.tokens} tokens")
    return 0
