"""A session folder, so a stream survives a crash or a restart (`stream-qa --session DIR`, `--resume DIR`).

DIR/session.json holds the settings the session was started with (source, model, policy, budget,
sampling), written once; DIR/store/ is the span store (every clip turn, written through as it
arrives); DIR/transcript.jsonl gets one JSON line per answer, written and fsynced before the answer
is printed, so a crash loses nothing already answered; clips.jsonl the clip log; watches.json the
stream's watches, alerts.jsonl every alert they fired (fsynced before it is said) and alerts/ their
snapshots. Resuming reopens the store (files whose
checksum fails are dropped), rebuilds the cache from its newest turns, and continues the video after
the last stored clip: questions about clips from before the restart are answered by recall.

One writer at a time: opening takes DIR/lock (`inf_mllm.diskio.FolderLock`); a second stream-qa on the
same folder is refused in one line naming the holder's pid, and a lock left by a dead process is
taken over. Disk faults never stop the answers: a folder that cannot be written (read-only disk, no
permission, full) is resumed read-only, and a write that fails mid-run (ENOSPC, EROFS) costs what it
would have saved, with one warning saying what is no longer saved; the answers go on on stdout.
"""

import errno
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from inf_mllm import diskio

from .errors import ConfigError
from .questions import Question

SETTINGS, TRANSCRIPT, STORE, CLIPS = "session.json", "transcript.jsonl", "store", "clips.jsonl"
ALERTS, WATCHES = "alerts.jsonl", "watches.json"
_NUMBER, _TEXT = (int, float), (str,)
# what each setting must be when read back (a hand-edited "fps": "2" is refused before the model loads)
TYPES = {"video": _TEXT + (type(None),), "webcam": (int, type(None)), "url": _TEXT + (type(None),), "fps": _NUMBER,
         "clip_seconds": _NUMBER, "fast": (bool,), "loop": (int,), "model": (list,), "policy": _TEXT,
         "budget": _TEXT + (int,), "bias": _NUMBER + (type(None),), "window": (int, type(None)),
         "max_new_tokens": (int,), "device": _TEXT, "detect": (bool,)}


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


class SessionDir:
    def __init__(self, path: str | Path, resume: bool, warn: Callable[[str], None] = _warn):
        self.path, self.resume, self.warn = Path(path), resume, warn
        self.store = None  # the span store, once opened (`open_store`)
        option = "--resume" if resume else "--session"
        settings = self.path / SETTINGS
        if resume and not settings.exists():
            raise ConfigError(f"--resume {path}: no session there (no {SETTINGS}); start one with --session")
        if not resume and settings.exists():
            raise ConfigError(f"--session {path}: a session is already there; continue it with --resume {path}")
        self._transcript = diskio.AppendLog(self.path / TRANSCRIPT)
        self._clips = diskio.AppendLog(self.path / CLIPS)
        self._alerts = diskio.AppendLog(self.path / ALERTS)
        self._lock = diskio.FolderLock(self.path)
        self.saving = {"settings": not resume, "transcript": True, "clips": True, "alerts": True}
        try:
            diskio.make_folder(self.path)
            writable = self._lock.acquire()
        except diskio.FolderBusy as err:
            who = f"another stream-qa (pid {err.pid})" if err.pid else "another stream-qa"
            raise ConfigError(f"{option} {path}: {who} is writing this session; one writer at a time: wait for it "
                              f"to end or stop it") from None
        except OSError as err:
            writable, why = False, diskio.why(err)
            if not self.path.is_dir():
                self.warn(f"{option} {path}: cannot create the folder ({why}); nothing of this session is saved, "
                          f"the answers are still printed")
        else:
            why = self._lock.why
        if not writable:
            self.saving = dict.fromkeys(self.saving, False)
            if self.path.is_dir():
                self.warn(f"{option} {path}: the folder cannot be written ({why or 'read-only'}); running "
                          f"read-only: answers are printed, nothing new is saved")
        elif resume:
            self._mend_transcript()

    @property
    def store_path(self) -> Path:
        return self.path / STORE

    def open_store(self):
        """The span store in DIR/store/ (after the model loads: it brings torch). A folder already reported
        as not writable is not reported again by the store."""
        from inf_mllm.store import SpanStore  # lazy: the store brings torch; the folder opens before it loads

        if not self.path.exists():
            self.store = SpanStore()
            return self.store
        with warnings.catch_warnings():
            if not self.saving["transcript"]:  # said once already, when the folder was opened
                warnings.filterwarnings("ignore", message="span store: .*(cannot be written|cannot create)")
            self.store = SpanStore(self.store_path)
        return self.store

    def settings(self) -> dict:
        try:
            settings = json.loads((self.path / SETTINGS).read_bytes().decode("utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(f"--resume {self.path}: {SETTINGS} cannot be read ({err})") from err
        if not isinstance(settings, dict):
            raise ConfigError(f"--resume {self.path}: {SETTINGS} is not a JSON object of settings")
        for key, value in settings.items():
            kinds = TYPES.get(key)
            if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
                raise ConfigError(f"--resume {self.path}: {SETTINGS}: {key!r} cannot be {json.dumps(value)} "
                                  f"(edited by hand?); expected {' or '.join(k.__name__ for k in kinds)}")
        if not all(isinstance(m, str) for m in settings.get("model", [])):
            raise ConfigError(f"--resume {self.path}: {SETTINGS}: 'model' must be a list of strings")
        return {k: v for k, v in settings.items() if k in TYPES}

    def save_settings(self, settings: dict) -> None:
        if not self.saving["settings"]:
            return
        try:
            diskio.write_atomic(self.path / SETTINGS, json.dumps(settings, indent=1).encode())
        except OSError as err:
            self.saving["settings"] = False
            self.warn(f"--session {self.path}: {SETTINGS} cannot be written ({diskio.why(err)}); this session cannot "
                      f"be resumed, the answers are still printed")

    def resume_args(self, args, defaults: dict) -> None:
        """Complete `args` from the settings the session started with. An option the user gave that differs
        from them is refused rather than silently ignored (the store's clips were made with those settings)."""
        settings = self.settings()
        given = [k for k, v in settings.items() if getattr(args, k, None) not in (defaults.get(k), v)]
        if given:
            names = ", ".join(f"--{k.replace('_', '-')}" if k != "video" else "the video" for k in given)
            raise ConfigError(f"--resume {self.path} continues with the settings the session started with; {names} "
                              f"differ{'s' if len(given) == 1 else ''} from them: leave "
                              f"{'it' if len(given) == 1 else 'them'} out, or start a new --session")
        for key, value in settings.items():
            setattr(args, key, value)

    def pending(self, questions: list, resume_at: float) -> list:
        """The questions a resumed run asks: those timed before the resume point that the transcript does not hold
        yet are asked at once (answered from the stored clips), with one line saying so; those it holds are not
        asked twice."""
        done = {row.get("question") for row in self.answered()}
        late = [q for q in questions if q.at is not None and q.at < resume_at]
        asked = [q for q in late if q.text not in done]
        if asked:
            self.warn(f"{len(asked)} question(s) timed before the resume point ({resume_at:.1f} s of video) are asked "
                      f"now, from the stored clips")
        return [Question(q.text) for q in asked] + [q for q in questions if q not in late]

    def resume_into(self, session, questions: list) -> tuple[tuple[int, float], list, str]:
        """Rebuild `session` (its store opened from this folder) as the transcript left it: (the clip and video time
        it continues after, the questions still to ask, the line saying so)."""
        at = self.resume_point(session.store)
        restored = session.restore(self.exchanges())
        line = (f"resuming after clip {at[0]} ({at[1]:.1f} s of video): {len(session.store)} clips stored, the last "
                f"{len(restored)} back in the cache with the questions and answers between them, "
                f"{len(self.answered())} answers so far")
        return at, self.pending(questions, at[1]), line

    def resume_point(self, store) -> tuple[int, float]:
        """(clips already in the store, video time they cover): where the stream goes on."""
        clips = store.clips()
        if not clips:
            return 0, 0.0
        last = clips[-1]
        return int(last["clip"]), float(last.get("end", last.get("start", 0.0)))

    @property
    def alerts_path(self) -> Path:
        """Where the alerts' snapshots go."""
        return self.path / "alerts"

    def answered(self) -> list[dict]:
        """The answers already in the transcript (a line cut short by a crash is skipped)."""
        return self._rows(TRANSCRIPT)

    def clips(self) -> list[dict]:
        """The clip log as clips.jsonl holds it."""
        return self._rows(CLIPS)

    def alerts(self) -> list[dict]:
        """The alerts already fired (alerts.jsonl), in order."""
        return self._rows(ALERTS)

    def _rows(self, name: str) -> list[dict]:
        """The whole JSON lines of one of the folder's logs (a line cut short by a crash is skipped)."""
        path = self.path / name
        rows = []
        for line in path.read_bytes().split(b"\n") if path.exists() else []:
            try:
                rows.append(json.loads(line.decode("utf-8")))
            except ValueError:
                continue
        return rows

    def _mend_transcript(self) -> None:
        """A transcript whose last line a crash cut short is cut back to its last whole line, so the next
        answer starts on a line of its own."""
        path = self.path / TRANSCRIPT
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        if data and not data.endswith(b"\n"):
            try:
                diskio.truncate(path, data.rfind(b"\n") + 1)
            except OSError as err:
                self._stop("transcript", err)

    def exchanges(self) -> list[dict]:
        """The questions and answers as the cache took them, for `StreamSession.restore` to put back."""
        return [row["exchange"] for row in self.answered() if isinstance(row.get("exchange"), dict)]

    def write_answer(self, answer) -> None:
        """The answer's record and its exchange (`Answer.exchange`) as one JSON line, on disk before the answer is
        printed; a disk fault stops the saving, not the answers. The clips stored before the answer are on disk
        first (the store writes on a thread of its own)."""
        row = answer.as_dict() | ({"exchange": answer.exchange} if answer.exchange else {})
        if self.store is not None:
            self.store.flush()
        if not self.saving["transcript"]:
            return
        try:
            self._transcript.append((json.dumps(row) + "\n").encode())
        except OSError as err:
            self._stop("transcript", err)

    def watches(self) -> list[dict]:
        """The watches kept (`streaming.watches.Watcher.as_dict` rows); none when there are none or they cannot be
        read."""
        try:
            rows = json.loads((self.path / WATCHES).read_text())
        except (OSError, ValueError):
            return []
        return rows if isinstance(rows, list) else []

    def save_watches(self, rows: list[dict]) -> None:
        """The stream's watches, replaced whole (atomically) whenever they change."""
        if not self.saving["alerts"]:
            return
        try:
            diskio.write_atomic(self.path / WATCHES, json.dumps(rows, indent=1).encode())
        except OSError as err:
            self._stop("alerts", err)

    def write_alert(self, alert: dict) -> None:
        """An alert's record as one JSON line in alerts.jsonl, on disk before any front end hears of it."""
        self._append("alerts", self._alerts, alert)

    def write_clip(self, meta: dict) -> None:
        """A clip's log entry (times, words, the detector's objects and boxes) as one JSON line in clips.jsonl: what
        the clip log held, whatever the policy (with recall the span store keeps it too)."""
        self._append("clips", self._clips, meta)

    def _append(self, what: str, log, row: dict) -> None:
        if not self.saving[what]:
            return
        try:
            log.append((json.dumps(row) + "\n").encode())
        except OSError as err:
            self._stop(what, err)

    def _stop(self, what: str, err: OSError) -> None:
        """One warning for what stops being saved; a full disk stops both logs at once (one warning, not two)."""
        full = ("transcript", "clips") + (("alerts",) if self._alerts.fd is not None or what == "alerts" else ())
        logs = full if err.errno == errno.ENOSPC else (what,)  # alerts.jsonl: once one was written
        stopping = [log for log in logs if self.saving[log]]
        for log in stopping:
            self.saving[log] = False
        names = " and ".join({"transcript": TRANSCRIPT, "clips": CLIPS, "alerts": ALERTS}[log] for log in stopping)
        lost = ("answers from now on are printed but not saved" if "transcript" in stopping
                else "clips' detections from now on are not saved" if "clips" in stopping
                else "alerts from now on are printed but not saved")
        self.warn(f"session {self.path}: {names} cannot be written ({diskio.why(err)}); {lost}")

    def close(self, store=None) -> None:
        """Release the folder (and its store's lock) for the next writer."""
        self._transcript.close()
        self._clips.close()
        self._alerts.close()
        if store is not None:
            store.close()
        self._lock.release()
