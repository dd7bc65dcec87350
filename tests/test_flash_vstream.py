"""Flash-VStream: STAR memory against hand-computed cases, the checkpoint loader on synthetic checkpoints
with the real parameter names and shard layouts, and both adapters generating through a bounded session."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

from inf_mllm import AssetError
from inf_mllm.loader import resolve
from models.flash_vstream.modules import TuringAttention, build_projector
from models.flash_vstream.star_memory import StarConfig, StarMemory, pool_grid, weighted_kmeans

POINT = StarConfig(spatial_size=1, spatial_length=1, temporal_size=1, temporal_length=2, abstract_size=1,
                   abstract_length=2, retrieved=1)


def frame(*xy) -> torch.Tensor:
    """One frame of a single 2-D patch feature."""
    return torch.tensor([xy], dtype=torch.float32)


def by_x(memory: StarMemory):
    order = memory.centroids[:, 0, 0].argsort()
    return memory.centroids[order, 0], memory.weights[order].tolist()


# --- STAR memory ------------------------------------------------------------------------------------


def test_weighted_kmeans_weights_points():
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [10.0, 0.0]])
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        centroids, mass = weighted_kmeans(x, torch.tensor([1.0, 3.0, 1.0]), 2, generator=generator)
        order = centroids[:, 0].argsort()
        assert torch.allclose(centroids[order], torch.tensor([[0.0, 0.75], [10.0, 0.0]]))
        assert mass[order].tolist() == [4.0, 1.0]


@pytest.mark.parametrize("seed", range(4))
def test_temporal_memory_merges_frames_weighted_by_count(seed):
    """Our variant (carry_weights=True): a centroid's weight is the number of frames it has absorbed."""
    memory = StarMemory(StarConfig(**{**POINT.__dict__, "carry_weights": True}), seed=seed)
    for xy in [(0, 0), (0, 1), (10, 0)]:
        memory.update(frame(*xy))
    centroids, weights = by_x(memory)
    assert torch.allclose(centroids, torch.tensor([[0, 0.5], [10, 0]])) and weights == [2, 1]
    memory.update(frame(0, 2))  # joins the weight-2 centroid: (2·0.5 + 2) / 3 = 1
    centroids, weights = by_x(memory)
    assert torch.allclose(centroids, torch.tensor([[0.0, 1], [10, 0]])) and weights == [3, 1]


def test_unit_weights_reproduce_their_streaming_loop():
    memory = StarMemory(POINT)  # the default, as their loop: every point (old centroids too) weighs 1
    for xy in [(0, 0), (0, 1), (10, 0), (0, 2)]:
        memory.update(frame(*xy))
    centroids, weights = by_x(memory)
    assert torch.allclose(centroids, torch.tensor([[0, 1.25], [10, 0]])) and weights == [2, 1]  # (0.5 + 2) / 2


def test_spatial_memory_is_a_fifo_of_pooled_frames():
    memory = StarMemory(StarConfig(spatial_size=2, spatial_length=2, temporal_size=1, abstract_size=1))
    grid = torch.arange(16.0)[:, None]  # a 4×4 grid, value = row·4 + col
    for k in range(3):
        memory.update(grid + 100 * k)
    assert pool_grid(grid, 2).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    spatial = memory.parts()["spatial"].flatten().tolist()
    assert spatial == [v + 100 for v in (2.5, 4.5, 10.5, 12.5)] + [v + 200 for v in (2.5, 4.5, 10.5, 12.5)]


def test_retrieval_picks_the_frame_nearest_the_heaviest_centroid():
    """Our variant (retrieval="nearest", with carried weights)."""
    cfg = StarConfig(spatial_size=2, temporal_size=1, temporal_length=2, abstract_size=1, retrieved=1,
                     carry_weights=True, retrieval="nearest")
    spread = torch.tensor([[1.0, 0], [-1, 0], [0, 1], [0, -1]])  # zero-mean, so fine tokens differ, means don't
    frames = [torch.tensor(xy) + (k + 1) * spread for k, xy in enumerate([(0, 0), (20, 0), (0, 1), (0, 0.4), (21, 0)])]
    for seed in range(4):
        memory = StarMemory(cfg, seed=seed)
        for f in frames:
            memory.update(f)
        # centroids: (0, 0.467) from a, c, d (weight 3) and (20.5, 0) from b, e (weight 2); d is nearest the first
        assert torch.equal(memory.retrieved()[0], frames[3])
        assert torch.equal(memory.parts()["spatial"], frames[4])


def test_abstract_memory_moves_slots_toward_new_frames():
    memory = StarMemory(POINT)
    for xy in [(1, 0), (0, 1), (5, 5)]:
        memory.update(frame(*xy))
    # one new token: its softmax weight is 1, so every slot moves update_ratio = 0.2 of the way
    assert torch.allclose(memory.abstract[:, 0], torch.tensor([[1.8, 1.0], [1.0, 1.8]]))


def test_readout_order_and_token_counts_of_flash_vstream_7b():
    memory = StarMemory(StarConfig())
    torch.manual_seed(0)
    counts = []
    for _ in range(30):
        memory.update(torch.randn(256, 4))  # ViT-L/14 at 224: 16×16 patches
        counts.append(len(memory))
    # n·1 abstract + n·16 temporal + min(n, 3)·64 retrieved (from the 2nd frame) + 64 spatial, capped at 25 frames
    assert counts[:3] == [1 + 16 + 64, 2 + 32 + 128 + 64, 3 + 48 + 192 + 64]
    assert counts[-1] == 25 + 400 + 192 + 64 == StarConfig().max_tokens == 681
    parts = memory.parts()
    assert list(parts) == ["abstract", "temporal", "retrieved", "spatial"]
    assert torch.equal(memory.readout(), torch.cat(list(parts.values())))
    # unit weights (the original's): the 26 points of the last clustering, each weighing 1
    assert memory.weights.sum() == 26 and memory.readout().shape == (681, 4)
    # their retrieval indexing reaches only the first 26 frames, so only those are kept
    assert len(memory.buffer) == 26
    assert all(any(torch.equal(row, kept) for kept in memory.buffer) for row in memory.retrieved())


def test_unknown_retrieval_is_refused():
    with pytest.raises(ValueError, match="retrieval"):
        StarMemory(StarConfig(retrieval="random"))


# --- synthetic Flash-VStream checkpoint -----------------------------------------------------------------

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=49152, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FLASH = dict(model_type="vstream", architectures=["VStreamLlamaForCausalLM"], mm_hidden_size=16,
             mm_projector_type="mlp2x_gelu", mm_vision_select_layer=-2, mm_vision_select_feature="patch",
             mm_vision_tower="openai/clip-vit-tiny", mm_use_4_vision_tokens=False, compress_type="mean",
             compress_size=8, compress_long_memory_size=4, compress_Turing_memory_size=1,
             video_current_memory_length=1, video_long_memory_length=3, video_Turing_memory_length=3,
             compress_Turing_update_ratio=0.2, video_sample_type="weighted_kmeans")
# 3 abstract + 3·16 temporal + 3·64 retrieved + 64 spatial
TOKENS = 3 + 48 + 192 + 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve("smollm2"))


@pytest.fixture(scope="module")
def weights():
    """Reference tensors under VStreamLlamaForCausalLM's names, with the extras real checkpoints carry."""
    torch.manual_seed(0)
    state = dict(LlamaForCausalLM(LlamaConfig(**LLAMA)).state_dict())
    state |= {f"model.mm_projector.{k}": v for k, v in build_projector("mlp2x_gelu", 16, 32).state_dict().items()}
    state |= {f"model.attention_model.{k}": v for k, v in TuringAttention(16, 32).state_dict().items()}
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    state["model.vision_tower.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(16)
    return {k: v.contiguous() for k, v in state.items()}


def write_checkpoint(root, tokenizer, weights, fmt="safetensors", edit=None):
    """config + tokenizer + 2 shards and their index under root/ckpt; the CLIP tower in root/clip-vit-tiny."""
    path = root / "ckpt"
    path.mkdir()
    state = dict(weights)
    if edit:
        edit(state)
    names = sorted(state)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    ext, stem = ("safetensors", "model") if fmt == "safetensors" else ("bin", "pytorch_model")
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"{stem}-0000{i}-of-00002.{ext}"
        part = {k: state[k] for k in shard}
        if fmt == "safetensors":
            save_file(part, path / file, metadata={"format": "pt"})
        else:
            torch.save(part, path / file)
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = f"{stem}.{ext}.index.json"
    (path / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**LLAMA, **FLASH}))
    tokenizer.save_pretrained(path)
    tower = root / "clip-vit-tiny"
    if not tower.exists():
        torch.manual_seed(1)
        CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=64, patch_size=4)).save_pretrained(tower)
        (tower / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 64},
                                                                    "crop_size": {"height": 64, "width": 64}}))
    return path


@pytest.fixture(scope="module")
def flash(tmp_path_factory, tokenizer, weights):
    from models.flash_vstream.model import FlashVStream

    return FlashVStream(write_checkpoint(tmp_path_factory.mktemp("flash"), tokenizer, weights))


def frames(seed, n=3):
    return np.random.default_rng(seed).integers(0, 256, (n, 48, 80, 3), dtype=np.uint8)


def test_loader_maps_every_tensor(flash, weights):
    assert torch.equal(flash.projector[2].weight, weights["model.mm_projector.2.weight"])
    assert torch.equal(flash.attention.k_proj.bias, weights["model.attention_model.k_proj.bias"])
    assert torch.equal(flash.model.lm_head.weight, weights["lm_head.weight"])
    assert torch.equal(flash.model.model.layers[1].mlp.up_proj.weight, weights["model.layers.1.mlp.up_proj.weight"])
    assert flash.memory.config.temporal_length == 3 and flash.memory.config.spatial_size == 8
    assert flash.describe().visual_tokens == TOKENS and flash.describe().hidden_size == 32


def test_bin_shards_load_like_safetensors(tmp_path, tokenizer, weights, flash):
    from models.flash_vstream.model import FlashVStream

    other = FlashVStream(write_checkpoint(tmp_path, tokenizer, weights, fmt="bin"))
    for a, b in zip(other.model.state_dict().values(), flash.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(other.projector[0].weight, flash.projector[0].weight)


def test_generates_through_a_bounded_session(flash):
    budget, answer = 96, 4
    session = flash.new_session("inf_mllm", budget=budget, window=8)
    system = session.kv_tokens
    assert flash.question_embeds("Anything yet?").shape[1] < 16  # an empty memory adds no visual tokens
    for index in (1, 2):
        flash.add_clip(session, frames(index), [3.0 * index + t for t in range(3)], index)
    assert session.kv_tokens == system  # clips only update the memory, as in their serving loop
    assert flash.memory.frames == 6 and len(flash.memory) == TOKENS
    assert flash.encode_clip(frames(3), [9.0, 10.0, 11.0]).shape == (TOKENS, 32)
    for question in ("What happens?", "And then?"):
        turn = flash.question_embeds(question)
        assert turn.shape[1] > TOKENS
        session.append(inputs_embeds=turn)
        assert session.kv_tokens <= budget
        for step, token in enumerate(session.generate(answer, eos_token_id=[]), 1):
            assert token.shape == (1,) and session.kv_tokens <= budget + step
        assert step == answer
    text = "".join(flash.ask(session, "Last one?", max_new_tokens=3, eos_token_id=[]))
    assert isinstance(text, str) and session.kv_tokens <= budget + 3


def drop_second_shard(path):
    next(path.glob("*-00002-of-00002.*")).unlink()


def truncate_first_shard(path):
    shard = next(path.glob("*-00001-of-00002.*"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def wrong_projector_shape(state):
    state["model.mm_projector.0.weight"] = torch.zeros(32, 15)


def renamed_tensor(state):
    state["model.layers.0.mlp.gate.weight"] = state.pop("model.layers.0.mlp.gate_proj.weight")


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("damage, edit, message", [
    (drop_second_shard, None, "missing weight shard"),
    (truncate_first_shard, None, "corrupt or truncated"),
    (None, wrong_projector_shape, r"mm_projector.0.weight \(32, 15\) \(config.json implies \(32, 16\)\)"),
    (None, renamed_tensor, r"1 missing \(e.g. model.layers.0.mlp.gate_proj.weight\); 1 unexpected"),
])
def test_broken_checkpoints_raise_one_clear_error(tmp_path, tokenizer, weights, fmt, damage, edit, message):
    from models.flash_vstream.model import FlashVStream

    path = write_checkpoint(tmp_path, tokenizer, weights, fmt, edit)
    if damage:
        damage(path)
    with pytest.raises(AssetError, match=message):
        FlashVStream(path)


def test_missing_config_or_tower_raise_asset_errors(tmp_path, tokenizer, weights):
    from models.flash_vstream.checkpoint import load_flash_vstream

    path = write_checkpoint(tmp_path, tokenizer, weights)
    with pytest.raises(AssetError, match="CLIP vision tower 'openai/clip-vit-tiny' not found locally"):
        load_flash_vstream(path, vision_tower=tmp_path / "nowhere")
    (path / "config.json").unlink()
    with pytest.raises(AssetError, match="no config.json"):
        load_flash_vstream(path)


# --- tiny variant on the real SmolLM2 -------------------------------------------------------------------


def test_tiny_variant_answers_from_memory():
    from models.flash_vstream.tiny import FlashVStreamTiny

    tiny = FlashVStreamTiny(trained=False)
    budget = 160
    session = tiny.new_session("inf_mllm", budget=budget, window=16)
    for index in (1, 2):
        tiny.add_clip(session, np.random.default_rng(index).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8),
                      [2.0 * index, 2.0 * index + 1], index)
    # 4 frames of 4×4 tokens: 4 abstract + 4·4 temporal + 3·16 retrieved + 16 spatial
    assert len(tiny.memory) == 4 + 16 + 48 + 16 and tiny.readout().shape == (84, 576)
    text = "".join(tiny.ask(session, "What colour is the shape?", max_new_tokens=3, eos_token_id=[]))
    assert session.last.decoded == 3 and isinstance(text, str)
    assert session.kv_tokens <= budget + 3
    assert tiny.describe().visual_tokens == 189


@pytest.mark.slow  # compiles the step (~20 s on 2 cores)
def test_compiled_decode_answers_the_eager_tokens(flash):
    """`stream-qa` compiles decode by default on a GPU: with the memory's read-out in each question turn, the
    compiled step answers as the eager one does (one session at a time: a new session resets the memory)."""
    answers = []
    for compiled in (False, True):
        session = flash.new_session("inf_mllm", budget=96, window=8, compile_decode=compiled)
        steps = compiled and session._compiled.steps
        for index in (1, 2, 3):
            flash.add_clip(session, frames(index), [3.0 * index + t for t in range(3)], index)
            session.append(inputs_embeds=flash.question_embeds("What happens?"))
            answers.append([int(t[0]) for t in session.generate(4, eos_token_id=[])])
    assert answers[:3] == answers[3:]
    assert session._compiled.steps - steps == 3 * 3
