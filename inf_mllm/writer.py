"""A thread that does one store folder's writes, in order, off the model's thread (store.py).

Serialising a span, hashing it and fsyncing its file and index record took the model's thread several
milliseconds per clip turn, counted as eviction time; behind this writer the model's thread only queues them.
The thread runs only while there is something to write: an idle store holds no thread, so a store dropped
without `close()` goes with its session as before.
"""

import queue
import threading
from collections import deque


class Writer:
    """Does the writes asked of it (`submit`) in order, on a thread started when there is work and ended when there
    is none. An exception a write raises stops the writing: what was queued is let go, and the exception is raised
    on the caller's thread at its next `check` or `flush` (a crash in the tests' fault injection included).
    Warnings are kept (`say`) for the caller's thread to give (`told`)."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.running = False
        self.error: BaseException | None = None
        self.messages: deque[str] = deque()

    def submit(self, fn, *args) -> None:
        self.check()
        with self.lock:
            self.queue.put((fn, args))
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="span-store-writer", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self.lock:
                try:
                    fn, args = self.queue.get_nowait()
                except queue.Empty:
                    self.running = False
                    return
            try:
                if self.error is None:
                    fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                self.error = err
            finally:
                fn = args = None  # nothing of the store is held while the thread waits for the lock
                self.queue.task_done()

    def say(self, text: str) -> None:
        self.messages.append(text)

    def told(self) -> list[str]:
        said = []
        while self.messages:
            said.append(self.messages.popleft())
        return said

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        """Wait until every write asked for so far is done (or let go after an error), then raise that error."""
        self.queue.join()
        self.check()
