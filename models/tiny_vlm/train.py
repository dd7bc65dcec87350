"""Train tiny-vlm's projector and LoRA adapters on easy-VQA, reproducibly: `python -m models.tiny_vlm.train`.

Backbones stay frozen: EfficientNet-Lite0 features (and its ImageNet head's outputs) are computed
once and cached, SmolLM2 gets rank-r LoRA on its attention projections. Training episodes are short
videos of 1–8 easy-VQA train images with questions on the current or an earlier clip (none to one
after each clip, three after the last, so runs of clips arrive unasked about), in the exact
turn format of a streaming session: each clip turn ends with the classifier's labels as text, and
some episodes hold scene clips (real video frames with ImageNet label sets) asked about their labels
(`scenes.py`). `--device cuda` trains on a GPU; `--set KEY=JSON` overrides any `TrainConfig` field;
`--set init='"DIR"'` continues from trained weights (a new recipe on top of one that works).
Writes `weights/`: tiny_vlm.safetensors (projector + LoRA), config.json (this config and the data
hashes) and metrics.json (held-out accuracy).
"""

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .data import YesNoQuestions, data_hash, features, group_by_image, questions, sample_episode
from .episodes import IGNORE, EpisodeBuilder, pad_batch
from .model import LABEL_MODES, WEIGHTS, WEIGHTS_FILE, TinyVLM, split_weights
from .scenes import SceneMix, easy_labels, sample_scene_episode, scene_frames


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 200  # 27–28 min for the viewer recipe on a 2-core Xeon with rows_per_pass=2 (the budget is 45)
    batch: int = 8
    clips: tuple = (1, 1, 2, 4, 6, 8, 8, 8)  # episode lengths, drawn uniformly: most are long videos
    asks_per_clip: tuple = (0.0, 0.3, 0.6, 1.0)  # drawn per episode: runs of clips with no question between
    final_asks: int = 3  # questions after an episode's last clip, on it or an earlier one (as ctx-k evaluation asks)
    single_image_asks: float = 5.0
    max_first_clip: int = 400  # clip numbers seen in training reach this (long streams)
    type_weights: dict = field(default_factory=lambda: {"yes/no": 0.5, "colour": 0.25, "shape": 0.25})
    lr: float = 2e-3
    lora_lr: float = 2e-3  # 1e-3 left yes/no at 0.90 with labels in the turns; 2e-3 gave 0.997 (README)
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj")
    warmup: int = 20
    snap_to_vocabulary: bool = True  # visual tokens are mixtures of word embeddings (see Projector)
    balanced_yes_no: bool = True  # yes/no questions from data.YesNoQuestions, not easy-VQA's own
    caption_steps: int = 60  # stage 1, projector only: an image's tokens mix the words of its colour and shape
    caption_batch: int = 32
    caption_weight: float = 0.1  # the same caption loss, beside the answers' loss, in stage 2,
    caption_images: int = 16  # on this many of the step's clips (the loss costs a vocabulary-wide softmax)
    bf16: bool | None = None  # autocast (weights stay fp32); None: where the device runs it fast (`fast_bf16`)
    threads: int = 0  # 0: torch's default
    rows_per_pass: int = 2  # episodes per LLM pass, sorted by length (0: the whole batch, padded to its longest)
    labels: str = "text"  # the clip's classifier labels in its turn: "text", "pooled" or "none" (see TinyVLM)
    label_words: str = "frame"  # the perception whose words label text and answers use ("tiles+person": more)
    tenses: bool = False  # "is there X now?" / unnamed "did you see X?" over every clip so far (scenes.py)
    scenes: dict = field(default_factory=lambda: asdict(SceneMix()))  # episodes with label questions
    scene_frames: int = 64  # real video frames whose features scene clips use
    clip_end_anchor: bool = False  # close each clip turn with "End of clip N." (see TinyTurns)
    init: str = ""  # a weights folder whose projector and LoRA training continues from (no caption stage)
    data: dict = field(default_factory=dict)


def fast_bf16(device: str) -> bool:
    """Whether bf16 autocast speeds training up here: on a GPU, and on a CPU with AVX512-BF16 or AMX
    (0.71× fp32's step time on an EPYC that has AVX512-BF16); without them it is emulated (5.5× slower)."""
    if torch.device(device).type != "cpu":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def add_lora(model, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets),
                        lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def lora_modules(peft_model) -> dict:
    """LoRA layers by the plain model's module names (those `merge_lora` and the weights file use)."""
    return {name.removeprefix("base_model.model."): module for name, module in peft_model.named_modules()
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})}


def set_lora(peft_model, lora: dict[str, torch.Tensor]) -> None:
    """Start the LoRA layers from a weights file's LoRA tensors (`split_weights`; the inverse of `lora_tensors`)."""
    for base, module in lora_modules(peft_model).items():
        for part in ("lora_A", "lora_B"):
            weight, saved = getattr(module, part)["default"].weight, lora[f"{base}.{part}"]
            if weight.shape != saved.shape:
                raise ValueError(f"init weights: {base}.{part} is {tuple(saved.shape)}, this config's LoRA "
                                 f"{tuple(weight.shape)} (lora_rank and lora_targets must match)")
            with torch.no_grad():
                weight.copy_(saved)


def lora_tensors(peft_model) -> dict[str, torch.Tensor]:
    """LoRA A/B weights under the plain model's module names, for `merge_lora` at load time."""
    out = {}
    for base, module in lora_modules(peft_model).items():
        out[f"lora.{base}.lora_A"] = module.lora_A["default"].weight.detach().clone().contiguous()
        out[f"lora.{base}.lora_B"] = module.lora_B["default"].weight.detach().clone().contiguous()
    return out


class CaptionLoss:
    """−log of the mean over an image's visual tokens of the probability of its colour word, and of
    its shape word: at best ln 2, half the tokens' mass on each. It puts a picture near the words a
    question uses before the LLM is trained on answers."""

    def __init__(self, vlm, features, labels):
        self.vlm, self.features, self.labels = vlm, features, labels
        word = lambda w: vlm.tokenizer(" " + w, add_special_tokens=False).input_ids[0]  # noqa: E731
        self.words = {image: [word(colour), word(shape)] for image, (colour, shape) in labels.items()}

    def __call__(self, images: list[int]) -> torch.Tensor:
        feats = torch.stack([self.features[i].float() for i in images]).to(self.vlm.device)
        logp = torch.log_softmax(self.vlm.projector.word_logits(feats).float(), dim=-1)
        mean_logp = logp.logsumexp(dim=1) - math.log(logp.shape[1])  # log of the mean over tokens
        targets = torch.tensor([self.words[i] for i in images], device=logp.device)
        return -mean_logp.gather(1, targets).mean()


def caption_stage(vlm, caption: CaptionLoss, cfg: TrainConfig, rng: random.Random) -> float:
    optim = torch.optim.AdamW(vlm.projector.parameters(), lr=cfg.lr, weight_decay=0.0)
    images, loss = sorted(caption.labels), torch.tensor(0.0)
    for _ in tqdm(range(cfg.caption_steps), desc="caption stage", unit="step"):
        loss = caption(rng.sample(images, cfg.caption_batch))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    return float(loss.detach())


def loss_on(vlm, llm, builder, episodes, rows_per_pass: int = 0):
    """Mean cross-entropy over the batch's answer tokens. With `rows_per_pass`, episodes go through
    the LLM in passes of that many, sorted by length, so each pass pads only to its own longest
    (an 8-episode batch of 1–8 clips is ~40% padding in one pass); the loss is the same mean."""
    items = builder.embed_batch([builder.pieces(e.turns, first=e.first) for e in episodes])
    order = sorted(range(len(items)), key=lambda i: items[i][0].shape[0])
    step = rows_per_pass or len(items)
    total, count = 0.0, 0
    for start in range(0, len(order), step):
        embeds, targets, mask = pad_batch([items[i] for i in order[start:start + step]])
        hidden = llm(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        keep = targets != IGNORE
        logits = vlm.model.lm_head(hidden[keep])  # only where an answer token is predicted
        total = total + torch.nn.functional.cross_entropy(logits.float(), targets[keep], reduction="sum")
        count += int(keep.sum())
    return total / count


def train(cfg: TrainConfig, out: Path, eval_n: int = 300, device: str = "cpu") -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.bf16 is None:
        cfg.bf16 = fast_bf16(device)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    vlm = TinyVLM(trained=False, snap_to_vocabulary=cfg.snap_to_vocabulary, labels=cfg.labels, device=device,
                  clip_end_anchor=cfg.clip_end_anchor, perception=cfg.label_words)
    cfg.data = {"easy_vqa_train_sha256": data_hash("train"), "easy_vqa_test_sha256": data_hash("test")}
    start = None
    if cfg.init:
        start_file = Path(cfg.init) / WEIGHTS_FILE
        projector, start = split_weights(load_file(start_file))
        vlm.projector.load_state_dict(projector)
        cfg.data["init_sha256"] = hashlib.sha256(start_file.read_bytes()).hexdigest()
    train_feats = features("train")
    data = SimpleNamespace(by_image=group_by_image(questions("train")), yes_no=YesNoQuestions(questions("train")),
                           scenes=cfg.labels != "none")
    frame_feats = {}
    if data.scenes:
        data.image_labels = easy_labels("train")
        frame_feats, data.frame_labels = scene_frames("train", cfg.scene_frames)
        data.mix = SceneMix(**cfg.scenes)
    builder = EpisodeBuilder(vlm, train_feats | frame_feats if data.scenes else train_feats)
    yes_no = data.yes_no
    vlm.model.requires_grad_(False)
    vlm.projector.train()
    t0 = time.perf_counter()
    caption, caption_loss = None, None
    if cfg.snap_to_vocabulary and cfg.caption_steps:
        caption = CaptionLoss(vlm, train_feats, yes_no.labels)
        caption_loss = None if start is not None else caption_stage(vlm, caption, cfg, rng)
    peft_model, lora_params, optim = _trainable(vlm, cfg, start)
    llm = peft_model.base_model.model.model  # the LlamaModel with LoRA layers inside
    base_lrs = [g["lr"] for g in optim.param_groups]
    losses, step_times = [], []
    with tqdm(range(cfg.steps), desc="training tiny-vlm", unit="step") as bar:
        for step in bar:
            t_step = time.perf_counter()
            scale = min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            for group, lr in zip(optim.param_groups, base_lrs, strict=True):
                group["lr"] = lr * scale
            episodes = [_episode(cfg, rng, vlm, data) for _ in range(cfg.batch)]
            with torch.autocast(vlm.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss = loss_on(vlm, llm, builder, episodes, cfg.rows_per_pass)
                if caption and cfg.caption_weight:
                    images = [t[1] for e in episodes for t in e.turns if t[0] == "clip" and t[1] in caption.labels]
                    images = rng.sample(images, min(cfg.caption_images, len(images)))
                    loss = loss + cfg.caption_weight * caption(images) if images else loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(vlm.projector.parameters()) + lora_params, 1.0)
            optim.step()
            losses.append(float(loss))
            step_times.append(time.perf_counter() - t_step)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    _save(out, cfg, vlm, peft_model, losses, step_times, caption_loss, time.perf_counter() - t0)
    return evaluate_folder(out, eval_n, str(vlm.device), cfg.scene_frames)


def _trainable(vlm, cfg: TrainConfig, start: dict | None) -> tuple:
    """LoRA added to the language model (from `start`'s tensors when given); the optimiser of it and the projector."""
    peft_model = add_lora(vlm.model, cfg)
    if start is not None:
        set_lora(peft_model, start)
    lora_params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    optim = torch.optim.AdamW([{"params": vlm.projector.parameters(), "lr": cfg.lr},
                               {"params": lora_params, "lr": cfg.lora_lr}], weight_decay=0.0)
    return peft_model, lora_params, optim


def _episode(cfg: TrainConfig, rng: random.Random, vlm, data: SimpleNamespace):
    """One training episode of k clips: plain easy-VQA images, or (with labels) scenes mixed in."""
    k = rng.choice(cfg.clips)
    ask = dict(asks_per_clip=cfg.single_image_asks if k == 1 else rng.choice(cfg.asks_per_clip),
               final_asks=cfg.final_asks, max_first=cfg.max_first_clip, type_weights=cfg.type_weights,
               yes_no=data.yes_no if cfg.balanced_yes_no else None)
    if data.scenes:
        return sample_scene_episode(rng, data.by_image, data.image_labels, data.frame_labels, k, data.mix,
                                    more=vlm.perception.more_words, fit=vlm.fit_labels, tenses=cfg.tenses, **ask)
    return sample_episode(rng, data.by_image, k, **ask)


def _save(out: Path, cfg: TrainConfig, vlm, peft_model, losses: list, step_times: list, caption_loss,
          train_s: float) -> None:
    """The trained projector and LoRA tensors (safetensors) and the run's config with its figures."""
    step_s = sorted(step_times)[len(step_times) // 2] if step_times else None
    tensors = {f"projector.{k}": v.detach().clone().contiguous() for k, v in vlm.projector.state_dict().items()}
    tensors.update(lora_tensors(peft_model))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = asdict(cfg) | {"train_seconds": round(train_s, 1), "final_loss": sum(losses[-50:]) / len(losses[-50:]),
                            "caption_stage_loss": caption_loss,
                            "median_step_seconds": step_s, "device": str(vlm.device),
                            "torch_threads": torch.get_num_threads()}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def evaluate_folder(out: Path, eval_n: int, device: str = "cpu", frames: int = 64) -> dict:
    """Held-out accuracy of exactly what inference loads (the folder's weights merged into a fresh model),
    `eval_n` questions per setting, written to the folder's metrics.json (the training script's own draw)."""
    from .evaluate import evaluate, evaluate_label_questions

    trained = TinyVLM(out, device=device)
    test_feats = features("test")
    if trained.label_mode != "none":
        held_feats, held_labels = scene_frames("test", frames)
        builder = EpisodeBuilder(trained, test_feats | held_feats, easy_labels("test"))
        metrics = evaluate(trained, builder, n=eval_n) | evaluate_label_questions(trained, builder, held_labels, eval_n)
    else:
        metrics = evaluate(trained, EpisodeBuilder(trained, test_feats), n=eval_n)
    (out / "metrics.json").write_text(json.dumps({"questions_per_setting": eval_n, **metrics}, indent=1))
    return metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.tiny_vlm.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"output folder (default {WEIGHTS})")
    parser.add_argument("--steps", type=int, help="training steps (default from TrainConfig)")
    parser.add_argument("--eval", type=int, default=300,
                        help="held-out questions per setting (`python -m benchmarks tiny_vlm` runs 1,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labels", choices=LABEL_MODES, help="how a clip's classifier labels enter its turn")
    parser.add_argument("--device", default="cpu", help="torch device to train on (default cpu)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON",
                        help="override TrainConfig fields, e.g. --set lr=0.003 clips='[2,8,8]'")
    args = parser.parse_args(argv)
    cfg = TrainConfig(seed=args.seed)
    if args.steps:
        cfg.steps = args.steps
    if args.labels:
        cfg.labels = args.labels
    for item in args.set:
        key, value = item.split("=", 1)
        if not hasattr(cfg, key):
            parser.error(f"--set: TrainConfig has no field {key!r}")
        setattr(cfg, key, json.loads(value))
    if cfg.init and not (Path(cfg.init) / WEIGHTS_FILE).is_file():
        parser.error(f"--set init: no tiny_vlm.safetensors in {cfg.init}")
    try:
        metrics = train(cfg, args.out, args.eval, device=args.device)
    except KeyboardInterrupt:
        print("interrupted: weights not written", file=sys.stderr)
        return 130
    print(json.dumps(metrics, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
