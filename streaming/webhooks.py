"""Alerts POSTed as JSON to the URLs an operator named, on a thread of their own.

`Webhooks` is a subscriber (`put(event)`): an alert is queued without waiting (a bounded queue; past it, the alert is
dropped for the webhooks and counted), so a slow or dead receiver never delays ingest or an answer. The delivery
thread POSTs each alert to each URL: only a URL its URL policy opens (`streaming/urls.py`: checked, its host resolved,
at every attempt), never following a redirect (a 3xx is a refusal: the receiver is who the operator named), retried
with doubling waits on a connection error, a timeout, a 429 or a 5xx; a 4xx is a refusal and is not retried.
Delivery is at least once: each POST carries the alert's id (in the body, and as `Idempotency-Key`), so a receiver
that saw it before can drop the repeat.
"""

import queue
import threading
import time

from .events import Alert, Handler
from .urls import UrlPolicy, UrlRefused, redact

MAX_QUEUED = 1000  # alerts waiting for delivery, at most
ATTEMPTS = 5
FIRST_WAIT_S = 0.5  # then 1, 2, 4 s
TIMEOUT_S = 10.0


class Webhooks(Handler):
    def __init__(self, urls, policy: UrlPolicy, attempts: int = ATTEMPTS, first_wait_s: float = FIRST_WAIT_S,
                 timeout_s: float = TIMEOUT_S, warn=None):
        self.urls, self.policy = list(urls), policy
        self.attempts, self.first_wait_s, self.timeout_s = attempts, first_wait_s, timeout_s
        self.warn = warn or (lambda text: None)
        self.counts = {"delivered": 0, "retried": 0, "failed": 0, "dropped": 0}
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)
        self._thread.start()

    @staticmethod
    def check(urls, policy: UrlPolicy) -> None:
        """Each URL, as the policy opens it (UrlRefused: one line naming the first it does not)."""
        for url in urls:
            if not url.lower().startswith(("http://", "https://")):
                raise UrlRefused(f"webhook {redact(url)}: a webhook is an http:// or https:// URL")
            policy.check(url)

    def put(self, event, session: str | None = None) -> None:
        """From any thread: an alert queued for delivery (other events are not the webhooks')."""
        event.to(self)

    def on_alert(self, event: Alert) -> None:
        try:
            self._queue.put_nowait(event.alert)
        except queue.Full:
            self.counts["dropped"] += 1

    def close(self, wait_s: float = 5.0) -> None:
        """Stop once what is queued or being retried is delivered, or after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            while not self._stop.is_set():
                try:
                    alert = self._queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                for url in self.urls:
                    self._deliver(client, url, alert)
                self._queue.task_done()  # only now: `close` waits for an alert between its retries too

    def _deliver(self, client, url: str, alert: dict) -> None:
        import httpx

        wait, why = self.first_wait_s, ""
        for attempt in range(self.attempts):
            if attempt:
                self.counts["retried"] += 1
                if self._stop.wait(wait):
                    break
                wait *= 2
            try:
                self.policy.check(url)  # again at each attempt: where the name resolves now
                reply = client.post(url, json=alert, headers={"Idempotency-Key": alert["id"]})
            except UrlRefused as err:
                why = str(err)
                break
            except httpx.HTTPError as err:
                why = type(err).__name__
                continue
            if reply.is_success:
                self.counts["delivered"] += 1
                return
            why = f"HTTP {reply.status_code}"
            if reply.status_code != 429 and reply.status_code < 500:
                break  # a refusal (a redirect included): the same request would be refused again
        self.counts["failed"] += 1
        self.warn(f"webhook {redact(url)}: alert {alert['id']} not delivered ({why}); "
                  f"{self.counts['failed']} not delivered so far")
