"""tiny-vlm's training parts: balanced yes/no questions that agree with easy-VQA, visual tokens snapped
to the vocabulary, and the caption stage that moves an image's tokens onto its colour and shape words."""

import hashlib
import json
import random
import re

import pytest
import torch

from models.tiny_vlm.data import COLOURS, SHAPES, YesNoQuestions, answer_type, questions
from models.tiny_vlm.encoder import FEATURE_DIM
from models.tiny_vlm.model import Projector


@pytest.fixture(scope="module")
def yes_no():
    return YesNoQuestions(questions("train"))


def test_every_wording_has_one_polarity_and_reproduces_easy_vqa_answers(yes_no):
    polarity = {(text, part): yes for text, part, yes in yes_no.wordings}
    assert len(polarity) == len(yes_no.wordings) >= 8
    checked = 0
    for q in questions("train"):
        named = [w for w in q.text.rstrip("?").split() if w in COLOURS + SHAPES]
        if q.image not in yes_no.labels or answer_type(q.answer) != "yes/no" or len(named) != 1:
            continue
        part = 0 if named[0] in COLOURS else 1
        text = re.sub(rf"\b{named[0]}\b", "{}", q.text)
        present = yes_no.labels[q.image][part] == named[0]
        assert ("yes" if present == polarity[(text, part)] else "no") == q.answer, q
        checked += 1
    assert checked > 5000


def test_balanced_questions_break_the_wording_pattern(yes_no):
    rng = random.Random(0)
    images = sorted(yes_no.labels)
    by_wording: dict[str, set] = {}
    answers = []
    for _ in range(3000):
        q = yes_no(rng, rng.choice(images))
        word = next(w for w in q.text.rstrip("?").split() if w in COLOURS + SHAPES)
        by_wording.setdefault(q.text.replace(word, "{}"), set()).add(q.answer)
        answers.append(q.answer == "yes")
    assert 0.45 < sum(answers) / len(answers) < 0.55
    assert all(seen == {"yes", "no"} for seen in by_wording.values())  # no wording gives the answer away


def test_snapped_tokens_are_mixtures_of_word_embeddings():
    torch.manual_seed(0)
    vocabulary = torch.randn(50, 32)
    projector = Projector(32, width=16, vocabulary=vocabulary)
    x = torch.randn(3, 4, FEATURE_DIM)
    weights = torch.softmax(projector.word_logits(x), dim=-1)
    assert torch.allclose(projector(x), weights @ vocabulary, atol=1e-6)
    with torch.no_grad():
        projector.log_temperature.fill_(8.0)  # a sharp softmax: each token becomes one word's embedding
    picked = vocabulary[projector.word_logits(x).argmax(-1)]
    assert torch.allclose(projector(x), picked, atol=1e-4)
    assert set(Projector(32, width=16).state_dict()) | {"log_temperature"} == set(projector.state_dict())


@pytest.mark.slow  # ~30 s on 2 cores: run by `make test-slow` in CI
def test_caption_stage_puts_an_images_colour_and_shape_words_on_its_tokens():
    from models.tiny_vlm.data import features, image_labels
    from models.tiny_vlm.model import TinyVLM
    from models.tiny_vlm.train import CaptionLoss, TrainConfig, caption_stage

    torch.manual_seed(0)
    vlm = TinyVLM(trained=False, snap_to_vocabulary=True)
    labels = dict(list(image_labels(questions("test")).items())[:64])
    caption = CaptionLoss(vlm, features("test"), labels)
    images = sorted(labels)
    with torch.no_grad():
        before = float(caption(images))
    caption_stage(vlm, caption, TrainConfig(caption_steps=40, caption_batch=16), random.Random(0))
    with torch.no_grad():
        after = float(caption(images))
    assert after < 0.5 * before and after >= torch.log(torch.tensor(2.0)) - 1e-4  # ln 2: half the mass per word
    with torch.no_grad():
        top = vlm.projector.word_logits(torch.stack([features("test")[i].float() for i in images])).argmax(-1)
    named = sum(set(caption.words[i]) <= set(row.tolist()) for i, row in zip(images, top, strict=True))
    assert named >= 0.9 * len(images)  # some token of the image is its colour word, another its shape word


def test_scene_episodes_ask_about_the_labels_of_scene_clips():
    from models.tiny_vlm.data import group_by_image
    from models.tiny_vlm.labels import listing, names
    from models.tiny_vlm.scenes import SceneMix, sample_scene_episode

    qs = questions("test")
    by_image = group_by_image(qs)
    frames = {100_000 + k: (k,) for k in range(8)}  # scene frames with their own labels
    image_labels = {i: () for i in by_image}
    rng = random.Random(0)
    label_answers = easy_answers = dropped = clips = 0
    for _ in range(200):
        episode = sample_scene_episode(rng, by_image, image_labels, frames, rng.choice([1, 4, 8]),
                                       SceneMix(share=0.5), max_first=50,
                                       type_weights={"yes/no": 0.5, "colour": 0.25, "shape": 0.25})
        content = [t for t in episode.turns if t[0] == "clip"]
        clips += len(content)
        dropped += sum(t[2] is None for t in content)
        for t in content:
            assert t[2] is None or all(0 <= i < len(names()) for i in t[2])
        for t in episode.turns:
            if t[0] != "ask":
                continue
            if t[2] in COLOURS + SHAPES:
                easy_answers += 1
            elif t[2] not in ("yes", "no"):
                label_answers += 1
                named = [listing((i,)) for c in content if c[2] for i in c[2]]
                assert t[2] == "nothing recognised" or t[2].startswith("no ") or any(n in t[2] for n in named), t
    assert label_answers > 50 and easy_answers > 50
    assert 0.02 < dropped / clips < 0.3  # some easy-VQA clips have no label text, like other adapters' turns


def test_training_episodes_hold_runs_of_clips_with_no_question_between_them():
    """A stream brings many clips between a user's questions; weights trained on one question after
    every clip answered nothing after ten unasked-about clips of real footage."""
    from models.tiny_vlm.data import asks_after, group_by_image, sample_episode

    rng = random.Random(0)
    assert [asks_after(rng, k, 8, 0.0, final_asks=3) for k in range(1, 9)] == [0] * 7 + [3]
    assert [asks_after(rng, k, 4, 2.0) for k in range(1, 5)] == [2, 2, 2, 2]
    by_image = group_by_image(questions("test"))
    longest = 0
    for asks in (0.0, 0.3, 0.6, 1.0):
        episode = sample_episode(rng, by_image, 8, asks_per_clip=asks, final_asks=3)
        kinds = "".join("c" if t[0] == "clip" else "a" for t in episode.turns)
        assert kinds.count("c") == 8 and len(kinds) - len(kinds.rstrip("a")) >= 3  # ≥ 3 after the last clip
        longest = max(longest, max(len(run) for run in kinds.split("a") if run))
    assert longest == 8  # with no questions on the way, all eight clips arrive before the questions


@pytest.mark.slow  # ~36 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_passes_sorted_by_length_give_the_one_padded_pass_loss_and_gradients():
    """Training sends a batch through the LLM in passes of `rows_per_pass` episodes sorted by length
    (about 30% less padding); the loss and its gradients must stay those of one padded pass."""
    from models.tiny_vlm.data import features, group_by_image, sample_episode
    from models.tiny_vlm.episodes import EpisodeBuilder
    from models.tiny_vlm.model import TinyVLM
    from models.tiny_vlm.train import loss_on

    torch.manual_seed(0)
    vlm = TinyVLM(trained=False, labels="none")
    vlm.model.requires_grad_(False)
    vlm.projector.train()
    builder = EpisodeBuilder(vlm, features("test"))
    rng = random.Random(0)
    by_image = group_by_image(questions("test"))
    episodes = [sample_episode(rng, by_image, k, asks_per_clip=0.6, final_asks=2) for k in (1, 4, 2, 3)]
    results = []
    for rows in (0, 2):  # one padded pass; two passes of two sorted episodes
        vlm.projector.zero_grad(set_to_none=True)
        loss = loss_on(vlm, vlm.model.model, builder, episodes, rows_per_pass=rows)
        loss.backward()
        results.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in vlm.projector.parameters()])))
    lengths = {builder.embed(builder.pieces(e.turns))[0].shape[0] for e in episodes}
    assert len(lengths) == 4  # the passes really pad differently
    for loss, grad in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        assert torch.allclose(grad, results[0][1], rtol=1e-3, atol=1e-6)


def test_continued_training_starts_from_the_weights_files_lora_and_refuses_another_rank():
    """`TrainConfig.init`: a new recipe learnt on top of trained weights starts from exactly their LoRA
    (what `lora_tensors` saves is what it loaded), and a LoRA of another shape is refused, not truncated."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from inf_mllm import load_model
    from models.tiny_vlm.model import WEIGHTS, split_weights
    from models.tiny_vlm.train import TrainConfig, add_lora, lora_tensors, set_lora

    saved = load_file(WEIGHTS / "tiny_vlm.safetensors")
    _, start = split_weights(saved)
    lora = {k: v for k, v in saved.items() if k.startswith("lora.")}
    model, _ = load_model("smollm2")
    peft_model = add_lora(model, TrainConfig())
    assert all(not torch.equal(v, lora[k]) for k, v in lora_tensors(peft_model).items() if k.endswith("lora_A"))
    set_lora(peft_model, start)
    loaded = lora_tensors(peft_model)
    assert loaded.keys() == lora.keys() and len(loaded) >= 60
    assert all(torch.equal(loaded[k], lora[k]) for k in lora)
    other, _ = load_model("smollm2")
    with pytest.raises(ValueError, match="lora_rank"):
        set_lora(add_lora(other, replace(TrainConfig(), lora_rank=4)), start)


def test_make_train_starts_from_the_base_the_committed_weights_were_trained_on():
    """`make train-tiny-vlm` continues from `models/tiny_vlm/base`: the file whose sha256 the committed weights'
    last training recorded as its start, and the folder the Makefile names."""
    import re
    from pathlib import Path

    from models.tiny_vlm.model import WEIGHTS

    base = WEIGHTS.parent / "base"
    committed = json.loads((WEIGHTS / "config.json").read_text())
    assert hashlib.sha256((base / "tiny_vlm.safetensors").read_bytes()).hexdigest() == committed["data"]["init_sha256"]
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert re.search(r"^TINY_VLM_BASE \?= models/tiny_vlm/base$", makefile, re.M)
    assert makefile.count("init='\"$(TINY_VLM_BASE)\"'") == 2


def test_continuing_from_a_folder_without_weights_is_a_one_line_error(tmp_path, capsys):
    from models.tiny_vlm.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "w"), "--set", f'init="{tmp_path}"'])
    assert stop.value.code == 2
    assert f"--set init: no tiny_vlm.safetensors in {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def _weights_folder(path, tensors, config):
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "tiny_vlm.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_interpolated_weights_are_the_tensorwise_mix_and_record_both_files(tmp_path):
    """The committed weights are halfway between a training and its continuation: every tensor is the mix,
    the ends reproduce their files, and config.json names both files by hash."""
    from safetensors.torch import load_file

    from models.tiny_vlm.interpolate import interpolate

    a = {"projector.w": torch.randn(4, 3), "lora.x.lora_A": torch.randn(2, 3)}
    b = {k: v + torch.randn_like(v) for k, v in a.items()}
    start = _weights_folder(tmp_path / "start", a, {"steps": 200})
    tuned = _weights_folder(tmp_path / "tuned", b, {"steps": 80, "init": "start"})
    for alpha in (0.0, 0.5, 1.0):
        config = interpolate(start, tuned, alpha, tmp_path / f"mix{alpha}")
        mixed = load_file(tmp_path / f"mix{alpha}" / "tiny_vlm.safetensors")
        assert mixed.keys() == a.keys()
        for k in a:
            assert torch.allclose(mixed[k], (1 - alpha) * a[k] + alpha * b[k], atol=1e-6)
        written = json.loads((tmp_path / f"mix{alpha}" / "config.json").read_text())
        assert written == config and written["steps"] == 80 and written["interpolated"]["alpha"] == alpha
        assert written["interpolated"]["start_sha256"] == hashlib.sha256(
            (start / "tiny_vlm.safetensors").read_bytes()).hexdigest()
    assert torch.equal(load_file(tmp_path / "mix0.0" / "tiny_vlm.safetensors")["projector.w"], a["projector.w"])


def test_interpolating_files_of_another_lora_shape_is_a_one_line_error(tmp_path, capsys):
    from models.tiny_vlm.interpolate import main

    start = _weights_folder(tmp_path / "start", {"lora.x.lora_A": torch.zeros(8, 3)}, {})
    tuned = _weights_folder(tmp_path / "tuned", {"lora.x.lora_A": torch.zeros(4, 3)}, {})
    for argv, message in (([str(start), str(tuned)], "hold different tensors"),
                          ([str(start), str(tmp_path)], f"no tiny_vlm.safetensors and config.json in {tmp_path}"),
                          ([str(start), str(start), "--alpha", "2"], "--alpha must be within [0, 1]")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--out", str(tmp_path / "out"), "--eval", "0"])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
