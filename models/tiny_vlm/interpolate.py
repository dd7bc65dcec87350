"""Weights halfway between a training and its continuation: `python -m models.tiny_vlm.interpolate START TUNED`.

Continued training (`--set init=...`) taught tiny-vlm the viewer's words but cost it some of what the start
weights did best (easy-VQA with 8 clips in context). Averaging the two weights files tensor by tensor (the
projector, each LoRA A and B), as WiSE-FT does for a fine-tuned model and its start, keeps most of both:
the tuned weights moved ~10% from the start, so the line between them stays in one basin. Writes
tiny_vlm.safetensors, config.json (TUNED's, plus what was averaged) and metrics.json (`--eval`).
"""

import argparse
import hashlib
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from .model import WEIGHTS
from .model import WEIGHTS_FILE as FILE


def interpolate(start: Path, tuned: Path, alpha: float, out: Path) -> dict:
    """(1 − alpha) · START + alpha · TUNED for every tensor; returns the config written. Both files must hold
    the same tensors (one recipe's LoRA rank and targets)."""
    a, b = load_file(start / FILE), load_file(tuned / FILE)
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise ValueError(f"{start} and {tuned} hold different tensors (LoRA rank or targets differ)")
    mixed = {k: ((1 - alpha) * a[k].float() + alpha * b[k].float()).to(b[k].dtype).contiguous() for k in a}
    config = json.loads((tuned / "config.json").read_text())
    config["interpolated"] = {"alpha": alpha, "start": str(start), "tuned": str(tuned),
                              "start_sha256": _sha256(start / FILE), "tuned_sha256": _sha256(tuned / FILE)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(mixed, str(out / FILE))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return config


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.tiny_vlm.interpolate", description=__doc__.splitlines()[0])
    parser.add_argument("start", type=Path, help="weights folder training started from")
    parser.add_argument("tuned", type=Path, help="weights folder of the continued training")
    parser.add_argument("--alpha", type=float, default=0.5, help="share of TUNED (default 0.5)")
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"output folder (default {WEIGHTS})")
    parser.add_argument("--eval", type=int, default=300, help="held-out questions per setting (0: none)")
    args = parser.parse_args(argv)
    for folder in (args.start, args.tuned):
        if not (folder / FILE).is_file() or not (folder / "config.json").is_file():
            parser.error(f"no {FILE} and config.json in {folder}")
    if not 0.0 <= args.alpha <= 1.0:
        parser.error(f"--alpha must be within [0, 1], not {args.alpha}")
    try:
        interpolate(args.start, args.tuned, args.alpha, args.out)
    except ValueError as e:
        parser.error(str(e))
    if args.eval:
        from .train import evaluate_folder

        print(json.dumps(evaluate_folder(args.out, args.eval), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
