"""The released checkpoints' layout variants load through our loaders and still give the original's outputs.

Each case copies a checkpoint saved by the original classes (tests/fixtures/originals) and changes
one thing the way released folders differ: where the CLIP tower is named (a hub name with the tower
downloaded next to the checkpoint, an absolute path), how the weights are stored (one file instead
of an index and shards), config keys the originals read (`mm_use_im_patch_token`,
`mm_vision_select_layer` written out), and a tokenizer shipped only as tokenizer.model. The output
checked is the recorded next-token logits of the one-frame prompt at 240×320.
"""

import json
import shutil

import pytest
import torch
from fixtures.originals import compare
from safetensors.torch import load_file, save_file

SIZE, COUNT = (240, 320), 1
TOWER = "openai/clip-vit-tiny-patch14"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def tower_next_to_checkpoint(folder):
    """config names the hub repository; the tower was downloaded beside the checkpoint under its last name part."""
    shutil.move(folder / TOWER, folder.parent / "clip-vit-tiny-patch14")
    shutil.rmtree(folder / "openai")


def tower_at_absolute_path(folder):
    target = folder.parent / "towers" / "my-clip"
    shutil.move(folder / TOWER, target)
    edit_config(folder, mm_vision_tower=str(target))


def one_safetensors_file(folder):
    """Shards merged into model.safetensors, no index (how a converted or re-saved checkpoint ships)."""
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors = {}
    for shard in shards:
        tensors.update(load_file(folder / shard))
        (folder / shard).unlink()
    index.unlink()
    save_file(tensors, folder / "model.safetensors")


def patch_token_flag(folder):
    """The originals add "<im_patch>" to the tokenizer when this is true (a new embedding row no prompt uses)."""
    edit_config(folder, mm_use_im_patch_token=True, mm_use_im_start_end=False)


def select_layer_written_out(folder):
    edit_config(folder, mm_vision_select_layer=-2, mm_vision_select_feature="patch")


LAYOUTS = {"tower next to the checkpoint": tower_next_to_checkpoint,
           "tower at an absolute path": tower_at_absolute_path, "one safetensors file": one_safetensors_file,
           "mm_use_im_patch_token true": patch_token_flag, "select layer written out": select_layer_written_out}


@pytest.fixture(scope="module")
def recorded():
    return compare.records()


@pytest.fixture(scope="module")
def frame():
    return compare.frames_mod.frames(COUNT, *SIZE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_vstream_layouts_load_and_match(tmp_path, recorded, frame, layout):
    folder = tmp_path / "Flash-VStream-7b"
    shutil.copytree(compare.FLASH, folder)
    LAYOUTS[layout](folder)
    from models.flash_vstream.model import FlashVStream

    tensors, meta = recorded
    adapter = FlashVStream(folder, seed=meta["seed"])
    assert not (folder / "tokenizer.json").exists()
    stages = compare.flash_size(adapter, tensors, meta, SIZE, compare.frames_mod.frames(64, *SIZE)[:2])
    assert stages["prompt ids (ids off)"] == 0 and stages["STAR read-out"] <= 1e-5 and stages["logits"] <= 1e-5


@pytest.mark.parametrize("layout", ["tower next to the checkpoint", "mm_use_im_patch_token true"])
def test_chat_univi_layouts_load_and_match(tmp_path, recorded, frame, layout):
    folder = tmp_path / "Chat-UniVi"
    shutil.copytree(compare.CHAT_UNIVI, folder)
    LAYOUTS[layout](folder)
    from models.chat_univi.model import ChatUniVi

    tensors, meta = recorded
    adapter = ChatUniVi(folder, seed=meta["seed"])
    stages = compare.chat_univi_size(adapter, tensors, meta, SIZE, frame, counts=(COUNT,))
    assert stages["merged tokens"] <= 1e-5 and stages["logits"] <= 1e-5
    assert torch.equal(adapter.system_ids()[0, :1], torch.tensor([adapter.tokenizer.bos_token_id]))
