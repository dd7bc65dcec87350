"""tiny-vlm: EfficientNet-Lite0 frame features → MLP projector → SmolLM2-135M-Instruct.

The trained parts (projector, LoRA deltas for the LLM's attention projections) are committed in
`weights/` and merged into the LLM's weights at load time, so at inference the LLM is a plain
`LlamaForCausalLM` that the core's cache drives like any other.
"""

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from inf_mllm import AssetError, linear, load_model

from ..base import AdapterInfo, EncodedClip, VideoAdapter
from .data import named_text
from .encoder import FEATURE_DIM, GRID, PARTS
from .labels import MAX_LABELS, display, label_text
from .perception import DEFAULT, Perceiver, Perception
from .scenes import article

WEIGHTS = Path(__file__).parent / "weights"
WEIGHTS_FILE = "tiny_vlm.safetensors"  # projector + LoRA tensors in a weights folder
LABEL_MODES = ("text", "pooled", "none")
LABEL_TOKENS = 16  # the most tokens a clip's label text takes (the longest single label takes 15)
SYSTEM = "<|im_start|>system\nYou watch a video clip by clip and answer questions about it in one word.<|im_end|>"


class Projector(nn.Module):
    """LLaVA-style two-layer MLP from frame features to the LLM's embedding space.

    Each part of the features (CNN channels, patch histogram, foreground histogram) has its own
    LayerNorm: under one, the 1280 CNN channels drown the 64-bin histograms and colour is barely learnt.
    Given the LLM's input embeddings, each visual token is snapped to the vocabulary: a softmax over
    the words mixes their embeddings. The LLM then reads a red circle as it reads " red circle", so
    comparing the picture with the words of a question ("is there a blue shape?") is the text
    comparison LoRA learns in a few dozen steps, which it does not learn from free vectors in 220.
    """

    def __init__(self, hidden: int, width: int = 576, vocabulary: torch.Tensor | None = None):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(n) for n in PARTS)
        self.fc1 = nn.Linear(FEATURE_DIM, width)
        self.fc2 = nn.Linear(width, hidden)
        self.vocabulary = vocabulary  # (V, hidden) frozen input embeddings; not saved with the projector
        if vocabulary is not None:
            self.log_temperature = nn.Parameter(torch.zeros(()))

    def word_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(…, V) logits of each visual token's mixture over the vocabulary."""
        h = self.mlp(x)
        return h @ self.vocabulary.to(h.dtype).T * self.log_temperature.exp()

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.split(PARTS, dim=-1)
        x = torch.cat([norm(part) for norm, part in zip(self.norms, parts, strict=True)], dim=-1)
        return self.fc2(nn.functional.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vocabulary is None:
            return self.mlp(x)
        logits = self.word_logits(x)
        return torch.softmax(logits, dim=-1) @ self.vocabulary.to(logits.dtype)


def _unreadable(weights: Path, err: Exception) -> AssetError:
    fix = "run `python -m models.tiny_vlm.train` to retrain it, or restore models/tiny_vlm/weights from git"
    return AssetError(f"tiny-vlm weights at {weights} are missing or unreadable ({type(err).__name__}): {fix}")


def split_weights(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A weights file's tensors as (projector state dict, LoRA tensors by module name)."""
    projector = {k.removeprefix("projector."): v.float() for k, v in tensors.items() if k.startswith("projector.")}
    return projector, {k.removeprefix("lora."): v for k, v in tensors.items() if k.startswith("lora.")}


def merge_lora(model: nn.Module, tensors: dict[str, torch.Tensor], scale: float) -> int:
    """W += scale · B A for every `<module>.lora_A` / `<module>.lora_B` pair; returns how many merged."""
    modules = dict(model.named_modules())
    merged = 0
    for key, a in tensors.items():
        if not key.endswith(".lora_A"):
            continue
        name = key[: -len(".lora_A")]
        b = tensors[f"{name}.lora_B"]
        weight = modules[name].weight
        weight.data += scale * (b.float() @ a.float()).to(weight.device, weight.dtype)
        merged += 1
    return merged


class TinyTurns:
    """tiny-vlm's turn texts (SmolLM2's chat format), shared by every adapter built on tiny-vlm."""

    def system_text(self) -> str:
        return SYSTEM

    end_anchor = False  # weights trained with "End of clip N." closing each clip turn (config `clip_end_anchor`)

    def clip_text(self, index: int, start_s: float = 0.0) -> tuple[str, str]:
        end = f" End of clip {index}." if self.end_anchor else ""
        return f"\n<|im_start|>user\nClip {index}:", f"{end}<|im_end|>"

    def question_text(self, question: str) -> str:
        return f"\n<|im_start|>user\n{question.strip()}<|im_end|>\n<|im_start|>assistant\n"


class TinyVLM(TinyTurns, VideoAdapter):
    name = "tiny-vlm"
    past_answers_stay = False  # one-word answers: "yes" about a past clip sways the next question about the present
    packs_side_questions = True  # one-token yes/no, 1-D RoPE: tests/test_side_questions.py checks it

    @property
    def copies_words(self) -> bool:
        """Its clip turns carry their labels as text, which its "what" answers copy (`VideoAdapter.answer_words`)."""
        return self.label_mode == "text"

    def __init__(self, weights: str | Path = WEIGHTS, device: str = "cpu", trained: bool = True,
                 snap_to_vocabulary: bool = True, labels: str = "text", clip_end_anchor: bool = False,
                 perception: str | dict | None = None, runtime: str = "auto"):
        """`runtime`: where the frozen Lite0 runs (`runtime.py`: "auto", "onnx" or "torch")."""
        self.model, self.tokenizer = load_model("smollm2", device=device)
        self.runtime = runtime
        self.config: dict = {"snap_to_vocabulary": snap_to_vocabulary, "labels": labels,
                             "clip_end_anchor": clip_end_anchor}
        if trained:
            self.config = self._read_config(Path(weights))
        # what the classifier recognised goes into each clip turn: "text" (the words, as text tokens),
        # "pooled" (one token per class: the mean of its name's word embeddings) or "none" (weights
        # trained before labels existed)
        self.label_mode = self.config.get("labels", "none")
        self.end_anchor = bool(self.config.get("clip_end_anchor", False))
        if self.label_mode not in LABEL_MODES:
            raise AssetError(f"tiny-vlm config.json: unknown labels mode {self.label_mode!r}")
        # what the clip turn's labels come from (`perception.py`): the argument, else config.json's
        # `perception`, else `perception.DEFAULT`
        self.perception = Perception.parse(perception or self.config.get("perception", DEFAULT))
        self._perceiver = None
        self.projector = self._projector(self.config.get("snap_to_vocabulary", False)).to(device).eval()
        if trained:
            self._load(Path(weights))
            linear.as_chosen(self.model)  # the opt-in oneDNN products (inf_mllm/linear.py), once the LoRA is merged
        self._encoder = None
        self._loading = threading.Lock()  # the encoder and perceiver are made once, on the first clip of any stream

    @property
    def encoder(self):
        """The frozen frame encoder, loaded on first use (training works from cached features); once, however many
        streams' ingest threads ask for it at the same moment."""
        with self._loading:
            if self._encoder is None:
                from .encoder import FrameEncoder

                self._encoder = FrameEncoder(str(self.device), self.runtime)
            return self._encoder

    @property
    def perceiver(self) -> Perceiver:
        """Labels from a clip's frames, sharing the encoder's Lite0 (loaded on first use, once)."""
        encoder = self.encoder
        with self._loading:
            if self._perceiver is None:
                self._perceiver = Perceiver(self.perception, encoder.backbone)
            return self._perceiver

    def _projector(self, snap: bool) -> Projector:
        vocabulary = self.model.get_input_embeddings().weight.detach() if snap else None
        return Projector(self.model.config.hidden_size, vocabulary=vocabulary)

    @staticmethod
    def _read_config(weights: Path) -> dict:
        try:
            return json.loads((weights / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise _unreadable(weights, err) from err

    def _load(self, weights: Path) -> None:
        try:
            projector, lora = split_weights(load_file(weights / WEIGHTS_FILE))
            self.projector.load_state_dict(projector)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
            raise _unreadable(weights, err) from err
        with torch.no_grad():
            merge_lora(self.model, lora, self.config.get("lora_alpha", 1) / max(self.config.get("lora_rank", 1), 1))

    # --- labels -------------------------------------------------------------------------------

    def fit_labels(self, labels: Sequence[int]) -> tuple[int, ...]:
        """The labels whose text fits in `LABEL_TOKENS` (least confident dropped first; one always fits), so
        a clip turn stays within 16 + LABEL_TOKENS embeddings and small budgets still hold a turn."""
        labels = tuple(labels)
        while self.label_mode == "text" and len(labels) > 1 and self._tokens(self.label_text(labels)) > LABEL_TOKENS:
            labels = labels[:-1]
        return labels

    def label_text(self, labels: Sequence[int]) -> str:
        """" Seen: …." in this model's words (`perception.more_words`)."""
        return label_text(labels, self.perception.more_words)

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def label_embeddings(self, labels: Sequence[int]) -> torch.Tensor:
        """(n, hidden) input embeddings of a clip's labels (after `fit_labels`), in this model's label mode."""
        labels = self.fit_labels(labels)
        embed = self.model.get_input_embeddings()
        if self.label_mode == "text":
            return embed(self.text_ids(self.label_text(labels)))[0]
        words = [display(i, self.perception.more_words) for i in labels] or ["nothing recognised"]
        return torch.stack([embed(self.text_ids(" " + w))[0].mean(dim=0) for w in words])

    def max_label_tokens(self) -> int:
        """The most label embeddings a clip turn carries (0 for weights trained without labels)."""
        return {"none": 0, "pooled": MAX_LABELS, "text": LABEL_TOKENS}[self.label_mode]

    # --- VideoAdapter -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_parts(self, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The clip's 16 visual tokens (frames averaged over time) and its frames' (T, 1000) ImageNet class
        probabilities, from one pass of the backbone."""
        feats, probs = self.encoder.encode(frames)
        return self.project(feats.mean(dim=0)), probs

    def clip_embeddings(self, visual: torch.Tensor, labels: Sequence[int]) -> torch.Tensor:
        """The visual tokens followed by the embeddings of the clip's labels (none with old weights)."""
        if self.label_mode == "none":
            return visual
        return torch.cat([visual, self.label_embeddings(labels).to(visual.device, visual.dtype)])

    def perceive(self, frames: np.ndarray, probs: torch.Tensor) -> tuple[int, ...]:
        """The clip's labels from its frames and their whole-frame class probabilities (`perception.py`)."""
        return self.perceiver(frames, probs)

    @torch.no_grad()
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> torch.Tensor:
        """GRID² = 16 visual tokens per clip, followed by the embeddings of its labels (see `labels.py`,
        `perception.py`): the labels travel with the visual tokens, so every turn-building path puts them
        in the clip turn."""
        return self.encode(frames, timestamps).visual

    @torch.no_grad()
    def encode(self, frames: np.ndarray, timestamps: Sequence[float] = ()) -> EncodedClip:
        """`encode_clip`'s embeddings with the words of its labels as data (`encoded`)."""
        visual, probs = self.encode_parts(frames)
        labels, objects = self.perceiver.see(frames, probs, detect=self.detect)
        encoded = self.encoded(visual, labels, objects.meta(timestamps) if objects is not None else {})
        encoded.frame_boxes = objects.frame_boxes(timestamps) if objects is not None else ()
        return encoded

    def encoded(self, visual: torch.Tensor, labels: Sequence[int], meta: dict | None = None) -> EncodedClip:
        """A clip's turn embeddings (`clip_embeddings`) and, in "text" label mode, `seen`: the words of every label
        perceived (the turn carries those that fit in `LABEL_TOKENS`: a long classifier label after three detected
        things may not), for the clip log and the span store; `meta`: what else the clip log keeps (the detector's
        `objects` and `boxes`)."""
        meta = dict(meta or {})
        if self.label_mode == "text":  # every label perceived: the turn holds those that fit (`fit_labels`)
            meta["seen"] = self.label_text(labels).strip().removeprefix("Seen:").strip().rstrip(".")
        return EncodedClip(self.clip_embeddings(visual, labels), meta)

    def phrase(self, intent, clip: int | None) -> str:
        """In the forms tiny-vlm was trained on (`scenes.py`): "is there a cat?", "what is in the video?", and
        "In clip N, …" about a clip that is not the latest; a question that names its clip stays as asked."""
        if intent.when == "named":
            return intent.text
        if intent.kind == "is" and intent.things:
            core = f"is there {article(intent.things[0])} {intent.things[0]}?"
        elif intent.kind == "what":
            core = "what is in the video?"
        else:
            core = intent.core
        return core if clip is None else named_text(core, clip)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector(features.to(self.device, torch.float32))

    def describe(self) -> AdapterInfo:
        cfg = self.model.config
        return AdapterInfo(self.name, GRID * GRID + self.max_label_tokens(), str(self.model.dtype),
                           str(self.device), cfg.max_position_embeddings, cfg.hidden_size)
