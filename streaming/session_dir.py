"""A session folder, so a stream survives a crash or a restart (`stream-qa --session DIR`, `--resume DIR`).

DIR/session.json holds the settings the session was started with (source, model, policy, budget,
sampling), written once; DIR/store/ is the span store (every clip turn, written through as it
arrives); DIR/transcript.jsonl gets one JSON line per answer, flushed at once, so a `kill -9` loses
nothing already answered. Resuming reopens the store (files whose checksum fails are dropped),
rebuilds the cache from its newest turns, and continues the video after the last stored clip:
questions about clips from before the restart are answered by recall.
"""

import json
import os
from pathlib import Path

from .errors import ConfigError

SETTINGS, TRANSCRIPT, STORE = "session.json", "transcript.jsonl", "store"


class SessionDir:
    def __init__(self, path: str | Path, resume: bool):
        self.path = Path(path)
        settings = self.path / SETTINGS
        if resume and not settings.exists():
            raise ConfigError(f"--resume {path}: no session there (no {SETTINGS}); start one with --session")
        if not resume and settings.exists():
            raise ConfigError(f"--session {path}: a session is already there; continue it with --resume {path}")
        try:
            (self.path / STORE).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--session {path}: cannot create the folder ({err.strerror})") from err
        self._transcript = None

    @property
    def store_path(self) -> Path:
        return self.path / STORE

    def settings(self) -> dict:
        try:
            return json.loads((self.path / SETTINGS).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"--resume {self.path}: {SETTINGS} cannot be read ({err})") from err

    def save_settings(self, settings: dict) -> None:
        tmp = self.path / (SETTINGS + ".tmp")
        tmp.write_text(json.dumps(settings, indent=1))
        os.replace(tmp, self.path / SETTINGS)

    def resume_point(self, store) -> tuple[int, float]:
        """(clips already in the store, video time they cover): where the stream goes on."""
        clips = [span.meta for span in store.spans.values() if "clip" in span.meta]
        if not clips:
            return 0, 0.0
        last = max(clips, key=lambda m: m["clip"])
        return int(last["clip"]), float(last.get("end", last.get("start", 0.0)))

    def answered(self) -> list[dict]:
        """The answers already in the transcript (a line cut short by a kill is skipped)."""
        path = self.path / TRANSCRIPT
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def write_answer(self, row: dict) -> None:
        if self._transcript is None:
            self._transcript = open(self.path / TRANSCRIPT, "a", encoding="utf-8")
        self._transcript.write(json.dumps(row) + "\n")
        self._transcript.flush()

    def close(self) -> None:
        if self._transcript is not None:
            self._transcript.close()
