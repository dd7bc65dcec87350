"""The watches of one stream: each one's state over the clips, and the alerts they fire.

A watch (`models/watch.py`) says whether one clip shows its condition; here that becomes an alert on the rising edge
(false → true), once per event: after firing, a watch re-arms only when its condition has been false for
`rearm_clips` clips in a row and `cooldown_s` of video has passed, so a person missed by the detector in one clip and
found in the next is not a second arrival. A watch on something leaving arms once the thing has been seen for
`rearm_clips` clips, and fires on the first clip without it. `@once` ends a watch when it fires.

An alert is a record (`alert_record`): a stable id (the session, the watch and the clip: a resumed session that judges
a clip again gives it the same id), the watch, the clip and its span, the wall time, the evidence (each thing's count
and the frame it was counted in), a one-line description and where it came from, and a JPEG of the clip's last frame
with the detector's boxes. `Watches.judge` writes it to the session folder (`alerts.jsonl`, fsynced) before any
front end hears of it; a resumed session replays its stored clips through the watches (`replay`), so each is in the
state it was in when the stream stopped and nothing fires twice for one event.
"""

import contextlib
import datetime
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from models.intent import clock
from models.watch import Watch, asks_model, description, judge, provenance, read_watch

REARM_CLIPS = 2  # clips in a row without the condition before a watch can fire again
COOLDOWN_S = 30.0  # video seconds after an alert before the same watch can fire again
MAX_WATCHES = 64  # on one stream: each is judged on every clip


@dataclass
class Watcher:
    """One watch's state on one stream."""

    watch: Watch
    index: int  # its id among the stream's watches, never reused (part of its alerts' ids)
    rearm_clips: int = REARM_CLIPS
    cooldown_s: float = COOLDOWN_S
    since: int = 0  # the clips the stream had seen when the watch was set: it judges those after them
    armed: bool = True
    calm: int = 0  # clips in a row without the condition, since the last alert (or, leaving, with the thing)
    fired_t: float | None = None  # the video time of its last alert
    done: bool = False  # an `@once` watch that fired
    alerts: int = 0
    holds: bool = False  # its condition, on the last clip judged (a thing leaving: gone since its alert)

    def __post_init__(self):
        self.armed = not self.watch.leaves  # a thing can only leave once it has been seen

    def step(self, meta: dict, said: str | None = None) -> dict | None:
        """The clip's evidence when the watch fires on it, else None; `said`: the model's answer to the watch's
        question after the clip, where judging it takes one (`asks_model`)."""
        holds, evidence = judge(self.watch, meta, said)
        signal = not holds if self.watch.leaves else holds
        self.holds = signal and (self.holds or not self.watch.leaves)  # a thing that left: from its alert on
        if not signal:
            self.calm += 1
            self.armed = self.armed or self.calm >= self.rearm_clips
            return None
        self.calm = 0
        cooled = self.fired_t is None or meta["start"] >= self.fired_t + self.cooldown_s
        if self.done or not self.armed or not cooled:
            return None
        self.armed, self.fired_t, self.done, self.alerts = False, meta["end"], self.watch.once, self.alerts + 1
        self.holds = True
        return evidence

    def fired(self, alert: dict) -> None:
        """An alert stored past the clips replayed (written just before a stop): the watch is as that alert left it."""
        self.armed, self.calm, self.fired_t, self.done = False, 0, float(alert["end"]), self.watch.once

    def as_dict(self) -> dict:
        """What a session folder keeps of the watch (`Watches.restore` makes it again) and the API shows."""
        return {"id": self.index, "text": self.watch.text + (" @once" if self.watch.once else ""),
                "watching": self.watch.describe(), "judged_by": self.watch.judged_by, "once": self.watch.once,
                "rearm_clips": self.rearm_clips, "cooldown_s": self.cooldown_s, "since": self.since,
                "alerts": self.alerts, "armed": self.armed and not self.done}


def watcher(text: str, index: int, rearm_clips: int = REARM_CLIPS, cooldown_s: float = COOLDOWN_S,
            since: int = 0) -> Watcher:
    """A watcher for a watch given in words; ValueError (one line) for one that cannot be watched."""
    return Watcher(read_watch(text), index, rearm_clips, cooldown_s, since)


def read_watches(texts, rearm_clips: int = REARM_CLIPS, cooldown_s: float = COOLDOWN_S) -> list[Watcher]:
    """The stream's watchers for the watches given in words (ValueError: the first that cannot be watched)."""
    texts = list(texts or [])
    if len(texts) > MAX_WATCHES:
        raise ValueError(f"at most {MAX_WATCHES} watches on a stream (got {len(texts)})")
    return [watcher(text, i, rearm_clips, cooldown_s) for i, text in enumerate(texts)]


def alert_id(session: str, watcher_: Watcher, clip: int) -> str:
    return hashlib.sha1(f"{session}\0{watcher_.index}\0{watcher_.watch.text}\0{clip}".encode()).hexdigest()[:16]


def alert_record(session: str, watcher_: Watcher, meta: dict, evidence: dict) -> dict:
    watch = watcher_.watch
    return {"id": alert_id(session, watcher_, meta["clip"]), "alert": watch.text, "watch_id": watcher_.index,
            "watch": watch.describe(), "session": session, "clip": meta["clip"], "start": meta["start"],
            "end": meta["end"], "video_t": meta["end"],
            "wall_time": datetime.datetime.now(datetime.timezone.utc).isoformat(), "evidence": evidence,
            "description": description(watch, evidence), "provenance": provenance(meta, evidence, watch.leaves),
            "snapshot": None, "snapshot_t": None}


class Watches:
    """A stream's watchers and where their alerts go: the session `folder` (a `SessionDir`: alerts.jsonl, the
    watches in watches.json, the snapshots in alerts/), or a `snapshots` folder of its own; with neither, alerts
    carry no snapshot. Watches are added and removed from other threads (the server's) while the model thread
    judges clips: one lock."""

    def __init__(self, watchers: list[Watcher], session: str, folder=None, snapshots: str | Path | None = None):
        self.watchers, self.session, self.folder = list(watchers), session, folder
        self.snapshots = Path(snapshots) if snapshots else (folder.alerts_path if folder is not None else None)
        self.alerts: list[dict] = []  # every alert, in order (a resumed session's stored ones first)
        self.clip = 0  # the newest clip judged
        self.changed: list[dict] = []  # the watches whose condition the newest clip changed (`WatchState`'s)
        self.lock = threading.Lock()
        self.no_model: str | None = None  # why this stream's model cannot be asked a watch's question (`refuse_model`)

    @classmethod
    def restore(cls, rows: list[dict], session: str, folder=None, snapshots=None) -> "Watches":
        """The watches a session folder kept (`Watcher.as_dict` rows); a row that no longer reads is skipped."""
        watchers = []
        for row in rows:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                watchers.append(watcher(row["text"], int(row["id"]), int(row["rearm_clips"]),
                                        float(row["cooldown_s"]), int(row.get("since", 0))))
        return cls(watchers, session, folder, snapshots)

    def add(self, text: str, rearm_clips: int = REARM_CLIPS, cooldown_s: float = COOLDOWN_S) -> Watcher:
        """A new watch, judged from the next clip on (ValueError: one that cannot be watched, or one too many)."""
        with self.lock:
            if len(self.watchers) >= MAX_WATCHES:
                raise ValueError(f"at most {MAX_WATCHES} watches on a stream; remove one first")
            added = watcher(text, max((w.index for w in self.watchers), default=-1) + 1, rearm_clips, cooldown_s,
                            self.clip)
            self._check(added)
            self.watchers.append(added)
            self.save()
            return added

    def refuse_model(self, why: str) -> None:
        """The stream cannot ask its model a watch's question (`why`, one line): a watch that needs the model is
        refused, now (ValueError for the first one it has) and when added."""
        self.no_model = why
        for watcher_ in self.watchers:
            self._check(watcher_)

    def _check(self, watcher_: Watcher) -> None:
        if self.no_model is not None and watcher_.watch.judged_by != "detector":
            raise ValueError(f"watch {watcher_.watch.text[:60]!r} needs the model's answer, and {self.no_model}")

    def remove(self, index: int) -> Watcher | None:
        with self.lock:
            gone = next((w for w in self.watchers if w.index == index), None)
            if gone is not None:
                self.watchers.remove(gone)
                self.save()
            return gone

    def listing(self) -> list[dict]:
        with self.lock:
            return [w.as_dict() for w in self.watchers]

    def save(self) -> None:
        """The watches into the session folder, so a resumed session continues them."""
        if self.folder is not None:
            self.folder.save_watches([w.as_dict() for w in self.watchers])

    def judge(self, meta: dict, clip=None, ask=None) -> list[dict]:
        """The alerts the clip (its clip-log entry, and the `ingest.Clip` whose frames the snapshots show) fires, each
        written to the session folder first. `ask(questions) -> answers` asks the model, all at once (they share
        forwards), the yes/no questions of the watches that need them (outside the lock: the server lists and adds
        watches meanwhile); a watch that needs one, judged without it, stays as it was."""
        with self.lock:
            asking = {w.index: w.watch.question for w in self.watchers if not w.done and asks_model(w.watch, meta)}
        said = dict(zip(asking, ask(list(asking.values())), strict=True)) if ask is not None and asking else {}
        fired, self.changed = [], []
        with self.lock:
            self.clip = max(self.clip, meta["clip"])
            for watcher_ in self.watchers:
                if watcher_.index not in said and asks_model(watcher_.watch, meta):
                    continue  # not asked (no model here, a failed question, or added since the questions went out)
                before = watcher_.holds
                evidence = watcher_.step(meta, said.get(watcher_.index))
                if watcher_.holds != before:
                    self.changed.append({"session": self.session, "watch_id": watcher_.index,
                                         "watch": watcher_.watch.text, "holds": watcher_.holds, "clip": meta["clip"],
                                         "video_t": meta["end"]})
                if evidence is None:
                    continue
                alert_ = alert_record(self.session, watcher_, meta, evidence)
                alert_["snapshot"], alert_["snapshot_t"] = self._snapshot(alert_["id"], clip, meta, evidence)
                if self.folder is not None:
                    self.folder.write_alert(alert_)
                fired.append(alert_)
            self.alerts += fired
        return fired

    def replay(self, clips: list[dict], stored: list[dict]) -> None:
        """A resumed session: the stored clips each watch had judged, judged again without alerting (a watch the model
        judges cannot be asked about a clip gone by: its stored alerts alone say how it stood); then the alerts stored
        past them."""
        with self.lock:
            for meta in clips:
                self.clip = max(self.clip, meta["clip"])
                for watcher_ in self.watchers:
                    if meta["clip"] > watcher_.since and watcher_.watch.judged_by == "detector":
                        watcher_.step(meta)
            self.alerts = list(stored) + self.alerts  # "when did the alert fire?" is answered across the restart
            by_id = {w.index: w for w in self.watchers}
            for alert_ in stored:
                watcher_ = by_id.get(alert_.get("watch_id"))
                past = alert_.get("clip", 0) > self.clip
                if watcher_ is not None and (past or watcher_.watch.judged_by != "detector"):
                    watcher_.fired(alert_)

    def _snapshot(self, name: str, clip, meta: dict, evidence: dict) -> tuple[str | None, float | None]:
        """The frame the evidence was counted in (the clip's last, for something that left), with that frame's boxes,
        as DIR/NAME.jpg, and its video time; (None, None) with nowhere to write or no frame."""
        if self.snapshots is None or clip is None or clip.frame is None:
            return None, None
        from inf_mllm import diskio

        from .snapshot import jpeg  # lazy: OpenCV

        t = next((e["frame_t"] for e in evidence.values() if "frame_t" in e), None)
        shown_t, frame = nearest(clip.shown, t) or (clip.last, clip.frame)
        boxes = (nearest(getattr(clip.encoded, "frame_boxes", ()), shown_t) or (None, meta.get("boxes", ())))[1]
        path = self.snapshots / f"{name}.jpg"
        try:
            diskio.make_folder(self.snapshots)
            diskio.write_atomic(path, jpeg(frame, boxes))
        except Exception:  # noqa: BLE001 (a disk fault, a frame OpenCV cannot encode: the alert goes out without it)
            return None, None
        return str(path), shown_t


def nearest(pairs, t: float | None):
    """The (time, value) of `pairs` nearest video time `t`; None for no time or no pairs."""
    return min(pairs, key=lambda pair: abs(pair[0] - t)) if t is not None and pairs else None


ABOUT_ALERTS = re.compile(r"\balert(?:s|ed)?\b|\bwhile i was (?:away|gone|out)\b|\bwhat did i miss\b", re.IGNORECASE)


def alert_answer(question: str, alerts: list[dict], most: int = 8) -> str | None:
    """A question about the alerts ("when did the alert fire?", "what happened while I was away?") answered off the
    alert log, newest last; None for any other question."""
    if not ABOUT_ALERTS.search(question):
        return None
    if not alerts:
        return "no alert so far"
    said = "; ".join(f"{clock(a['video_t'])} {a['alert']}: {a['description']} (clip {a['clip']})"
                     for a in alerts[-most:])
    more = f", the last {most}" if len(alerts) > most else ""
    return f"{len(alerts)} alert{'s' if len(alerts) > 1 else ''}{more}: {said}"


def alert_line(alert_: dict) -> str:
    """`stream-qa`'s line for an alert."""
    return (f"[{alert_['video_t']:7.1f}s] ALERT {alert_['alert']}: {alert_['description']}   "
            f"(clip {alert_['clip']}; {alert_['provenance']})")


def model_refusal(policy) -> str | None:
    """Why a stream on `policy` (a cache policy, or its class) cannot ask its model a watch's question; None when it
    can (the question and its answer leave the cache at the next turn: a policy evicting while decoding keeps them)."""
    if not policy.evict_while_decoding:
        return None
    return f"policy {policy.name} evicts while decoding: use one that evicts at turn boundaries"


def session_watches(name: str, texts=(), folder=None, through: int = 0, rearm_clips: int = REARM_CLIPS,
                    cooldown_s: float = COOLDOWN_S, snapshots=None) -> Watches:
    """A stream's watches, named `name` (its session folder's name, or its id: stable across a resume). A resumed
    folder's watches go on, its clips up to `through` (the last its store holds: the stream goes on after it) and its
    alerts replayed into them; a watch of `texts` they lack is added (ValueError: one that cannot be watched)."""
    resumed = folder is not None and folder.resume
    watches = Watches.restore(folder.watches() if resumed else [], str(name), folder, snapshots)
    if resumed:
        watches.replay([m for m in folder.clips() if m.get("clip", 0) <= through], folder.alerts())
    known = {w.watch.text + (" @once" if w.watch.once else "") for w in watches.watchers}
    for text in texts:
        if " ".join(text.split()) not in known:
            watches.add(text, rearm_clips, cooldown_s)
    return watches
