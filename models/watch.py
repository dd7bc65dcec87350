"""A watch: a standing condition in plain words ("a person", "more than 2 people", "the car leaves", "a bicycle and a
person"), judged on each clip from its clip-log entry.

A camera user does not ask "is there a person now?" every few seconds; they say once "tell me when a person is at the
door" and expect to hear when it happens. `read_watch` turns such a sentence into a `Watch` with the words the
question reader uses (`intent.read`: "people" is the detector's "person", "bike" its "bicycle"), a count ("more than
2", "at least 3", "two cars") and a direction (a thing that appears, or one that leaves). `judge` says whether one
clip's entry holds it, from the detector's counts (`words.tally`: the clip's vote, or its last frame's boxes where
the clip's words name the thing), with the evidence an alert shows: each word's count and the frame it was counted
in. No model call: a clip that went in is judged in microseconds. A sentence naming nothing the detector counts ("is
the door open?", "someone lying on the floor") is a watch only the model can judge (`Watch.judged_by` "model"): its
yes/no question (`Watch.question`) is asked of the model after each clip, a side question that leaves the cache with
its answer (`streaming/engine.py`), and the answer is the evidence.

Here in `models/`, beside the question reader, so every front end reads a watch the same way; the state of a watch
over time (rising edge, re-arming, `once`) is the stream's (`streaming/watches.py`).
"""

import re
import unicodedata
from dataclasses import dataclass

from .intent import _SAME, clock, read
from .words import counted, singular, tally

MAX_CHARS = 200  # a watch is a sentence, not a document
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
            "ten": 10}
_N = r"(\d+|" + "|".join(_NUMBERS) + ")"
# "more than 2 people", "at least three cars", "2 or more people", "over 5 cars": (pattern, how to make the minimum)
_AT_LEAST = [(rf"\b(?:more than|over|above) {_N}\b", 1), (rf"\b(?:at least|no fewer than|no less than) {_N}\b", 0),
             (rf"\b{_N} or more\b", 0)]
_FEWER = rf"\b(?:fewer than|less than|under) {_N}\b"
_LEAVES = re.compile(r"\b(?:leaves?|left|leaving|gone|goes away|went away|disappears?|disappeared|no longer|"
                     r"drives? (?:off|away)|walks? (?:off|away))\b")
_LEAD = re.compile(r"^(?:(?:please )?(?:tell|alert|notify|warn|ping|let) (?:me|us)(?: know)?\s*)?(?:when|if|once|"
                   r"whenever)?\s*")
_ASKS = re.compile(r"(?:is|are|was|were|does|do|did|has|have|can|could|will|would|should)\b")
# words of the sentence, not of what is watched (a place is where the camera looks)
_CALL = frozenset("""tell alert notify warn ping let know whenever once arrives arrive enters enter comes come walks
    drives pulls parks stops shows and or both together with into onto inside outside near front room door street
    yard driveway garage frame camera view""".split())


@dataclass(frozen=True)
class Watch:
    text: str  # as the user wrote it, less its "@once"
    things: tuple[str, ...]  # the detector's words it needs, all at once ("bicycle", "person")
    at_least: int = 1  # how many of the first thing ("more than 2 people": 3)
    fewer_than: int | None = None  # "fewer than 3 cars": at most 2 of the first thing
    leaves: bool = False  # "the car leaves": true once every thing was seen and then none is
    once: bool = False  # ends when it fires the first time
    unjudged: tuple[str, ...] = ()  # words beside its things that no detector judges ("lying", "floor"): the model's

    @property
    def question(self) -> str:
        """The yes/no question a model-judged watch asks after each clip: the sentence itself when it is one ("is the
        door open?"), a statement turned round ("tell me when the door is open" → "is the door open?"), else "is there
        …?"."""
        text = _LEAD.sub("", self.text.lower()).rstrip(" ?.!")
        if _ASKS.match(text):
            return text + "?"
        if m := re.match(r"(.+?)\s+(is|are)\s+(.+)", text):
            return f"{m[2]} {m[1]} {m[3]}?"
        return f"is there {text}?"

    @property
    def judged_by(self) -> str:
        """"detector" when the detector's counts decide it; "model" when only a model can ("is the door open?");
        "detector+model" when it names things and more ("a person lying on the floor"): the model is asked only on a
        clip whose counts hold the things, and its yes confirms them (a detector's find, verified)."""
        return ("detector+model" if self.unjudged else "detector") if self.things else "model"

    def describe(self) -> str:
        """What is watched, in the detector's words: "≥3 person", "bicycle + person", "car leaves"."""
        first = (f"≥{self.at_least} " if self.at_least > 1 else "") + (
            f"<{self.fewer_than} " if self.fewer_than is not None else "") + self.things[0] if self.things else ""
        said = " + ".join((first, *self.things[1:])) if self.things else self.text
        return said + (" leaves" if self.leaves else "")


def read_watch(text: str) -> Watch:
    """The watch a sentence asks for ("a person @once": fires once); ValueError for an empty or overlong one, or one
    holding control characters."""
    if any(unicodedata.category(c) == "Cc" and c not in "\t\n\r" for c in str(text)):
        raise ValueError("a watch is words: it cannot hold control characters")
    text = " ".join(str(text).split())
    once = bool(re.search(r"\s*@once$", text, re.IGNORECASE))
    text = re.sub(r"\s*@once$", "", text, flags=re.IGNORECASE)
    if not text:
        raise ValueError("a watch needs words: what to watch for, e.g. \"a person\" or \"more than 2 cars\"")
    if len(text) > MAX_CHARS:
        raise ValueError(f"a watch is at most {MAX_CHARS} characters (got {len(text)})")
    low = _LEAD.sub("", " ".join(re.sub(r"[^\w\s'-]", " ", text.lower()).split()))
    at_least, fewer = 1, None
    for pattern, more in _AT_LEAST:
        if m := re.search(pattern, low):
            at_least, low = _number(m.group(1)) + more, low[: m.start()] + " " + low[m.end():]
            break
    else:
        if m := re.search(_FEWER, low):
            fewer, low = _number(m.group(1)), low[: m.start()] + " " + low[m.end():]
        elif m := re.search(rf"\b{_N}\b", low):  # "two cars": at least two
            at_least, low = max(1, _number(m.group(1))), low[: m.start()] + " " + low[m.end():]
    leaves = bool(_LEAVES.search(low))
    words = [w for w in read(_LEAVES.sub(" ", low)).things if w not in _CALL]
    things, unjudged = [], []
    for word in reversed(words):  # the reader lists the last noun first; a watch's first thing is its first noun
        name = next((w for w in (_SAME.get(word, word), *singular(_SAME.get(word, word))) if w in counted()), None)
        (things if name else unjudged).append(name or word)
    # a thing leaving is the detector's alone; without things, the model's question says which way it goes
    return Watch(text, tuple(dict.fromkeys(things)), at_least, fewer, leaves and bool(things), once,
                 tuple(unjudged) if things and not leaves else ())


def _number(word: str) -> int:
    return _NUMBERS[word] if word in _NUMBERS else int(word)


def judge(watch: Watch, meta: dict, said: str | None = None) -> tuple[bool, dict]:
    """Whether the clip (its clip-log entry) shows what `watch` names, and the evidence: each thing's count in the
    clip and the video time of the frame it was counted in (`counted_at`, where the clip log has it). For a watch on
    something leaving, "shows" means every thing is there (the stream's watcher fires when that ends). A watch the
    model judges holds when the model `said` yes to its question after the clip."""
    if not watch.things:
        return _said_yes(watch, said)
    counts = {w: tally(meta, w) for w in watch.things}
    first = counts[watch.things[0]]
    enough = first < watch.fewer_than if watch.fewer_than is not None else first >= watch.at_least
    holds = enough and all(counts[w] for w in watch.things[1:])
    at = meta.get("counted_at", {})
    evidence = {w: {"count": n, **({"frame_t": at[w]} if w in at else {})} for w, n in counts.items()}
    if holds and watch.unjudged:
        confirmed, asked = _said_yes(watch, said)
        return confirmed, evidence | asked
    return holds, evidence


def asks_model(watch: Watch, meta: dict) -> bool:
    """Whether judging the clip takes the model's answer to `watch.question`: always for a watch only the model
    judges, and for one the model confirms, when the clip's counts hold its things."""
    return watch.judged_by == "model" or (watch.judged_by == "detector+model" and judge(watch, meta, "yes")[0])


def _said_yes(watch: Watch, said: str | None) -> tuple[bool, dict]:
    said = (said or "").strip().lower()
    return said.startswith("yes"), {"model": {"asked": watch.question, "answer": said}}


def description(watch: Watch, evidence: dict) -> str:
    """The alert's one line: "2 people", "a car and a person", "no car any more", "yes: is the door open?"."""
    if watch.judged_by == "model":
        return f"{evidence['model']['answer']}: {evidence['model']['asked']}"
    if watch.leaves:
        return "no " + " or ".join(watch.things) + " any more"
    said = " and ".join(_amount(w, e["count"]) for w, e in evidence.items() if w != "model")
    return said + (f", and the model says {evidence['model']['answer']}: {evidence['model']['asked']}"
                   if "model" in evidence else "")


def provenance(meta: dict, evidence: dict, leaves: bool = False) -> str:
    """Where the alert's facts come from: "clip 3's detections: 2 people in the frame at 0:11", "the model's answer
    after clip 3"."""
    if set(evidence) == {"model"}:
        return f"the model's answer after clip {meta['clip']}"
    said = [f"{_amount(w, e['count'])}" + (f" in the frame at {clock(e['frame_t'])}" if "frame_t" in e else "")
            for w, e in evidence.items() if w != "model"]
    return f"clip {meta['clip']}'s detections" + (": " + ", ".join(said) if said and not leaves else
                                                  ": none counted" if leaves else "") + (
        ", confirmed by the model's answer" if "model" in evidence else "")


def _amount(word: str, n: int) -> str:
    if n == 1:
        return f"a {word}" if word[0] not in "aeiou" else f"an {word}"
    return f"{n} {'people' if word == 'person' else word + 's'}"
