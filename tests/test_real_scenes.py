"""What the classifier recognises, in the clip turn: labels from real photos reach the turn as text, a
clip with nothing confident says so, and the real model's answers on real photos name their object."""

import random
import re

import numpy as np
import pytest
import torch

from benchmarks.real_scenes import clip_frames, hallucinates, photo
from models.tiny_vlm.labels import (
    NOTHING,
    PERSON,
    THRESHOLD,
    clip_labels,
    display,
    label_text,
    listing,
    names,
    object_label,
    unsupported,
    words_of,
)
from models.tiny_vlm.scenes import label_question, random_labels


def class_id(name: str) -> int:
    return names().index(name)


def thing_asked(question: str) -> str | None:
    """The thing an "is there …?" question asks for, in any of the training's wordings."""
    match = re.fullmatch(r"(?:is there|do you see|can you see|did you see) an? (.+?)(?: in the video| now)?\?",
                         question)
    return match.group(1) if match else None


def test_imagenet_names_and_everyday_words():
    assert len(names()) == 1000 and names()[0] == "tench" and names()[285] == "Egyptian Mau"
    assert display(class_id("mountain bike")) == "mountain bike (bicycle)"
    assert display(class_id("tabby cat")) == "tabby cat"  # its everyday word is already in the name
    assert words_of(class_id("moped")) == {"moped", "motorcycle"}


def test_clip_labels_merge_frames_above_the_threshold():
    probs = torch.zeros(3, 1000)
    probs[0, 285], probs[0, 281] = 0.8, THRESHOLD / 2  # the tabby cat is below the threshold
    probs[1, 967], probs[1, 285] = 0.5, 0.6  # the cat again: named once, at its best probability
    probs[2, 968] = 0.9
    assert clip_labels(probs) == (968, 285, 967)
    assert clip_labels(torch.full((2, 1000), 1e-3)) == ()
    assert label_text(()) == f" Seen: {NOTHING}."


def test_unsupported_names_only_what_the_labels_lack():
    labels = (class_id("Egyptian Mau"), class_id("espresso"))
    assert unsupported("Egyptian Mau (cat), espresso (coffee)", labels) == set()
    assert unsupported("a cat", labels) == set()
    assert unsupported("tabby cat", labels) == {"tabby cat"}
    assert unsupported("mountain bike", labels) == {"mountain bike"}
    assert hallucinates("is there a bicycle?", "yes", labels) and not hallucinates("is there a cat?", "yes", labels)


@pytest.mark.parametrize("more", [False, True], ids=["frame-words", "more-words"])
def test_label_questions_follow_the_labels(more):
    rng = random.Random(0)
    for _ in range(2000):
        labels = random_labels(rng, more)
        question, answer, kind = label_question(rng, labels, more, tenses=more)
        if kind == "what":
            assert answer == listing(labels, more)
        elif kind == "is":
            thing = thing_asked(question)
            if thing not in ("animal", "vehicle", "food"):
                assert (answer == "yes") == (not unsupported(thing, labels, more)), (question, answer, listing(labels))
        elif kind == "which":
            assert answer.startswith("no ") or not unsupported(answer, labels, more), (question, answer)


def test_an_unnamed_did_you_see_asks_about_every_clip_so_far():
    """"did you see a person?" is yes when any clip so far held one; "is there a person now?" asks about
    the clip on screen only."""
    rng = random.Random(0)
    answers: dict[str, set[str]] = {"ever": set(), "now": set()}
    for _ in range(3000):
        labels = random_labels(rng, True)
        question, answer, _ = label_question(rng, labels, True, seen=((PERSON,), labels), tenses=True)
        on_screen = not unsupported("person", labels, True)
        if question == "did you see a person?":
            assert answer == "yes", listing(labels, True)
            answers["ever"].add(answer)
        elif question == "is there a person now?":
            assert (answer == "yes") == on_screen, listing(labels, True)
            answers["now"].add(answer)
    assert answers == {"ever": {"yes"}, "now": {"yes", "no"}}  # both kinds were asked, "now" both ways


def test_hard_negatives_ask_for_what_another_clip_holds_and_this_one_lacks():
    """With `hard`, an "is there …?" answered no names a thing of another clip in context, so the model
    cannot answer yes from any mention of the thing in its context; without it the draws are the old ones."""
    from models.tiny_vlm.scenes import distractor_word

    cat, cup = class_id("Egyptian Mau"), class_id("cup")
    assert distractor_word(random.Random(0), (cup,), ((cat,), None, ()), True) in {"egyptian mau", "cat"}
    assert distractor_word(random.Random(0), (cat,), ((cat,), ()), True) is None  # nothing else in context
    rng, asked = random.Random(0), 0
    for _ in range(2000):
        labels, others = random_labels(rng, True), (random_labels(rng, True), random_labels(rng, True))
        question, answer, kind = label_question(rng, labels, True, others=others, hard=1.0)
        thing = thing_asked(question)
        possible = thing and distractor_word(random.Random(0), labels, others, True) is not None
        if kind == "distractor":
            assert answer == "no" and possible
        if kind in ("is", "distractor") and answer == "no" and possible and thing not in ("animal", "vehicle", "food"):
            assert unsupported(thing, labels, True) and any(
                not unsupported(thing, other, True) for other in others if other), (question, labels)
            asked += 1
    assert asked > 300
    plain, hard0 = random.Random(1), random.Random(1)
    for _ in range(200):
        labels = random_labels(plain, True)
        assert random_labels(hard0, True) == labels
        assert label_question(plain, labels, True) == label_question(hard0, labels, True, others=((cat,),), hard=0.0)


@pytest.fixture(scope="module")
def vlm():
    from models.tiny_vlm.model import TinyVLM

    model = TinyVLM()
    assert model.label_mode == "text", "the committed weights are trained with labels as text"
    return model


def test_labels_of_a_real_photo_reach_the_clip_turn(vlm):
    frames = clip_frames(photo("chelsea"))
    visual, probs = vlm.encode_parts(frames)
    labels = vlm.fit_labels(vlm.perceive(frames, probs))  # the model's perception (perception.DEFAULT)
    assert class_id("Egyptian Mau") in labels
    assert object_label("cat") not in labels  # the detector's cat: the classifier's "Egyptian Mau (cat)" said it
    turn = vlm.encode_clip(frames)
    text = vlm.embed_text(vlm.label_text(labels))
    assert turn.shape[0] == visual.shape[0] + text.shape[0]
    torch.testing.assert_close(turn[visual.shape[0]:], text)  # the label words, as text tokens
    assert turn.shape[0] <= vlm.describe().visual_tokens == 16 + 16
    many = tuple(range(151, 160))  # nine dog breeds: only what fits in 16 tokens is named
    assert 1 <= len(vlm.fit_labels(many)) < 9 and vlm.label_embeddings(many).shape[0] <= 16


def test_a_clip_with_nothing_confident_says_so(vlm):
    frames = np.full((2, 128, 128, 3), 128, dtype=np.uint8)  # a plain grey clip
    _, probs = vlm.encode_parts(frames)
    assert clip_labels(probs) == () and vlm.perceive(frames, probs) == ()
    turn = vlm.encode_clip(frames)
    torch.testing.assert_close(turn[16:], vlm.embed_text(f" Seen: {NOTHING}."))
    session = vlm.new_session("full")
    vlm.append_clip(session, turn, 1)
    assert vlm.answer(session, "what is in the video?") == NOTHING
    assert vlm.answer(session, "is there a dog?") == "no"


def test_answers_on_a_real_photo_name_its_object(vlm):
    session = vlm.new_session("inf_mllm", budget=256)
    vlm.add_clip(session, clip_frames(photo("coffee")), [0.0, 0.5, 1.0, 1.5], index=1)
    assert "espresso" in vlm.answer(session, "what is in the video?").lower()
    vlm.add_clip(session, clip_frames(photo("chelsea")), [2.0, 2.5, 3.0, 3.5], index=2)
    assert "cat" in vlm.answer(session, "what is in the video?").lower()
    assert vlm.answer(session, "is there a cat?") == "yes"
    assert vlm.answer(session, "is there a bicycle?") == "no"
    assert "espresso" in vlm.answer(session, "In clip 1, what do you see?").lower()


@pytest.mark.xfail(strict=True, reason="known model error (issue 25): the committed weights answer yes to 'is there "
                   "a X?' about the latest clip whenever an earlier clip in context held X (12 of 12 photo pairs)")
def test_is_there_asks_about_the_latest_clip_not_an_earlier_one(vlm):
    session = vlm.new_session("full")
    vlm.add_clip(session, clip_frames(photo("coffee")), [0.0, 0.5, 1.0, 1.5], index=1)
    vlm.add_clip(session, clip_frames(photo("chelsea")), [2.0, 2.5, 3.0, 3.5], index=2)
    # the first question after the clips (an answer already in context changes it: then "no")
    assert vlm.answer(session, "is there a cup?") == "no"  # the cup was clip 1: "In clip 1, …" asks about it
    assert vlm.answer(session, "is there a cat?") == "yes"


def test_each_contrast_asks_a_clip_that_holds_the_hard_negatives_thing():
    """With `contrast`, a hard negative ("In clip 2, is there a cat?" → no, the cat being clip 1's) is followed by
    the same thing asked about a clip that holds it (→ yes), so that the thing's mention is no cue for "no"."""
    from models.tiny_vlm.data import group_by_image, questions
    from models.tiny_vlm.scenes import SceneMix, sample_scene_episode

    by_image = group_by_image(questions("test"))
    frames = {100_000 + k: random_labels(random.Random(k), True) for k in range(40)}
    image_labels = {i: () for i in by_image}
    mix = SceneMix(share=1.0, scene_clip=1.0, own_labels=1.0, hard_negatives=1.0, contrast=1.0)
    rng, hard, contrasts = random.Random(0), 0, 0
    for _ in range(300):
        episode = sample_scene_episode(rng, by_image, image_labels, frames, rng.choice([2, 4]), mix, more=True)
        labels_of, latest, previous = {}, None, None
        for turn in episode.turns:
            if turn[0] == "clip":
                latest = len(labels_of) + 1
                labels_of[latest] = turn[2]
                continue
            named = re.match(r"In clip (\d+), (.*)", turn[1])
            clip, question = (int(named[1]), named[2]) if named else (latest, turn[1])
            thing = thing_asked(question)
            if thing is None or thing in ("animal", "vehicle", "food"):
                previous = None
                continue
            assert (turn[2] == "yes") == (not unsupported(thing, labels_of[clip], True)), (turn, labels_of)
            elsewhere = any(not unsupported(thing, labels, True) for c, labels in labels_of.items() if c != clip)
            hard += turn[2] == "no" and elsewhere
            contrasts += turn[2] == "yes" and previous == (thing, "no")
            previous = thing, turn[2]
    assert hard > 100 and contrasts == hard  # every hard negative has its "yes" right after it


@pytest.mark.slow  # ~27 s on 2 cores: out of `make test`, run by `make test-slow` in CI
def test_distractor_questions_are_asked_both_ways(vlm):
    """The held-out measure of that error (`evaluate_distractors`): both kinds drawn, and the thing that is
    in the asked clip as well as another one is recognised."""
    from models.tiny_vlm.episodes import EpisodeBuilder
    from models.tiny_vlm.evaluate import evaluate_distractors
    from models.tiny_vlm.scenes import scene_frames

    feats, frames = scene_frames("test")
    scores = evaluate_distractors(vlm, EpisodeBuilder(vlm, feats), frames, n=16, progress=False)
    assert set(scores) == {"labels_distractor_no", "labels_distractor_yes"}
    assert scores["labels_distractor_yes"] >= 0.8, scores


@pytest.mark.slow
def test_real_scenes_goal(vlm):
    """The issue's goal on the real-photo benchmark: where the classifier's top-5 names the object,
    "what is in the clip?" / "is there a X?" answers are right (goal 0.9), and a thing of an earlier clip is not
    taken for the latest clip's."""
    from benchmarks.real_scenes import earlier_things, evaluate

    scores, rows = evaluate(vlm, progress=False)
    # 0.923 with the stop-41 weights (goal 0.9; 0.885 with stop 37's); a floor one answer under the goal
    assert scores["top5_what_or_is"] >= 0.88, scores
    # 0.965 with the stop-41 weights (0.947 with stop 37's; 0.895 with stop 36's, whose "what animal is in the
    # video?" named an animal on the clock and the astronaut photos)
    assert scores["free_of_hallucination"] >= 0.93, scores
    # photo pairs: the earlier photo's thing → "no" in 5 of 12 (stop 37's weights: 0), the latest's → "yes" in 12
    pairs, _ = earlier_things(vlm)
    assert pairs["latest_not_earlier"] >= 0.3 and pairs["latest_thing"] >= 0.9, pairs
