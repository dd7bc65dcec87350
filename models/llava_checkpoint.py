"""Loading a LLaVA-style checkpoint folder offline: a LLaMA plus extra modules under `model.<prefix>.` plus a CLIP
tower loaded from its own folder.

Chat-UniVi and Flash-VStream both save such checkpoints (their models descend from LLaVA's):
`config.json` (Llama fields plus `mm_hidden_size`, `mm_vision_tower`, `mm_vision_select_*`), the
tokenizer, and weights as `model.safetensors` / `pytorch_model.bin` or shards listed by
`model.safetensors.index.json` / `pytorch_model.bin.index.json`. Both reload CLIP from
`mm_vision_tower` instead of the copy under `model.vision_tower.`; here that name must resolve to a
local folder. A port says what its checkpoints add in a `LlavaSpec`; the rest is shared so that every
asset problem raises one `AssetError` naming the file and the fix, before any weights are used.
"""

import inspect
import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from inf_mllm import AssetError, use_observing_attention

from .clip_vision import ClipTower, Preprocess

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
LLAMA_REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "mm_hidden_size")
LLAMA_LEGACY = ("rope_theta", "rope_scaling")  # not in LlamaConfig's signature, but still converted by it
CLIP_L14 = "openai/clip-vit-large-patch14"  # the tower both ports were trained with
READ_ERRORS = (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError)


@dataclass(frozen=True)
class LlavaSpec:
    """What one port's checkpoints add to the shared layout."""

    name: str  # for messages, e.g. "Chat-UniVi"
    repo: str  # the hub repository a broken checkpoint is downloaded again from
    extras: Callable[[dict], dict[str, nn.Module]]  # config → {"model.<prefix>.": module}, besides the LLM
    required: tuple[str, ...] = LLAMA_REQUIRED  # config.json keys without which it is not this port's config
    check: Callable[[dict], str | None] | None = None  # config → what this port does not support, if anything
    ignored_prefixes: tuple[str, ...] = ("model.vision_tower.",)  # CLIP is reloaded from its own folder
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # recomputed; older transformers saved it

    @property
    def redownload(self) -> str:
        return f"download the checkpoint again (e.g. `huggingface-cli download {self.repo} --local-dir DIR`)"

    def ignored(self, name: str) -> bool:
        return name.startswith(self.ignored_prefixes) or name.endswith(self.ignored_suffixes)


@dataclass
class LlavaParts:
    config: dict
    model: nn.Module  # LlamaForCausalLM
    tokenizer: object
    extras: dict[str, nn.Module]  # by prefix, as `LlavaSpec.extras` built them
    tower: ClipTower


def read_config(path: Path, spec: LlavaSpec) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise AssetError(f"{path} is not a {spec.name} checkpoint (no config.json): pass the folder of a downloaded "
                         f"checkpoint, or {spec.redownload}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise AssetError(f"{file} is unreadable ({type(err).__name__}): {spec.redownload}") from err
    missing = [key for key in spec.required if key not in config]
    if missing:
        raise AssetError(f"{file} lacks {', '.join(missing)}, so it is not a {spec.name} config: {spec.redownload}")
    problem = spec.check and spec.check(config)
    if problem:
        raise AssetError(f"{file}: {problem}")
    return config


def llama_config(config: dict, spec: LlavaSpec):
    """The LLM's config from the Llama fields alone, so the `mm_*` extras do not end up on `model.config`."""
    from transformers import LlamaConfig

    fields = (set(inspect.signature(LlamaConfig).parameters) | set(LLAMA_LEGACY)) - {"architectures", "dtype"}
    try:
        return LlamaConfig(**{k: v for k, v in config.items() if k in fields})
    except (TypeError, ValueError) as err:
        raise AssetError(f"config.json does not describe a Llama model ({err}): {spec.redownload}") from err


def weight_map(path: Path, spec: LlavaSpec) -> dict[str, Path]:
    """Tensor name → the file holding it, from the first index json present, else from the single weights file."""
    for name in INDEXES:
        index = path / name
        if index.exists():
            try:
                mapping = json.loads(index.read_text())["weight_map"]
                files = {shard: path / shard for shard in set(mapping.values())}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise AssetError(f"{index} is unreadable or has no weight_map ({type(err).__name__}): "
                                 f"{spec.redownload}") from err
            absent = sorted(shard for shard, file in files.items() if not file.exists())
            if absent:
                raise AssetError(f"missing weight shard(s): {path} lacks {', '.join(absent)} listed in {name}; "
                                 f"download them into {path}, or {spec.redownload}")
            return {tensor: files[shard] for tensor, shard in mapping.items()}
    for name in SINGLE_FILES:
        if (path / name).exists():
            return dict.fromkeys(tensor_names(path / name, spec), path / name)
    raise AssetError(f"{path} holds no weights (no {' / '.join(INDEXES + SINGLE_FILES)}): {spec.redownload}")


def tensor_names(file: Path, spec: LlavaSpec) -> list[str]:
    """A single file's names; a safetensors header is read without its tensors."""
    if file.suffix != ".safetensors":
        return list(read_shard(file, spec))
    try:
        with safe_open(file, "pt") as f:
            return list(f.keys())
    except READ_ERRORS as err:
        raise corrupt(file, err, spec) from err


def read_shard(file: Path, spec: LlavaSpec) -> dict[str, torch.Tensor]:
    """A shard's tensors; a zip-format torch.save file is memory-mapped (a legacy pickle cannot be)."""
    try:
        if file.suffix == ".safetensors":
            return load_file(file)
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            return torch.load(file, map_location="cpu", weights_only=True)
    except READ_ERRORS as err:
        raise corrupt(file, err, spec) from err


def corrupt(file: Path, err: Exception, spec: LlavaSpec) -> AssetError:
    return AssetError(f"weight shard {file} is corrupt or truncated ({type(err).__name__}: {str(err)[:120]}): "
                      f"delete it and {spec.redownload}")


def tally(groups: dict[str, list[str]], form: str = "{n} {label}: {items}") -> str:
    """'2 missing: a, b; 1 unexpected: c', naming the first few of each non-empty group."""
    parts = []
    for label, items in groups.items():
        if items:
            more = f" and {len(items) - 3} more" if len(items) > 3 else ""
            parts.append(form.format(n=len(items), label=label, items=", ".join(items[:3]) + more))
    return "; ".join(parts)


def check_names(names, expected: dict[str, torch.Size], path: Path, spec: LlavaSpec, tied: bool) -> None:
    """The checkpoint's tensor names against the model built from its config (before any shard is read)."""
    present = {name for name in names if not spec.ignored(name)}
    missing = sorted(set(expected) - present - ({"lm_head.weight"} if tied else set()))
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        listed = tally({"missing": missing, "unexpected": unexpected}, "{n} {label} (e.g. {items})")
        raise AssetError(f"the weights in {path} do not match a {spec.name} model built from its config.json: "
                         f"{listed} tensor names; the config and weights come from different checkpoints or a "
                         f"download is incomplete: {spec.redownload}")


def check_shard(file: Path, tensors: dict, listed: set[str], expected: dict[str, torch.Size], spec: LlavaSpec):
    """A shard holds what its index lists, in the shapes config.json implies."""
    if set(tensors) != listed:
        found = tally({"missing": sorted(listed - set(tensors)), "unexpected": sorted(set(tensors) - listed)})
        raise AssetError(f"{file} does not hold the tensors its index lists ({found}): delete it and "
                         f"{spec.redownload}")
    wrong = [f"{name} {tuple(t.shape)} (config.json implies {tuple(expected[name])})"
             for name, t in tensors.items() if t.shape != expected[name]]
    if wrong:
        raise AssetError(f"{file.name} disagrees with config.json ({tally({'mis-shaped': wrong})}): the config and "
                         f"weights come from different checkpoints; {spec.redownload}")


def load_weights(path: Path, mapping: dict[str, Path], spec: LlavaSpec, modules: dict[str, nn.Module],
                 dtype: torch.dtype, tied: bool) -> None:
    """Each shard, checked, assigned in `dtype` to the module whose prefix it has ("" for the LLM, listed last)."""
    expected = {prefix + k: v.shape for prefix, module in modules.items() for k, v in module.state_dict().items()}
    check_names(mapping, expected, path, spec, tied)
    for file in dict.fromkeys(mapping.values()):
        tensors = {k: v for k, v in read_shard(file, spec).items() if not spec.ignored(k)}
        check_shard(file, tensors, {k for k, f in mapping.items() if f == file and not spec.ignored(k)}, expected,
                    spec)
        for prefix, module in modules.items():
            part = {k[len(prefix):]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
            part = {k: v.to(dtype) if v.is_floating_point() else v for k, v in part.items()}
            module.load_state_dict(part, strict=False, assign=True)


def tower_name(config: dict) -> str:
    return str(config.get("mm_vision_tower") or config.get("vision_tower") or CLIP_L14)


def hub_id(name: str) -> str:
    """The tower's hub repository: the name itself unless it is a local path."""
    return name if re.fullmatch(r"\w[\w.-]*/[\w.-]+", name) else CLIP_L14


def find_tower(path: Path, config: dict, override: str | Path | None = None) -> Path:
    """The local CLIP folder: `override`, else `mm_vision_tower` as a folder (absolute or relative to the
    checkpoint), else a folder named after its last part, or `vision_tower`, inside or next to the checkpoint."""
    name = tower_name(config)
    named = Path(name).expanduser()
    candidates = [Path(override).expanduser()] if override else [
        named, path / named, path / named.name, path / "vision_tower", path.parent / named.name]
    for folder in dict.fromkeys(candidates):
        if (folder / "config.json").exists():
            return folder
    tried = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise AssetError(f"CLIP vision tower {name!r} not found locally: it is not on disk at {tried}; download it, e.g. "
                     f"`huggingface-cli download {hub_id(name)} --local-dir {path.parent / named.name}`, or set "
                     "mm_vision_tower in config.json to its folder")


def load_tower(folder: Path, config: dict, dtype: torch.dtype, device: str) -> ClipTower:
    """CLIP's vision half; a whole CLIP folder's text weights are dropped without a report."""
    from transformers import CLIPVisionModel
    from transformers.utils import logging

    fix = f"download {hub_id(tower_name(config))} into {folder} again"
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        model, info = CLIPVisionModel.from_pretrained(folder, dtype=dtype, output_loading_info=True)
        preprocess = Preprocess.from_folder(folder, model.config.image_size)
    except (*READ_ERRORS, KeyError) as err:
        raise AssetError(f"cannot load the CLIP tower at {folder} ({type(err).__name__}: {str(err)[:120]}): "
                         f"{fix}") from err
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    bad = [*info.get("missing_keys", []), *[str(m[0]) for m in info.get("mismatched_keys", [])]]
    if bad:
        raise AssetError(f"the CLIP tower at {folder} lacks or mis-shapes {len(bad)} weights ({', '.join(bad[:3])}): "
                         f"{fix}")
    if model.config.hidden_size != config["mm_hidden_size"]:
        raise AssetError(f"the CLIP tower at {folder} is {model.config.hidden_size} wide but config.json's "
                         f"mm_hidden_size is {config['mm_hidden_size']}: point mm_vision_tower at the tower the "
                         f"checkpoint was trained with ({tower_name(config)})")
    return ClipTower(model.to(device), preprocess, config.get("mm_vision_select_layer", -2),
                     config.get("mm_vision_select_feature", "patch"))


def load_tokenizer(path: Path, cfg, spec: LlavaSpec):
    """Given the Llama config, transformers need not parse the port's own `model_type`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, config=cfg)
    except (*READ_ERRORS, TypeError, KeyError, ImportError) as err:
        raise AssetError(f"cannot load the tokenizer in {path} ({type(err).__name__}: {str(err)[:120]}): restore "
                         f"tokenizer.model / tokenizer_config.json, or {spec.redownload} (a tokenizer.model-only "
                         "tokenizer needs sentencepiece and protobuf: `make setup` installs both)") from err


def load_llava(path: str | Path, spec: LlavaSpec, device: str = "cpu", dtype: torch.dtype | None = None,
               vision_tower: str | Path | None = None) -> LlavaParts:
    """Every part, checked, on `device` in `dtype` (default: float16 on CUDA as in their builders, else float32)."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig, LlamaForCausalLM

    path = Path(path).expanduser()
    dtype = dtype or (torch.float16 if str(device).startswith("cuda") else torch.float32)
    config = read_config(path, spec)
    mapping = weight_map(path, spec)  # fail on absent shards and a missing tower before reading gigabytes
    tower_dir = find_tower(path, config, vision_tower)
    cfg = llama_config(config, spec)
    tokenizer = load_tokenizer(path, cfg, spec)
    with init_empty_weights(include_buffers=False):  # parameters stay on "meta" until the shards assign them
        llm = LlamaForCausalLM(cfg)
        try:
            extras = spec.extras(config)
        except (KeyError, TypeError, ValueError) as err:
            raise AssetError(f"{path / 'config.json'} does not describe {spec.name}'s extra modules "
                             f"({type(err).__name__}: {err}): {spec.redownload}") from err
    tied = bool(cfg.tie_word_embeddings)
    load_weights(path, mapping, spec, {**extras, "": llm}, dtype, tied)
    if tied:
        llm.tie_weights()
    if (path / "generation_config.json").exists():
        llm.generation_config = GenerationConfig.from_pretrained(path)
    tower = load_tower(tower_dir, config, dtype, device)
    use_observing_attention(llm)
    extras = {prefix: module.to(device).eval() for prefix, module in extras.items()}
    return LlavaParts(config, llm.to(device).eval(), tokenizer, extras, tower)
