"""A real HTTP receiver on loopback for the webhook tests: it records every POST (path, Idempotency-Key, JSON body),
answers the first `fail` of them with 503, waits `delay_s` before each answer, and answers `redirect` paths with 302."""

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, fail: int = 0, delay_s: float = 0.0, redirect: tuple[str, ...] = ()):
        self.fail, self.delay_s, self.redirect = fail, delay_s, redirect
        self.posts: list[tuple[str, str | None, dict]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"null")
                with receiver.lock:
                    receiver.posts.append((self.path, self.headers.get("idempotency-key"), body))
                    failing = len(receiver.posts) <= receiver.fail
                time.sleep(receiver.delay_s)
                if self.path in receiver.redirect:
                    self.send_response(302)
                    self.send_header("Location", "/elsewhere")
                else:
                    self.send_response(503 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                """Quiet: the tests read what it recorded, not its access log."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        with contextlib.suppress(Exception):
            self.server.shutdown()
            self.server.server_close()
