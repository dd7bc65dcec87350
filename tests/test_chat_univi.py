"""Chat-UniVi port: DPC-KNN merging by hand, the real loader on synthetic checkpoints, streaming with eviction."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from inf_mllm import AssetError
from models.chat_univi import merging
from models.chat_univi.vision import sample_frames
from models.clip_vision import CLIP_MEAN, CLIP_STD

# --- DPC-KNN by hand --------------------------------------------------------------------------------

# Two obvious groups, shuffled: A = (0,0) (1,0) (0,1) and B = (10,10) (12,10) (10,12), B twice as spread.
POINTS = torch.tensor([[12.0, 10], [0, 0], [10, 10], [1, 0], [0, 1], [10, 12]])


def test_dpc_knn_matches_the_hand_computed_case():
    found = merging.dpc_knn(POINTS[None], clusters=2, k=3)
    # distances are Euclidean / sqrt(2); density = exp(-mean squared distance to the 3 nearest, self included)
    # A's corner (0,0): 0, 1/2, 1/2 → 1/3; A's others: 0, 1/2, 1 → 1/2; B's are 4× those
    want = torch.exp(-torch.tensor([2, 1 / 3, 4 / 3, 1 / 2, 1 / 2, 2]))
    assert torch.allclose(found.density[0], want)
    # delta (squared Euclidean below): the densest point gets the largest distance, (0,0)-(12,10); B's corner
    # is 181 from A's nearest point; the other points are 1 (A) or 4 (B) from their corner
    assert torch.allclose(found.delta[0], torch.tensor([4, 244, 181, 1, 1, 4]).div(2).sqrt())
    assert found.centers.tolist() == [[1, 2]]  # the two corners, A's first (higher density × delta)
    assert found.labels.tolist() == [[1, 0, 1, 0, 0, 1]]
    sums = torch.tensor([[1.0, 1.0], [32.0, 32.0]])
    assert torch.equal(merging.merge(POINTS[None], found.labels, 2, eps=0)[0], sums / 3)  # our exact variant
    merged = merging.merge(POINTS[None], found.labels, 2)  # Chat-UniVi's: each token / (count + 1e-6), summed
    assert torch.allclose(merged[0], sums / (3 + 1e-6), rtol=0, atol=1e-6) and merged[0, 1, 0] < 32 / 3


def test_merge_is_a_weighted_mean_and_ties_are_deterministic():
    x = torch.tensor([[[0.0, 0], [4, 8], [1, 1]]])
    labels = torch.tensor([[0, 0, 1]])
    merged = merging.merge(x, labels, 2, weight=torch.tensor([[3.0, 1, 5]]), eps=0)
    assert torch.equal(merged, torch.tensor([[[1.0, 2], [1, 1]]]))
    same = torch.zeros(1, 5, 3)  # all densities tie: with ties="index" the earliest token is the peak, every run
    assert merging.dpc_knn(same, 1, 2, ties="index").centers.tolist() == [[0]]
    # Chat-UniVi's way (default): 1e-6 noise decides; the same seed gives the same peak, as torch.manual_seed does
    square = torch.tensor([[[0.0, 0], [0, 1], [1, 0], [1, 1]]])  # every density ties
    peaks = [merging.dpc_knn(square, 1, 2, generator=torch.Generator().manual_seed(s)).centers.item() for s in range(8)]
    assert len(set(peaks)) > 1
    torch.manual_seed(3)
    assert merging.dpc_knn(square, 1, 2).centers.item() == peaks[3]
    with pytest.raises(ValueError, match="ties"):
        merging.dpc_knn(same, 1, 2, ties="random")


def test_chat_univi_step_rules():
    assert merging.cluster_count(64, 256) == 64 and merging.cluster_count(1 / 16, 20) == 2
    assert merging.cluster_count(64, 10) == 10  # capped where Chat-UniVi would fail
    assert merging.neighbours(5, 64, 256) == 5 and merging.neighbours(5, 2, 40) == 1
    assert merging.tokens_per_event() == 112
    assert merging.scaled_steps(16) == ((4, 5), (2, 3), (1, 3))


def scene_frames(scenes: str, tokens: int = 8, dim: int = 4) -> torch.Tensor:
    """One frame per letter; frames of one letter share a scene (a feature offset) plus small noise."""
    g = torch.Generator().manual_seed(0)
    offsets = {s: torch.full((dim,), 10.0 * i) for i, s in enumerate(sorted(set(scenes)))}
    return torch.stack([offsets[s] + 0.1 * torch.randn(tokens, dim, generator=g) for s in scenes])


def noise(seed: int) -> merging.Options:
    return merging.Options(generator=torch.Generator().manual_seed(seed))


def test_temporal_events_group_frames_of_a_scene():
    """With 2 events k drops to 1, so every density is exp(0) and ties: Chat-UniVi's 1e-6 noise alone picks the
    peaks, and can put both in one scene (25 of 200 seeds for "AABBA"); our ties="index" variant never does."""
    frames, index = scene_frames("AABBA"), merging.Options(ties="index")
    assert merging.temporal_events(frames, rate=2, options=index) == [[0, 1, 4], [2, 3]]  # a returning scene rejoins
    assert merging.temporal_events(frames) == [[0, 1, 2, 3, 4]]  # 1/16 event per frame: one event up to 16
    two = scene_frames("A" * 17 + "B" * 15)
    assert merging.temporal_events(two, options=index) == [list(range(17)), list(range(17, 32))]
    seeded = [merging.temporal_events(frames, rate=2, options=noise(i))
              for i in range(40)]
    assert [[0, 1, 4], [2, 3]] in seeded and any(events != [[0, 1, 4], [2, 3]] for events in seeded)


def test_clip_tokens_take_the_image_path_below_three_frames():
    steps = merging.scaled_steps(64)  # 16, 8, 4
    x = torch.randn(5, 64, 6)
    assert merging.clip_tokens(x, steps).shape == (28, 6)  # one event
    assert merging.clip_tokens(x[:2], steps).shape == (56, 6)  # two images
    two_scenes = scene_frames("A" * 17 + "B" * 15, tokens=64, dim=6)
    events = merging.clip_tokens(two_scenes, steps, options=merging.Options(ties="index"))  # see the test above
    assert events.shape == (56, 6)
    assert events[:28].mean() < 5 < events[28:].mean()  # each event merges only its own frames


def test_frames_are_sampled_at_one_fps_and_capped():
    assert sample_frames(np.arange(90) / 30, 90) == [0, 30, 60]
    kept = sample_frames(np.arange(200.0), 200)
    assert len(kept) == 64 and kept[0] == 0 and kept[-1] == 199
    assert sample_frames([], 3) == [0, 1, 2]


# --- a synthetic checkpoint under the real names and layouts ------------------------------------------

HIDDEN, VISION = 32, 16
CLUSTER_CONFIG = {"use_cluster": True, "freeze": False, "mm_tune": True, "vision_tune": False,
                  "spatial_cluster_rate0": 64, "spatial_cluster_rate1": 32, "spatial_cluster_rate2": 16,
                  "temporal_cluster_rate": 1 / 16}


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from models.chat_univi.model import SYSTEM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SYSTEM, "USER: What happens in the video? ASSISTANT: A cat.</s>", "Clip 1, from 0 s."],
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_checkpoint(folder, tensors: dict, config: dict, tokenizer, layout: str) -> None:
    """Two shards plus an index json, named as save_pretrained names them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(folder)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        shard = {k: tensors[k].clone().contiguous() for k in part}
        if layout == "safetensors":
            file = f"model-{i:05d}-of-00002.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
        else:
            file = f"pytorch_model-{i:05d}-of-00002.bin"
            torch.save(shard, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = "model.safetensors.index.json" if layout == "safetensors" else "pytorch_model.bin.index.json"
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("chat_univi")
    torch.manual_seed(0)
    # a whole CLIP (text and vision) as openai/clip-vit-large-patch14 is, found next to the checkpoints by its name
    vision = {"hidden_size": VISION, "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
              "image_size": 56, "patch_size": 7}
    text = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    full_clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    full_clip.save_pretrained(root / "clip-vit-large-patch14")
    clip = full_clip.vision_model
    (root / "clip-vit-large-patch14" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 56},
         "crop_size": {"height": 56, "width": 56}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}))
    tokenizer = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    llm = LlamaForCausalLM(cfg).eval()
    projector = torch.nn.Linear(VISION, HIDDEN)
    tensors = dict(llm.state_dict())
    tensors.update({f"model.mm_projector.{k}": v for k, v in projector.state_dict().items()})
    # the frozen CLIP copy real checkpoints carry; Chat-UniVi ignores it, so it is zeros here to prove we do too
    tensors.update({f"model.vision_tower.vision_tower.vision_model.{k}": torch.zeros_like(v)
                    for k, v in clip.state_dict().items()})
    config = {**cfg.to_dict(), "model_type": "ChatUniVi", "architectures": ["ChatUniViLlamaForCausalLM"],
              "mm_vision_tower": "openai/clip-vit-large-patch14", "mm_hidden_size": VISION,
              "mm_vision_select_layer": -2, "mm_use_im_start_end": False, "mm_use_im_patch_token": False,
              "use_mm_proj": True, "config": CLUSTER_CONFIG}
    for layout in ("safetensors", "bin"):
        write_checkpoint(root / f"ckpt-{layout}", tensors, config, tokenizer, layout)
    return {"root": root, "llm": llm, "clip": clip, "tensors": tensors}


def random_clip(seed: int, frames: int = 4):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, 40, 48, 3), dtype=np.uint8), [float(seed * 10 + i) for i in range(frames)]


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_checkpoint_streams_with_eviction(assets, layout):
    from models.chat_univi.model import ChatUniVi

    adapter = ChatUniVi(assets["root"] / f"ckpt-{layout}")
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        assert torch.allclose(adapter.model(input_ids=ids).logits, assets["llm"](input_ids=ids).logits, atol=1e-5)
    assert torch.equal(adapter.projector.weight, assets["tensors"]["model.mm_projector.weight"])
    tower = adapter.tower.model.state_dict()
    assert all(torch.equal(tower[k], v) for k, v in assets["clip"].state_dict().items())  # CLIP's, not the zeros
    frames, ts = random_clip(0)
    assert adapter.tower(frames).shape == (4, 64, VISION)  # 8×8 patches of layer -2, CLS dropped
    assert adapter.encode_clip(frames, ts).shape == (112, HIDDEN) == (adapter.describe().visual_tokens, HIDDEN)
    assert adapter.encode_clip(frames[:2], ts[:2]).shape == (224, HIDDEN)  # two frames: two images

    budget = 64
    session = adapter.new_session("inf_mllm", budget=budget, window=16)
    for i in (1, 2):
        adapter.add_clip(session, *random_clip(i), index=i)
        assert session.kv_tokens <= budget
    session.append(adapter.question_turn("What happens in the video?"))
    assert session.kv_tokens <= budget < session.seen
    tokens = list(session.generate(5, eos_token_id=[]))
    assert len(tokens) == 5 and session.kv_tokens <= budget + len(tokens)


def damaged_copy(assets, tmp_path, layout="safetensors"):
    shutil.copytree(assets["root"] / "clip-vit-large-patch14", tmp_path / "clip-vit-large-patch14")
    return shutil.copytree(assets["root"] / f"ckpt-{layout}", tmp_path / "ckpt")


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def reshape_projector(ckpt):
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    file = ckpt / index["weight_map"]["model.mm_projector.weight"]
    shard = load_file(file)
    shard["model.mm_projector.weight"] = torch.zeros(HIDDEN, VISION + 1)
    save_file(shard, file)


DAMAGE = {
    "no config": (lambda ckpt: (ckpt / "config.json").unlink(), "no config.json"),
    "missing shard": (lambda ckpt: (ckpt / "model-00002-of-00002.safetensors").unlink(), "lacks model-00002"),
    "missing tower": (lambda ckpt: shutil.rmtree(ckpt.parent / "clip-vit-large-patch14"), "not on disk.*download"),
    "tower without weights": (lambda ckpt: (ckpt.parent / "clip-vit-large-patch14" / "model.safetensors").unlink(),
                              "cannot load the CLIP tower"),
    "truncated safetensors": (lambda ckpt: truncate(ckpt / "model-00001-of-00002.safetensors"), "corrupt or truncated"),
    "wrong shape": (reshape_projector, r"mis-shaped: model.mm_projector.weight \(32, 17\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_gives_one_clear_error(assets, tmp_path, damage):
    from models.chat_univi.model import ChatUniVi

    ckpt = damaged_copy(assets, tmp_path)
    spoil, message = DAMAGE[damage]
    spoil(ckpt)
    with pytest.raises(AssetError, match=message) as err:
        ChatUniVi(ckpt)
    assert isinstance(err.value, ValueError) and "download" in str(err.value)


def test_truncated_bin_shard_and_renamed_weight(assets, tmp_path):
    from models.chat_univi.model import ChatUniVi

    ckpt = damaged_copy(assets, tmp_path, "bin")
    truncate(ckpt / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(AssetError, match="pytorch_model-00002-of-00002.bin is corrupt or truncated"):
        ChatUniVi(ckpt)
    shutil.copy(assets["root"] / "ckpt-bin" / "pytorch_model-00002-of-00002.bin", ckpt)
    shard = torch.load(ckpt / "pytorch_model-00001-of-00002.bin", weights_only=True)
    shard["lm_head.weights"] = shard.pop("lm_head.weight")
    torch.save(shard, ckpt / "pytorch_model-00001-of-00002.bin")
    with pytest.raises(AssetError, match="1 missing: lm_head.weight; 1 unexpected: lm_head.weights"):
        ChatUniVi(ckpt)


# --- the tiny variant on the real SmolLM2 ------------------------------------------------------------

def photo_clip(names, start: float):
    import skimage.data

    frames = np.stack([getattr(skimage.data, n)()[:256, :256] for n in names])
    return frames, [start + i for i in range(len(names))]


def test_tiny_variant_merges_and_generates_with_smollm2():
    from models.chat_univi.tiny import ChatUniViTiny

    adapter = ChatUniViTiny(trained=False)
    first = photo_clip(["astronaut", "astronaut", "chelsea"], 0.0)
    assert adapter.encode_clip(*first).shape == (7, 576) == (adapter.describe().visual_tokens, 576)
    session = adapter.new_session("inf_mllm", budget=48, window=16)
    adapter.add_clip(session, *first, index=1)
    adapter.add_clip(session, *photo_clip(["coffee", "coffee", "rocket", "rocket"], 3.0), index=2)
    session.append(adapter.question_turn("What is in the video?"))
    tokens = [int(t[0]) for t in session.generate(4)]
    assert 1 <= len(tokens) <= 4 and all(0 <= t < adapter.model.config.vocab_size for t in tokens)
    assert session.kv_tokens <= 48 + len(tokens)
    assert math.isfinite(float(adapter.encode_clip(*first).float().abs().sum()))


@pytest.mark.slow  # compiles the step (~20 s on 2 cores)
def test_compiled_decode_answers_the_eager_tokens(assets):
    """`stream-qa` compiles decode by default on a GPU: Chat-UniVi's step compiles and answers as the eager one
    does."""
    from models.chat_univi.model import ChatUniVi

    adapter = ChatUniVi(assets["root"] / "ckpt-safetensors")
    answers, sessions = [], [adapter.new_session("inf_mllm", budget=256, window=16, compile_decode=c) for c in (0, 1)]
    steps = sessions[1]._compiled.steps
    for session in sessions:
        session.cache.reserve(adapter.turn_tokens() + 1 + 5)
        for i in range(1, 5):
            adapter.add_clip(session, *random_clip(i), index=i)
            if i % 2 == 0:
                session.append(adapter.question_turn("What happens in the video?"))
                answers.append([int(t[0]) for t in session.generate(5, eos_token_id=[])])
    assert answers[:2] == answers[2:]
    assert sessions[1]._compiled.steps - steps == 2 * 4
