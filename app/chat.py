"""One browser tab's session: a hosted live session (streaming/hosted.py) with what the page keeps of it.

The engine's model thread answers questions at turn boundaries; the session hands each question's events to the page
event that asked it, keeps the memory series for the graph (sampled after every turn) and ends everything on
`close()`, called when the page leaves or the session idles out.
"""

from pathlib import Path

from streaming.hosted import HostedSession


class Chat(HostedSession):
    """A tab's session and the page's own state of it: where its transcript is written, whether the looping player's
    lap was said, which clip the detector's view last drew, which alerts were said and listed, which answer was last
    sent to the page."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transcript_path: Path | None = None
        self.lap_said = False
        self.drawn = False  # the clip last drawn (None: drawn with the boxes off; False: none yet)
        self.alerts_said = 0  # the alerts said in the chat so far
        self.listed: list[dict] = []  # the alerts in the page's list, in its order
        self.held_until = 0.0  # a picked alert's frame is shown in place of the newest clip's until then
        self.asking = 0  # questions whose page event has not yet sent its last update
        self.answer_shown: tuple[str, float] | None = None  # the last answer's last line as sent to the page, and when
