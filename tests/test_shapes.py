"""The paper-scale shapes the GPU figures use (benchmarks/shapes.py), and the benchmarks that take `--shape`,
run here on a small stand-in shape: a 7B model cannot run on this CPU, so the 7B ones are checked on the
meta device (their sizes, no memory) and the code paths on a shape of the same kind, registered by the test."""


import pytest
import torch

from benchmarks import shapes
from benchmarks.__main__ import main
from streaming.records import read

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=500, max_position_embeddings=8192)


@pytest.fixture
def small_shape(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "small-test", SMALL)
    return "small-test"


def test_vicuna_7b_shape_is_llama_2_7b_in_fp16_and_reads_its_weights_but_the_embedding_table_per_token():
    model = shapes.build("vicuna-7b", "meta")
    assert model.dtype == torch.float16 and model.config.num_hidden_layers == 32
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(6.74e9, rel=1e-3)
    table = 32000 * 4096 * 2
    assert shapes.weight_bytes_per_token(model) == 2 * sum(p.numel() for p in model.parameters()) - table
    assert shapes.kv_bytes_per_token(model) == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers of 32 heads of 128, fp16


def test_llama_2_7b_32k_interpolates_positions_eight_times():
    long = shapes.build("llama-2-7b-32k", "meta")
    assert long.config.max_position_embeddings == 32768 and long.config.rope_parameters["factor"] == 8.0
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.build("vicuna-13b")


def test_llava_onevision_7b_folder_has_the_real_token_layout(tmp_path):
    from models.hf.adapter import HFVideo

    path, model = shapes.llava_onevision_7b(tmp_path, "meta")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(8.05e9, rel=1e-2)
    adapter = HFVideo(path, "meta", model=model)
    assert adapter.family.visual_tokens(4) == 4 * 14 * 14 + 1  # 27x27 SigLIP patches pooled 2x2, then a newline


def test_latency_with_a_shape_records_the_bandwidth_floor_and_a_clip_turn(small_shape, tmp_path):
    assert main(["latency", "--quick", "--tokens", "1024", "--shape", small_shape, "--policies", "streaming_llm",
                 "inf_mllm", "--out", str(tmp_path)]) == 0
    rows = read(tmp_path / f"latency_{small_shape}.json")
    got = {(r["policy"], r["metric"]): r["value"] for r in rows}
    for policy in ("streaming_llm", "inf_mllm"):
        floor, decode = got[policy, "floor_ms_per_token"], got[policy, "decode_ms_per_token"]
        assert 0 < floor < decode and got[policy, "decode_vs_floor"] == pytest.approx(decode / floor)
        assert got[policy, "clip_ttft_s"] > 0 and got[policy, "kv_tokens"] <= 1024


@pytest.mark.slow  # ~25 s on 2 cores: run by `make test-slow` in CI
def test_compiled_decode_times_transformers_own_caches(small_shape, tmp_path, monkeypatch):
    from benchmarks import compiled_decode

    monkeypatch.setattr(compiled_decode, "CONTEXT", 64)
    assert main(["compiled_decode", "--shape", small_shape, "--quick", "--policies", "inf_mllm",
                 "--out", str(tmp_path)]) == 0
    rows = read(tmp_path / f"compiled_decode_{small_shape}.json")
    decode = {r["policy"] for r in rows if r["metric"] == "decode_ms_per_token" and r["value"] > 0}
    assert decode == set(compiled_decode.VARIANTS) | {"inf_mllm, eager", "inf_mllm, compiled"}
    by_length = {}
    for r in rows:
        by_length.setdefault(r["x"], {})[r["policy"], r["metric"]] = r["value"]
    assert set(by_length) == {1024, 2048, 64}  # ours at each streamed length (--quick), the reference at CONTEXT
    for length in (1024, 2048):
        got = by_length[length]
        assert got["inf_mllm: same answers", "rate"] == 1.0  # our compiled step answers the eager tokens here too
        assert got["inf_mllm: steps run compiled", "rate"] == 1.0  # and none fell back to the eager step
        floor = got["inf_mllm: floor", "floor_ms_per_token"]
        assert got["inf_mllm, compiled", "decode_vs_floor"] == pytest.approx(
            got["inf_mllm, compiled", "decode_ms_per_token"] / floor)


def test_bandwidth_of_this_machine_is_a_plausible_memory_speed():
    assert 1e8 < shapes.bandwidth("cpu", size=2**24, repeats=3) < 1e13
