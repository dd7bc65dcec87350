"""Questions typed or piped on stdin while a video plays, released at the next turn boundary."""

import os
import select
import stat
import sys
import threading

from .questions import MAX_QUESTION_CHARS, Question, QuestionError, Schedule, parse_ask


def piped() -> bool:
    """Whether stdin is a pipe or a file someone gave it (`echo "…?" | stream-qa`), not a terminal or /dev/null."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # closed, or a test runner's stand-in
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


class StdinQuestions:
    """Questions typed or piped on stdin, read on a thread and released at the next turn boundary.

    The thread reads fd 0 with select + os.read and stops when `close()` is called: a thread blocked in
    `sys.stdin.buffer` holds that object's lock, and at interpreter shutdown (a terminal never sends
    EOF) Python aborts on it ("Fatal Python error", SIGABRT, exit 134)."""

    def __init__(self, schedule: Schedule, now=lambda: None, cuts=None):
        """`now()`: the video time a question typed without one is asked at (a paced source's `asked_at`; None: at the
        next turn boundary); `cuts`: the engine's (`clips.Cuts`), told each question's time."""
        self.schedule, self.lock, self.error = schedule, threading.Lock(), None
        self.now, self.cuts = now, cuts
        self.closed, self.eof = threading.Event(), threading.Event()
        if sys.stdin is None or sys.stdin.closed:
            self.eof.set()
            return
        if sys.stdin.isatty():
            print("stream-qa: type a question and press Enter (\"… @30s\" to ask at a video time)", file=sys.stderr)
        self.thread = threading.Thread(target=self._read, daemon=True, name="stdin")
        self.thread.start()

    def _read(self) -> None:
        pending = b""
        try:
            fd = sys.stdin.fileno()
            while not self.closed.is_set():
                if not select.select([fd], [], [], 0.2)[0]:
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._add(line)
                if len(pending) > 4 * MAX_QUESTION_CHARS:  # UTF-8 is at most 4 bytes a character
                    raise QuestionError(f"a question longer than {MAX_QUESTION_CHARS:,} characters")
            if pending and not self.closed.is_set():
                self._add(pending)
        except UnicodeDecodeError:
            self.error = QuestionError("stdin: the question text is not UTF-8")
        except QuestionError as err:
            self.error = QuestionError(f"stdin: {err}")
        except (OSError, ValueError):  # stdin closed under us: no more questions
            return
        finally:
            self.eof.set()

    def _add(self, line: bytes) -> None:
        text = line.decode("utf-8").strip()
        if text:
            question = parse_ask(text)
            if question.at is None:
                question = Question(question.text, self.now())
            with self.lock:
                self.schedule.add(question)
            if self.cuts is not None:
                self.cuts.add(question.at)

    def close(self) -> None:
        self.closed.set()
        if getattr(self, "thread", None) is not None:
            self.thread.join(timeout=1.0)

    def due(self, t):
        if self.error:
            raise self.error
        with self.lock:
            return self.schedule.due(t)

    def times(self):
        with self.lock:
            return self.schedule.times()

    def rest(self):
        if not sys.stdin.isatty():  # a pipe: what it already holds is asked too
            self.eof.wait(timeout=2.0)
        if self.error:
            raise self.error
        with self.lock:
            return self.schedule.rest()
