"""tiny-vlm's training parts: balanced yes/no questions that agree with easy-VQA, visual tokens snapped
to the vocabulary, and the caption stage that moves an image's tokens onto its colour and shape words."""

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
