"""A client of the streaming-session server (`python -m serve`), and `stream-qa --server URL`.

`Client(url).open(...)` gives a `RemoteSession`: push frames (numpy RGB or JPEG/PNG bytes, each with its video
time) or a chunk of video, ask a question (its answer's events as they come, or the record), read telemetry and
the transcript, close. A refusal is a `RemoteError` with the server's one line and status; a 429 is retried after
its Retry-After a few times first.
"""

import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np

from .errors import UserError

ROUTE_HEADER = "serve_multiplexed_model_id"  # Ray Serve routes a session's requests by it (serve/ray_app.py)


class RemoteError(UserError):
    """The server refused a request, or could not be reached; one line."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _check(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        try:
            why = response.json().get("error", response.text)
        except ValueError:
            why = response.text.strip().splitlines()[0] if response.text.strip() else response.reason_phrase
        raise RemoteError(f"server: {why} (HTTP {response.status_code})", response.status_code)
    return response


def _own_error(response: httpx.Response) -> bool:
    """Whether a failure is the server's own answer (JSON, {"error": …}) rather than a proxy's."""
    try:
        return isinstance(response.json(), dict) and "error" in response.json()
    except ValueError:
        return False


def encoded(rgb: np.ndarray, kind: str = "JPEG") -> bytes:
    """A frame as JPEG (quality 90: small) or PNG (lossless: the server sees the pixels decoded here)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb[..., :3], dtype=np.uint8)).save(buf, kind, quality=90, compress_level=1)
    return buf.getvalue()


class Client:
    def __init__(self, url: str, token: str | None = None, timeout: float = 120.0, retries: int = 20,
                 failovers: int = 20):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.url, self.retries, self.failovers = url, retries, failovers

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """One request; 429 and 503 are retried after the server's Retry-After, `retries` times. Behind Ray Serve a
        replica that dies takes its requests with it: a broken connection or a failure that is not the server's
        own JSON error is retried too (the session continues on another replica), `failovers` times."""
        failovers = 0
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, **kw)
            except httpx.HTTPError as err:
                if isinstance(err, httpx.ConnectError) or failovers >= self.failovers:
                    raise RemoteError(f"server {self.url}: {type(err).__name__}: {str(err) or 'no answer'}") from None
                failovers += 1
                time.sleep(0.5)
                continue
            if response.status_code in (500, 502, 504) and not _own_error(response) and failovers < self.failovers:
                failovers += 1
                time.sleep(0.5)
                continue
            if response.status_code not in (429, 503) or attempt == self.retries:
                return _check(response)
            time.sleep(float(response.headers.get("retry-after", "1")))
        return _check(response)

    def health(self) -> dict:
        return self.request("GET", "/healthz").json()

    def open(self, **settings) -> "RemoteSession":
        """A session: model, policy, budget, bias, window, fps, clip_seconds, max_new_tokens, source (a file under
        the server's media folder or a URL, as {"file": …} / {"url": …}; none: frames are pushed)."""
        state = self.request("POST", "/v1/sessions", json={k: v for k, v in settings.items() if v is not None}).json()
        return RemoteSession(self, state)

    def close(self) -> None:
        self.http.close()


class RemoteSession:
    def __init__(self, client: Client, state: dict):
        self.client, self.id, self.opened = client, state["id"], state
        self.path = f"/v1/sessions/{self.id}"
        self.route = {ROUTE_HEADER: self.id}  # on Ray Serve: to the replica that holds this session

    def _request(self, method: str, suffix: str = "", headers: dict | None = None, **kw) -> httpx.Response:
        return self.client.request(method, self.path + suffix, headers=self.route | (headers or {}), **kw)

    def push(self, frame, t: float) -> dict:
        """A frame at video time `t`: an (H, W, 3) uint8 array (sent as JPEG) or JPEG/PNG bytes."""
        data = frame if isinstance(frame, bytes) else encoded(frame)
        kind = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
        return self._request("POST", "/frames", params={"t": t}, content=data, headers={"content-type": kind}).json()

    def push_video(self, data: bytes, start: float | None = None, kind: str = "video/mp4") -> dict:
        params = {"start": start} if start is not None else {}
        return self._request("POST", "/video", params=params, content=data, headers={"content-type": kind}).json()

    def end(self) -> dict:
        return self._request("POST", "/end").json()

    def events(self, text: str, at: float | None = None) -> Iterator[tuple[str, dict]]:
        """Ask now (the request is sent before this returns); then (event, data) as the answer comes: ("start",
        {video_t}), ("token", {text})…, ("answer", record)."""
        body = {"text": text, "at": at, "stream": True}
        for attempt in range(self.client.retries + 1):
            request = self.client.http.build_request("POST", f"{self.path}/questions", json=body, headers=self.route,
                                                     timeout=httpx.Timeout(30.0, read=None))
            try:
                response = self.client.http.send(request, stream=True)
            except httpx.HTTPError as err:
                raise RemoteError(f"server {self.client.url}: {type(err).__name__}: {err}") from None
            if response.status_code == 429 and attempt < self.client.retries:
                response.close()
                time.sleep(float(response.headers.get("retry-after", "1")))
                continue
            if response.status_code >= 400:
                response.read()
                response.close()
                _check(response)
            return self._read_events(response)
        raise AssertionError("unreachable")

    def _read_events(self, response: httpx.Response) -> Iterator[tuple[str, dict]]:
        try:
            event = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if event == "error":
                        raise RemoteError(f"server: {data['error']}", 409)
                    yield event, data
                    if event == "answer":
                        return
            raise RemoteError("server: the answer's stream ended before its record")
        except httpx.HTTPError as err:
            raise RemoteError(f"server {self.client.url}: {type(err).__name__}: {err}") from None
        finally:
            response.close()

    def answer(self, text: str, at: float | None = None) -> dict:
        """The answer's record (the fields of `stream-qa --json`)."""
        body = {"text": text, "at": at, "stream": False}
        return self._request("POST", "/questions", json=body).json()

    def state(self) -> dict:
        return self._request("GET").json()

    def transcript(self) -> list[dict]:
        return self._request("GET", "/transcript").json()

    def close(self) -> dict:
        return self._request("DELETE").json()


def run_remote(args, source, questions, out, say) -> int:
    """`stream-qa --server URL`: the source's frames go to a session on the server and the questions are asked
    there as the pushed video reaches their times; answers print as `stream-qa` prints them. `say(answer)` writes
    one answer's lines (the CLI's own printer); returns the exit status."""
    import os

    client = Client(args.server, token=os.environ.get("STREAM_QA_TOKEN"))
    name, *_ = args.model
    session = client.open(model=name, policy=args.policy, budget=str(args.budget), bias=args.bias,
                          window=args.window, fps=args.fps, clip_seconds=args.clip_seconds,
                          max_new_tokens=args.max_new_tokens)
    run = _RemoteRun(session, args.fps)
    pusher = threading.Thread(target=run.push_all, args=(source,), name="push", daemon=True)
    submitter = threading.Thread(target=run.submit_all, args=(questions,), name="ask", daemon=True)
    pusher.start()
    submitter.start()
    try:
        run.print_all(len(questions), out, say, args.json)
        pusher.join()
        if run.failed:
            raise run.failed[0]
    finally:
        run.done.set()
        with contextlib.suppress(RemoteError):  # gone with the server: the run's own outcome is what is said
            session.close()
        client.close()
    return 0


class _RemoteRun:
    """Three threads of one `--server` run: frames pushed (`push_all`), questions asked as the pushed video reaches
    their times (`submit_all`), answers printed in the order asked (`print_all`, the caller's thread)."""

    def __init__(self, session, fps: float):
        self.session, self.fps = session, fps
        self.pushed_t, self.done, self.failed = -1.0, threading.Event(), []
        self.moved = threading.Condition()  # the pushed video moved on (or ended)
        self.streams: list = []  # (question, its events) in the order asked, then None
        self.added = threading.Condition()

    def push_all(self, source) -> None:
        try:
            for frame in source:
                self.session.push(encoded(frame.rgb, "PNG"), frame.t)  # lossless: the answers stream-qa gives here
                with self.moved:
                    self.pushed_t = frame.t
                    self.moved.notify_all()
        except BaseException as err:  # said on the main thread
            self.failed.append(err)
        finally:
            with self.moved:
                self.done.set()
                self.moved.notify_all()
            if not self.failed:  # the server still answers questions asked after the end, about what it saw
                try:
                    self.session.end()
                except RemoteError as err:
                    self.failed.append(err)

    def submit_all(self, questions) -> None:
        try:
            for q in sorted(questions, key=lambda q: -1.0 if q.at is None else q.at):
                with self.moved:  # asked once the pushed video reaches its time, as stream-qa asks it
                    self.moved.wait_for(lambda q=q: self.done.is_set() or q.at is None or self.pushed_t >= q.at)
                if self.failed:
                    break
                with self.moved:  # timed past the video's end: asked at its end, where stream-qa answers it
                    end = self.pushed_t + 1.0 / self.fps  # the last clip's end (its last frame stands for 1/fps)
                    ended = self.done.is_set() and q.at is not None and self.pushed_t >= 0
                    at = min(q.at, end) if ended else q.at
                events = self.session.events(q.text, at)
                with self.added:
                    self.streams.append((q, events))
                    self.added.notify_all()
        except BaseException as err:
            self.failed.append(err)
        finally:
            with self.added:
                self.streams.append(None)
                self.added.notify_all()

    def print_all(self, asked: int, out, say, json_lines: bool) -> None:
        from .engine import Answer

        for i in range(asked + 1):
            with self.added:
                self.added.wait_for(lambda i=i: len(self.streams) > i)
                item = self.streams[i]
            if item is None:
                break
            q, events = item
            for event, data in events:
                if event == "start" and not json_lines:
                    out.write(f"[{data['video_t']:7.1f}s] Q: {q.text}\n{'':11}A: ")
                elif event == "token" and not json_lines:
                    out.write(data["text"])
                elif event == "answer":
                    say(Answer(**data))
                out.flush()
