"""An answer's provenance in a few words: what its question was read as asking for, what recall linked, and
whether the clip log answered it (the line `stream-qa`, the app and `--json` readers see beside an answer)."""


def notes(answer) -> str:
    """What an engine `Answer` looked up and linked, in a few words for the user ("last cat: clip 12 (0:44-0:48),
    recalled clip 12")."""
    linked = ", ".join(f"clip {c['clip']}" for c in answer.recalled)
    return answer.looked_up + (f"; recalled {linked}" if linked else "") + (
        "; read off the clip log" if answer.source != "model" else "")
