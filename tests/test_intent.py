"""Questions in plain words (`models/intent.py`): what they ask, which clips answer them, the answers
read off the clip log, and, on the real tiny-vlm with real photos, recall that links the clip a question
needs and nothing for a question about the present."""

import pytest

from models.intent import clock, log_answer, read, resolve
from streaming.provenance import notes

SEEN = ["clock", "tram", "Egyptian Mau (cat), tabby cat", "Egyptian Mau (cat), tabby cat", "suit (person), "
        "mountain bike (bicycle)", "espresso (coffee), cup", "sorrel (horse)", "missile (rocket)", "tram",
        "tabby cat"]
LOG = [{"clip": i, "start": 4.0 * (i - 1), "end": 4.0 * i, "seen": s} for i, s in enumerate(SEEN, start=1)]
NOW = 40.0


@pytest.mark.parametrize("text, kind, when, things", [
    ("did you see a cat?", "is", "past", ("cat",)),
    ("Is there a car now?", "is", "now", ("car",)),
    ("is there a bicycle?", "is", "now", ("bicycle",)),
    ("when did the rocket appear?", "when", "first", ("rocket",)),
    ("when did you last see a cat?", "when", "last", ("cat",)),
    ("what did you see just before the horse?", "what", "before", ()),
    ("what was on screen at the start?", "what", "start", ()),
    ("how many times did you see a bicycle?", "count", "past", ("bicycle",)),
    ("what did you see a minute ago?", "what", "ago", ()),
    ("have you seen any dogs?", "is", "past", ("dogs",)),
    ("what is on screen?", "what", "now", ()),
    ("In clip 3, what is it?", "what", "named", ()),  # the kind is read after the clip it names
    ("in clip 12, how many cars are there?", "number", "named", ("cars",)),
    ("is there still a car?", "is", "now", ("car",)),
    ("were there any people at the start?", "is", "start", ("person",)),  # the labels' word for people
    ("did a bus go by in the last five minutes?", "is", "within", ("bus",)),
    ("did you see a man in a suit?", "is", "past", ("suit", "person")),  # the last noun first
    ("what did you see?", "what", "all", ()),  # the stream so far, not the present clip
    ("what happened so far?", "what", "all", ()),
    ("What have you seen?", "what", "all", ()),
    ("summarize the video", "other", "all", ()),
    ("what do you see?", "what", "now", ()),
    ("what is happening?", "what", "now", ()),
])
def test_reading_a_question(text, kind, when, things):
    intent = read(text)
    assert (intent.kind, intent.when, intent.things) == (kind, when, things)


@pytest.mark.parametrize("text, targets, focus", [
    ("did you see a cat?", [10], None),  # the latest cat is the latest clip: asked as is
    ("did you see a bicycle?", [5], 5),
    ("did you see cats?", [10], None),  # plural
    ("have you seen a dog?", [], None),  # never seen: nothing to link
    ("is there a cup now?", [], None),  # the present links nothing, even when a past clip saw a cup
    ("when did the cat appear?", [3], 3),
    ("what did you see just before the horse?", [6], 6),
    ("what did you see just after the horse?", [8], 8),
    ("what was on screen at the start?", [1], 1),
    ("what did you see half a minute ago?", [3], 3),  # 40 s - 30 s = 10 s: clip 3 (8-12 s)
    ("In clip 4, is there a cat?", [4], 4),
    ("at 0:21, what did you see?", [6], 6),
    ("did you see a bicycle in the last ten seconds?", [], None),  # clip 5 ended 20 s ago
    ("did you see a cat in the last ten seconds?", [10], None),
    ("did you see a man in a suit?", [5], 5),
])
def test_resolving_against_the_clip_log(text, targets, focus):
    got = resolve(read(text), LOG, NOW)
    assert [m["clip"] for m in got.targets] == targets, got.why
    assert (got.focus or {}).get("clip") == focus


def test_when_and_how_often_are_read_off_the_clip_log():
    def answer(text):
        intent = read(text)
        return log_answer(intent, resolve(intent, LOG, NOW))

    assert answer("when did the rocket appear?") == "at 0:28 (clip 8)"
    assert answer("when did you last see a cat?") == "last in clip 10 (0:36-0:40)"
    assert answer("how many times did you see a cat?") == "twice"  # clips 3-4 are one sighting, 10 another
    assert answer("how many times did you see a dog?") == "never"
    assert answer("when did the dog appear?") == "never"
    assert answer("what was on screen at the start?") is None  # the model answers, from the clip linked


def test_yes_no_answers_agree_with_the_clip_log():
    """Where a clip's words hold every thing asked about, "did you see …?" is answered yes from the log, naming the
    clip its provenance line names; a thing the log never saw is left to the model (perception may have missed it),
    and so is the present."""
    def asked(text):
        intent = read(text)
        resolution = resolve(intent, LOG, NOW)
        return log_answer(intent, resolution), resolution.why

    assert asked("did you see a cat?") == ("yes, last seen in clip 10 (0:36-0:40)", "last cat: clip 10 (0:36-0:40)")
    assert asked("have you ever seen a horse?") == ("yes, last seen in clip 7 (0:24-0:28)",
                                                   "last horse: clip 7 (0:24-0:28)")
    assert asked("did you see a man in a suit?")[0] == "yes, last seen in clip 5 (0:16-0:20)"
    assert asked("did you see a cat in the last ten seconds?")[0] == "yes, last seen in clip 10 (0:36-0:40)"
    assert asked("did you see a man on a horse?")[0] is None  # no clip holds both
    assert asked("did you see a dog?")[0] is None and asked("did you see a bicycle in the last ten seconds?")[0] is None
    assert asked("is there a cat now?")[0] is None


def test_the_stream_so_far_is_answered_from_every_clip():
    """"What did you see?" asks about the stream so far: each thing at the time it was first seen, a label's category
    standing for it; nothing linked. Clips without words leave it to the model and the keys."""
    intent = read("what did you see?")
    resolution = resolve(intent, LOG, NOW)
    assert resolution.targets == [] and resolution.why == "the stream so far: 10 clip(s), 0:00-0:40"
    assert log_answer(intent, resolution) == ("0:00 clock; 0:04 tram; 0:08 cat; 0:16 person, bicycle; 0:20 coffee, "
                                              "cup; 0:24 horse; 0:28 rocket (10 clip(s), 0:00-0:40)")
    many = [{"clip": i, "start": 4.0 * i, "end": 4.0 * i + 4, "seen": f"thing{i}"} for i in range(12)]
    said = log_answer(intent, resolve(intent, many, 48.0))
    assert said.startswith("0:00 thing0; 0:04 thing1") and "; and 4 more (12 clip(s), 0:00-0:48)" in said
    bare = [{k: v for k, v in m.items() if k != "seen"} for m in LOG]
    assert not resolve(intent, bare, NOW).decided


def test_clips_without_words_leave_the_choice_to_the_keys():
    """Adapters whose turns carry no words (the 7B ports): a past question is not decided by words."""
    bare = [{k: v for k, v in m.items() if k != "seen"} for m in LOG]
    assert not resolve(read("did you see a cat?"), bare, NOW).decided
    assert resolve(read("is there a cat now?"), bare, NOW).decided
    assert resolve(read("what was on screen at the start?"), bare, NOW).targets == [bare[0]]


def test_clock_and_notes():
    assert (clock(65), clock(3723)) == ("1:05", "1:02:03")

    class Answer:
        looked_up, source, recalled = "last cat: clip 3 (0:08-0:12)", "model", [{"clip": 3, "start": 8, "end": 12}]

    assert notes(Answer) == "last cat: clip 3 (0:08-0:12); recalled clip 3"


@pytest.mark.parametrize("policy", ["inf_mllm", "inf_mllm+recall"])
def test_plain_words_about_an_evicted_photo_on_real_tiny_vlm(vlm, policy):
    """A cat photo, then eight clips of real street video push it out of a 256-token cache. "did you see a cat?" is
    answered yes from the clip log, with and without recall; "what was on screen at the start?" finds the clip by
    its words: with recall it is linked back and answered with the cat, without it the clip is gone; "is there a cat
    now?" links nothing and is answered no, with and without recall."""
    import torch

    from benchmarks.natural import encode_pieces
    from streaming.engine import Clip, TurnEngine
    from streaming.questions import Question

    order = ["chelsea"] + ["bikes-a", "bikes-b", "carphone", "bunny-a"] * 2
    visual = encode_pieces(vlm, set(order))
    session = vlm.new_session(policy, budget=256)
    engine = TurnEngine(vlm, session, max_new_tokens=6)
    with torch.inference_mode():
        for k, name in enumerate(order):
            engine.feed(Clip(k + 1, 4.0 * k, 4.0 * (k + 1), visual[name], 0.0))
        assert "cat" in engine.log[0]["seen"]
        past = engine.answer(Question("did you see a cat?"))
        start = engine.answer(Question("what was on screen at the start?"))
        now = engine.answer(Question("is there a cat now?"))
    assert past.looked_up.startswith("last cat: clip 1") and past.source == "clip log"  # whatever the cache holds
    assert past.answer == "yes, last seen in clip 1 (0:00-0:04)" and past.recalled == []
    assert now.recalled == [] and now.answer.startswith("no")
    if policy == "inf_mllm+recall":
        assert [c["clip"] for c in start.recalled] == [1] and "cat" in start.answer
    else:
        assert start.recalled == [] and "cat" not in start.answer


COUNTED = [{"clip": 1, "start": 0.0, "end": 4.0, "seen": "person, car", "objects": {"person": 2, "car": 1}},
           {"clip": 2, "start": 4.0, "end": 8.0, "seen": "person, bicycle", "objects": {"person": 1, "bicycle": 1}},
           {"clip": 3, "start": 8.0, "end": 12.0, "seen": "suit (person)", "objects": {}}]


@pytest.mark.parametrize("text, log, answer", [
    ("how many people are there?", COUNTED[:2], "1 person"),  # the newest clip's detections
    ("how many people are there now?", COUNTED[:1], "2 people"),
    ("how many cars are there?", COUNTED[:2], "none"),  # counted, and its words hold no car either
    ("how many people were there at the start?", COUNTED, "2 people"),
    ("how many bicycles did you see?", COUNTED, "1 bicycle"),
    ("how many people did you see?", COUNTED, "2 people"),  # the most any clip counted, not the last clip's 1
    ("how many people did you see in the last five seconds?", COUNTED, "1 person"),  # clips 2-3 only
    ("how many dogs did you see?", COUNTED, "none"),  # counted nowhere, named nowhere
    ("how many people are there?", COUNTED, "at least 1 (person named, none counted)"),  # the classifier's person
    ("how many people are there?", COUNTED[:2] + [COUNTED[2] | {"boxes": [{"word": "person"}, {"word": "car"}]}],
     "1 person"),  # the vote kept none, but the clip names one and its last frame boxes one
    ("how many rockets are there?", COUNTED[:2], None),  # not a thing the detector counts
    ("how many times did you see a person?", COUNTED, "once"),  # how often, not how many: one run of clips
])
def test_how_many_is_read_off_the_detections(text, log, answer):
    intent = read(text)
    assert log_answer(intent, resolve(intent, log, log[-1]["end"])) == answer


def test_how_many_names_the_frame_it_was_counted_in():
    log = [dict(m) for m in COUNTED[:2]]
    log[1]["counted_at"] = {"person": 6.0, "bicycle": 7.0}
    intent = read("how many people are there?")
    assert resolve(intent, log, 8.0).why == "the present: clip 2's detections; 1 person in the frame at 0:06"
    intent = read("how many people were there at the start?")  # clip 1 keeps no frame times: the clip alone
    assert resolve(intent, log, 8.0).why == "the start: clip 1 (0:00-0:04)"


def test_a_log_without_detections_leaves_how_many_to_the_model():
    intent = read("how many people are there?")
    assert intent.kind == "number"
    assert log_answer(intent, resolve(intent, LOG, NOW)) is None  # tiny-vlm's words, no detector: no count


def test_the_counted_words_are_the_detectors():
    from models.detector import WORDS
    from models.intent import counted
    from models.tiny_vlm.labels import OBJECTS

    single = {w for w in OBJECTS if " " not in w} | {"person"}
    assert set(WORDS.values()) - {"computer mouse"} <= counted() and single == counted()
