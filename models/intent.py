"""What a question in plain words asks about, and which clips answer it.

People ask "did you see a cat?", "is there a car now?", "what was on screen at the start?", "when did
the rocket appear?", "what did you see just before the horse?"; they do not name clips. `read` turns a
question into an `Intent`: its kind (yes/no, what, when, how many), the things it is about, and where
in time it looks (now, any time so far, the first or last time, the start, N minutes ago, just before
or after a thing, or a clip or time it names). `resolve` then picks the clips that answer it from the
log of every clip's meta ({clip, start, end, seen}: `seen` holds the words the adapter's perception
wrote into the clip's turn), by words against words, without the model: the latest clip that saw the
thing, the clip a minute back, the first clip. Recall links the picked clips that have left the cache
and nothing else (`linking`), so a question about the present links nothing; an adapter may phrase
the question the way its model was trained to read it (`VideoAdapter.phrase`). When and how often, "yes" to
"did you see X?" where a clip's words hold X, what the stream showed so far ("what did you see?") and how many of a
thing the detector counted are facts of the clip log, answered from it (`log_answer`), so an answer never contradicts
the clip its provenance names. "How many … did you see / so far / in the last minute?" is the most any one clip of
that span counted: each clip is a moment, and the same two cars seen in two clips are not four.

It lives in `models/`, below every front end, so each caller reads a question the same way: the engine
(`stream-qa`, the app, the server) and the library's `VideoAdapter.ask` on a session with recall
(`VideoAdapter.read_question`).
"""

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .words import counted, sees, singular, tally

_NUM = r"(\d+(?:\.\d+)?)"
_TIME = re.compile(rf"^(?:(\d+):)?(?:(\d+):)?{_NUM}$|^(?:{_NUM}h)?(?:{_NUM}m)?(?:{_NUM}s)?$")
_CLIP_REF = re.compile(r"\bclips?\s+#?(\d+)\b", re.IGNORECASE)
_TIME_REF = re.compile(r"\b(?:at|around)\s+(\d+:\d{2}(?::\d{2})?|\d+(?:\.\d+)?\s*s\b|\d+m(?:\d+s)?)", re.IGNORECASE)


def seconds(text: str) -> float:
    """Seconds from "90", "90s", "1m30s", "1h", "1:30" or "1:02:03" (ValueError otherwise)."""
    text = text.strip()
    m = _TIME.match(text)
    if not text or not m or not any(m.groups()):
        raise ValueError(f"cannot read {text!r} as a video time (use e.g. 30s, 1m30s, 1:30)")
    a, b, c, h, mi, s = m.groups()
    if c is not None:  # clock form: [[h:]m:]s
        parts = [float(x) for x in (a, b, c) if x is not None]
        return sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
    return float(h or 0) * 3600 + float(mi or 0) * 60 + float(s or 0)


def references(text: str):
    """What a question names of the past — "clip 137", "at 2:30", "at 45s" — as a predicate on a
    stored turn's meta ({clip, start, end}), or None when it names nothing (`read` then reads
    the question's words)."""
    clips = {int(n) for n in _CLIP_REF.findall(text)}
    times = []
    for t in _TIME_REF.findall(text):
        with contextlib.suppress(ValueError):  # not a time after all: nothing named
            times.append(seconds(t.replace(" ", "")))
    if not clips and not times:
        return None
    return lambda meta: meta.get("clip") in clips or any(
        meta.get("start", -1) <= t < meta.get("end", -1) for t in times)


KINDS = ("is", "what", "when", "count", "number", "other")  # count: how often; number: how many things
WHENS = ("now", "past", "first", "last", "start", "ago", "within", "before", "after", "named", "all")

_UNITS = {"second": 1, "sec": 1, "minute": 60, "min": 60, "hour": 3600}
_NUMBER_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10, "few": 3,
                 "half": 0.5, "couple": 2}
_TIME_PHRASES = [  # (when, pattern): the first that matches decides; its words are not things
    ("start", r"\b(?:at|in|from) the (?:very )?(?:start|beginning)(?: of the (?:video|stream))?\b|\bat first\b"
              r"|\bfirst (?:clip|scene|thing)\b"),
    ("ago", r"\b(?:(an?|one|two|three|four|five|ten|few|half|couple|\d+(?:\.\d+)?)\s+(?:of\s+)?)?"
            r"(?:an?\s+)?(second|sec|minute|min|hour)s?\s+ago\b"),
    ("within", r"\b(?:in|during|within|over) the (?:last|past)\s+(?:(an?|one|two|three|four|five|ten|few|half|couple"
               r"|\d+(?:\.\d+)?)\s+(?:of\s+)?)?(?:an?\s+)?(second|sec|minute|min|hour)s?\b"),
    ("before", r"\b(?:just |right |shortly |immediately )?before (?:the |a |an |you saw (?:the |a |an )?)?([a-z-]+)"),
    ("after", r"\b(?:just |right |shortly |immediately )?after (?:the |a |an |you saw (?:the |a |an )?)?([a-z-]+)"),
    ("last", r"\b(?:the )?last time\b|\blast (?:see|saw|seen)\b|\bmost recently\b|\blatest\b"),
    ("first", r"\b(?:the )?first time\b|\bfirst (?:see|saw|seen)\b|\bappear(?:ed|s)?\b|\bshow(?:ed|n)? up\b"),
    ("now", r"\bright now\b|\bnow\b|\bcurrently\b|\bat the moment\b|\bat present\b"),
]
# the stream so far, nothing in particular: "what did you see?", "what happened so far?", "summarize the video"
_SO_FAR = re.compile(r"\bso far\b|\bhappened\b|\bsummar(?:y|ise|ize)\b|\b(?:did|have) you (?:see|seen|watch|watched)\b")
# a clip or time named before the question proper ("in clip 3, …", "at 0:21, …"): the kind is read after it
_LEAD = re.compile(r"^(?:in|at|around|during|for) "
                   r"(?:clips? #?\d+|\d+:\d{2}(?::\d{2})?|\d+(?:\.\d+)?\s*s|\d+m(?:\d+s)?) ")
_PAST = re.compile(r"\b(?:did|was|were|saw|seen|had|earlier|ever|so far|previously|already|before|been)\b")
_STOP = frozenset("""
a an the any some this that these those it its there here is are was were be been being did do does done have
has had can could would will shall should may might i you we me us your my our what which who whom whose when
where why how many much often times time ever so far now right currently moment present earlier previously
already just again else also see seen saw seeing look looked notice noticed spot spotted show shown showed
appear appeared appears up on in at of to from for with by about during video stream screen clip clips scene
thing things anything something everything nothing visible tell please last first start beginning end still
next go goes went gone going pass passed passing come came by around near other any kind sort there's
happen happened happening summary summarize summarise watch watched whole all until give me
""".split())
# the word a clip's labels use for what people call otherwise ("people" are a "person" there)
_SAME = {"people": "person", "man": "person", "men": "person", "woman": "person", "women": "person",
         "someone": "person", "somebody": "person", "anyone": "person", "anybody": "person", "guy": "person",
         "bike": "bicycle", "bikes": "bicycle", "cyclist": "bicycle", "kitten": "cat", "kitty": "cat",
         "puppy": "dog", "automobile": "car", "motorbike": "motorcycle", "mug": "cup", "bunny": "rabbit"}


@dataclass(frozen=True)
class Intent:
    text: str
    kind: str  # KINDS: "is" (yes/no), "what", "when", "count" (how often), "number" (how many), "other"
    when: str  # WHENS: where in time the question looks
    things: tuple[str, ...] = ()  # the words it asks about, in its own order ("cat")
    core: str = ""  # the question without its time phrase ("what did you see?")
    ago_s: float = 0.0  # "ago": how far back
    anchor: str | None = None  # "before"/"after": the thing the time is relative to
    named: Callable[[dict], bool] | None = field(default=None, compare=False)  # "named": clips or times it names


@dataclass
class Resolution:
    targets: list[dict]  # metas of the clips that answer the question, in time order (empty: the present)
    focus: dict | None  # the clip the answer is about; None: the latest, as a plain question asks
    why: str  # one line for the user: what was looked up and found
    hits: list[dict] = field(default_factory=list)  # every clip that saw the thing (counts, first/last)
    decided: bool = True  # False: the question needs words the clips do not carry (recall ranks by keys)
    latest: dict | None = None  # the newest clip: what "how many … now?" counts in


def read(text: str) -> Intent:
    """The intent of one question (any text: one that says nothing of time or things reads as the present)."""
    low = " ".join(re.sub(r"[^\w\s:'-]", " ", text.lower()).split())
    asked = _LEAD.sub("", low)  # "in clip 3, what is it?" asks what, as "what is in clip 3?" does
    kind = ("count" if re.match(r"how (?:many times|often)\b", asked) else
            "number" if re.match(r"how many\b", asked) else
            "when" if re.match(r"(?:and )?when\b", asked) else
            "what" if re.match(r"what(?:'s)?\b(?! (?:animal|vehicle|food|colou?r|shape|kind)\b)", asked) else
            "is" if re.match(r"(?:is|are|was|were|did|do|does|have|has|can|could)\b", asked) else "other")
    when, ago_s, anchor, rest = None, 0.0, None, low
    named = references(text)
    if named is not None:
        when = "named"
    else:
        for name, pattern in _TIME_PHRASES:
            m = re.search(pattern, low)
            if not m:
                continue
            when = name
            if name in ("ago", "within"):
                count = m.group(1) or "a"
                ago_s = (_NUMBER_WORDS[count] if count in _NUMBER_WORDS else float(count)) * _UNITS[m.group(2)]
            if name in ("before", "after"):
                anchor = m.group(1)
            rest = (low[: m.start()] + " " + low[m.end():]).strip()
            break
    if when is None:
        when = "past" if _PAST.search(low) or kind in ("when", "count") else "now"
    if when == "first" and kind == "is" and not _PAST.search(low):
        when = "past"
    words = [_SAME.get(w, w) for w in re.findall(r"[a-z][a-z-]*", rest) if w not in _STOP and len(w) > 1]
    things = tuple(reversed(words))  # the last noun is most often the thing ("is there a man in a suit")
    if not things and when in ("past", "now") and _SO_FAR.search(low):
        when = "all"
    core = " ".join(re.sub(r"\s+", " ", rest).split()).rstrip(" ?") + "?" if rest != low else text.strip()
    return Intent(text, kind, when, things, core, ago_s, anchor, named)


def _runs(hits: list[dict]) -> list[list[dict]]:
    """Hits grouped into runs of consecutive clips: one sighting that lasts several clips counts once."""
    runs: list[list[dict]] = []
    for meta in hits:
        if runs and meta["clip"] == runs[-1][-1]["clip"] + 1:
            runs[-1].append(meta)
        else:
            runs.append([meta])
    return runs


def resolve(intent: Intent, log: list[dict], now: float) -> Resolution:
    """The clips that answer `intent`, from the clip log (metas in clip order) at video time `now`; for "how many",
    the frame the count was read in too ("1 person in the frame at 0:06")."""
    resolution = _resolve(intent, log, now)
    word, n, meta = _count(intent, resolution)
    if word and n and word in meta.get("counted_at", {}):
        return replace(resolution, why=f"{resolution.why}; {_many(word, n)} in the frame at "
                                       f"{clock(meta['counted_at'][word])}")
    if word and n and not meta["objects"].get(word):  # the vote dropped it: the boxes of the clip's last frame
        return replace(resolution, why=f"{resolution.why}; {_many(word, n)} boxed in its last frame")
    return resolution


def _resolve(intent: Intent, log: list[dict], now: float) -> Resolution:
    log = sorted(log, key=lambda m: m["clip"])
    if not log:
        return Resolution([], None, "no clip yet")
    thing = next((t for t in intent.things if any(sees(m, t) for m in log)), None)
    asked = thing or (intent.things[0] if intent.things else None)
    hits = [m for m in log if sees(m, thing)] if thing else []

    def one(meta: dict | None, why: str) -> Resolution:
        if meta is None:
            return Resolution([], None, why, hits)
        return Resolution([meta], None if meta is log[-1] else meta, f"{why}: {clip_span(meta)}", hits)

    if intent.when == "named":
        targets = [m for m in log if intent.named(m)]
        focus = targets[-1] if targets else None
        return Resolution(targets, None if focus is log[-1] else focus,
                          "named: " + ", ".join(clip_span(m)
                                                for m in targets) if targets else
                          "the clip or time named has not been seen", hits)
    if intent.when == "start":
        return one(log[0], "the start")
    if intent.when == "ago":
        t = max(0.0, now - intent.ago_s)
        return one(min(log, key=lambda m: 0 if m["start"] <= t < m["end"] else min(abs(m["start"] - t),
                                                                                  abs(m["end"] - t))),
                   f"{intent.ago_s:g} s ago")
    if intent.when != "now" and not any(m.get("seen") for m in log):
        return Resolution([], None, "no words for what the clips show: matched by keys", decided=False)
    if intent.when == "all":  # answered from every clip's words (`log_answer`): nothing to link
        return Resolution([], None, f"the stream so far: {len(log)} clip(s), {clock(log[0]['start'])}-"
                          f"{clock(log[-1]['end'])}", log)
    if intent.when in ("before", "after"):
        marks = [m for m in log if sees(m, intent.anchor)]
        if not marks:
            return one(None, f"no {intent.anchor} seen")
        run = _runs(marks)[-1]
        edge = run[0]["clip"] - 1 if intent.when == "before" else run[-1]["clip"] + 1
        return one(next((m for m in log if m["clip"] == edge), None), f"{intent.when} the {intent.anchor}")
    most = _most(intent, log, now) if intent.kind == "number" and intent.when in ("past", "within") else None
    if most is not None:
        return replace(most, hits=hits)
    if intent.when == "within":
        hits = [m for m in hits if m["end"] > now - intent.ago_s]
        if not hits:
            return one(None, f"no {asked} in the last {intent.ago_s:g} s")
    if intent.kind == "number" and intent.when == "now" and "objects" in log[-1]:
        return Resolution([], None, f"the present: clip {log[-1]['clip']}'s detections", hits, latest=log[-1])
    if intent.when == "now" or asked is None:
        return Resolution([], None, "the present: nothing looked up", hits)
    if not hits:
        return Resolution([], None, f"no {asked} seen in {len(log)} clip(s)", hits)
    if intent.kind == "count":
        return Resolution([], None, f"{asked}: seen in {len(hits)} clip(s)", hits)
    first = intent.when == "first" or (intent.kind == "when" and intent.when != "last")
    return one(hits[0] if first else hits[-1], f"{'first' if first else 'last'} {asked}")


def _most(intent: Intent, log: list[dict], now: float) -> Resolution | None:
    """"How many … did you see / so far / in the last minute?": the clip of the span that counted the most (the
    latest of equals), since each clip is a moment, not a census; None where nothing in the span was counted."""
    span = [m for m in log if "objects" in m and (intent.when == "past" or m["end"] > now - intent.ago_s)]
    word = _counted_word(intent)
    if not word or not span:
        return None
    best = max(span, key=lambda m: (tally(m, word), sees(m, word), m["clip"]))
    if not tally(best, word) and not sees(best, word):
        return Resolution([], None, f"no {word} counted in {len(span)} clip(s)", latest=best)
    return Resolution([best], None if best is log[-1] else best, f"the most {_plural(word)} in one of {len(span)} "
                      f"clip(s): {clip_span(best)}")


def linking(resolution: Resolution) -> Callable[[dict], bool] | None:
    """What recall links for a resolved question: exactly the clips it resolved to (nothing for the present), or
    None when the clips carry no words to resolve by (recall then ranks the stored clips by the question's keys)."""
    if not resolution.decided:
        return None
    ids = {m["clip"] for m in resolution.targets}
    return lambda meta: meta.get("clip") in ids


def log_answer(intent: Intent, resolution: Resolution) -> str | None:
    """The answer the clip log holds (None: the model answers): when and how often a thing was seen; "yes" to "did
    you see …?" when a clip's words hold every thing asked about (a "no" is not the log's to give: perception may
    have missed it); what the stream showed so far."""
    if intent.when == "all":
        return summary(resolution.hits)
    if intent.kind == "number":
        return number(intent, resolution)
    if intent.kind == "is" and intent.when in ("past", "first", "last", "within") and intent.things:
        hits = [m for m in resolution.hits if all(sees(m, t) for t in intent.things)]
        if hits:
            which = "first" if intent.when == "first" else "last"
            meta = hits[0] if which == "first" else hits[-1]
            # the clip's span, not its start: a thing last seen in 0:05-0:08 was still there after 0:05
            return f"yes, {which} seen in {clip_span(meta)}"
    if intent.when in ("now", "named", "start", "ago", "within", "before", "after") or not intent.things:
        return None
    if intent.kind == "count":
        n = len(_runs(resolution.hits))
        return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n} times")
    if intent.kind == "when":
        if not resolution.targets:
            return "never"
        meta = resolution.targets[0]
        if intent.when == "last":  # seen up to the clip's end: its start alone would date the last sight too early
            return f"last in {clip_span(meta)}"
        return f"at {clock(meta['start'])} (clip {meta['clip']})"
    return None


def number(intent: Intent, resolution: Resolution) -> str | None:
    """How many of a thing the detector counted in the clip a question looks at (the newest for "now"), when the
    thing is one it names (`counted`); None otherwise (the model answers: tiny-vlm cannot count)."""
    word, n, meta = _count(intent, resolution)
    if word is None:
        return None
    if not n:  # none counted: "none", unless the clip's other words name one (the classifier's)
        return f"at least 1 ({word} named, none counted)" if sees(meta, word) else "none"
    return _many(word, n)


def _many(word: str, n: int) -> str:
    return f"{n} {word if n == 1 else _plural(word)}"


def _plural(word: str) -> str:
    return "people" if word == "person" else word + "s"


def _count(intent: Intent, resolution: Resolution) -> tuple[str | None, int, dict | None]:
    """(the counted word asked about, the detector's count of it, the clip counted in) for a "how many" question
    about a clip with detections; (None, 0, None) otherwise."""
    meta = resolution.targets[-1] if resolution.targets else resolution.latest
    word = _counted_word(intent)
    if intent.kind != "number" or meta is None or "objects" not in meta or word is None:
        return None, 0, None
    return word, tally(meta, word), meta


def _counted_word(intent: Intent) -> str | None:
    """The first thing a question asks about that the detector counts, in the detector's word ("people" → person)."""
    return next((w for thing in intent.things for w in singular(thing) if w in counted()), None)


def summary(log: list[dict], most: int = 8) -> str:
    """What the stream showed so far, from its clips' words: each thing at the time it was first seen, in order
    ("0:00 cat; 0:04 person, bicycle; … (25 clips, 0:00-1:40)"); a label's category stands for it ("Egyptian Mau
    (cat)" → cat)."""
    first: dict[str, dict] = {}
    for meta in log:
        for item in meta.get("seen", "").split(","):
            item = item.strip().lower()
            if item and item != "nothing recognised":
                kind = re.search(r"\(([^)]+)\)", item)
                first.setdefault(kind.group(1) if kind else item.split()[-1], meta)
    when: dict[float, list[str]] = {}  # start time → the things first seen then
    for thing, meta in first.items():
        when.setdefault(meta["start"], []).append(thing)
    parts = [f"{clock(start)} {', '.join(things)}" for start, things in when.items()]
    more = f"; and {len(parts) - most} more" if len(parts) > most else ""
    span = f"{len(log)} clip(s), {clock(log[0]['start'])}-{clock(log[-1]['end'])}" if log else "no clip yet"
    return ("; ".join(parts[:most]) or "nothing recognised") + more + f" ({span})"


def clip_span(meta: dict) -> str:
    """"clip 3 (0:05-0:08)": a clip as answers and provenance lines name it."""
    return f"clip {meta['clip']} ({clock(meta['start'])}-{clock(meta['end'])})"


def clock(seconds: float) -> str:
    """"1:05" or "1:02:03" for a video time."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
