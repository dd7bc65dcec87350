"""Rows the first server table missed (issue 61's later findings): bodies whose framing two HTTP parsers could read
two ways (RFC 9112 §6.1, request smuggling), sources that name nothing, and a question on a session that has taken
no frame. Each framing row goes over a raw loopback socket, as no well-behaved client would send it, and must be
answered within 2 s with the connection then closed: a regression is a quick failure, not a 30-s hang."""

import http.client
import json
import os
import socket
import time

import httpx

WITHIN_S = 2.0  # an answer later than this is a hang for these rows
SOCKET_S = 3.0  # how long a raw socket waits for any byte


def raw_exchange(url: str, data: bytes) -> dict:
    """`data` sent as it is; the server's one response (status, body) read by the standard library's parser, how
    long it took, and whether the server then closed the connection."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=SOCKET_S) as s:
        t0 = time.perf_counter()
        s.sendall(data)
        response = http.client.HTTPResponse(s)
        try:
            response.begin()
            body = response.read()
        except (OSError, http.client.HTTPException) as err:  # nothing, or no HTTP, within the socket's wait
            return {"status": None, "body": type(err).__name__, "took": time.perf_counter() - t0, "closed": False}
        took = time.perf_counter() - t0
        try:
            closed = s.recv(1) == b""
        except OSError:  # still open when the wait ran out
            closed = False
    return {"status": response.status, "body": body.decode("latin-1"), "took": took, "closed": closed}


def _line(body: str) -> str | None:
    """The one line a refusal says: the JSON error, or the HTTP parser's own plain line (uvicorn's, for what h11
    refuses before the app sees it); None when the body is neither."""
    try:
        said = json.loads(body)
    except ValueError:
        said = body.strip() if body.strip() and "\n" not in body.strip() else None
        return said if said and "Traceback" not in said else None
    return said.get("error") if isinstance(said, dict) and isinstance(said.get("error"), str) else None


def refused_at_once(head: str, body: bytes = b"", status: int = 400):
    """A request of `head` (its lines, CRLF added; the bearer token and a Host added) and `body`: `status` within
    `WITHIN_S`, one line, the connection closed after it."""
    def send(ctx) -> dict:
        token = ctx.http.headers.get("authorization", "")
        data = (head.replace("\n", "\r\n") + f"\r\nHost: 127.0.0.1\r\nAuthorization: {token}\r\n\r\n").encode() + body
        got = raw_exchange(ctx.url, data)
        line = _line(got["body"])
        ok = got["status"] == status and got["took"] < WITHIN_S and got["closed"] and line is not None
        return {"ok": ok, "observed": f"{got['status']} in {got['took']:.2f} s, connection "
                                      f"{'closed' if got['closed'] else 'left open'}: {(line or got['body'])[:120]}"}
    return send


def smuggled_delete(ctx) -> dict:
    """The classic CL.TE shape: a proxy that trusts Content-Length forwards the whole body; a server that trusts
    the chunks would end the body at `0` and run the DELETE hidden after it as a request of its own. It must not:
    400, the connection closed, the session still open."""
    sid = ctx.open(budget="256")
    try:
        token = ctx.http.headers.get("authorization", "")
        hidden = f"0\r\n\r\nDELETE /v1/sessions/{sid} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {token}\r\n\r\n"
        data = (f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(hidden)}\r\nTransfer-Encoding: chunked\r\n\r\n"
                f"{hidden}").encode()
        got = raw_exchange(ctx.url, data)
        time.sleep(0.2)  # were the DELETE run, it would be by now
        still = ctx.http.get(f"/v1/sessions/{sid}").status_code
        ok = got["status"] == 400 and got["took"] < WITHIN_S and got["closed"] and still == 200
        return {"ok": ok, "observed": f"{got['status']} in {got['took']:.2f} s, connection "
                                      f"{'closed' if got['closed'] else 'left open'}; the session after it: {still} "
                                      f"({'still open' if still == 200 else 'the hidden DELETE ran'})"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


def names_nothing(source: dict, field: str):
    """An open whose source names no place: 422 with one line that starts with `field`, and no session opened."""
    def send(ctx) -> dict:
        response = ctx.http.post("/v1/sessions", json={"source": source})
        if response.status_code == 201:  # the regression: a pushed-frames session nobody asked for
            ctx.http.delete(f"/v1/sessions/{response.json()['id']}")
        line = _line(response.text) or ""
        ok = response.status_code == 422 and line.startswith(f"{field}:")
        return {"ok": ok, "observed": f"{response.status_code}: {line or response.text}"[:160]}
    return send


def nothing_taken(ctx) -> dict:
    """Every frame pushed was refused (undecodable bytes, 400 each); an untimed question then has no frame to be
    answered from and nothing coming: a 4xx within `WITHIN_S`, not a wait."""
    sid = ctx.open(budget="256")
    try:
        codes = [ctx.frame(sid, os.urandom(3000), t).status_code for t in (0.0, 1.0, 2.0)]
        t0 = time.perf_counter()
        try:
            response = ctx.http.post(f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?",
                                                                           "stream": False}, timeout=WITHIN_S)
        except httpx.TimeoutException:
            return {"ok": False, "observed": f"frames {codes}; no answer to the question in {WITHIN_S:g} s"}
        took = time.perf_counter() - t0
        line = _line(response.text)
        ok = codes == [400] * 3 and 400 <= response.status_code < 500 and line is not None
        return {"ok": ok, "observed": f"frames {codes}; question {response.status_code} in {took:.2f} s: "
                                      f"{(line or response.text)[:100]}"}
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")


# a question to no session: the JSON body is read (where the hang was) and, should the server take it, nothing opens
POST = "POST /v1/sessions/no-such-session/questions HTTP/1.1\nContent-Type: application/json"
BODY = b'{"text": "what is on screen?"}'


def rows(Row) -> list:
    """These rows, after every earlier one (the committed table keeps its numbers)."""
    return [*framing_rows(Row), *source_rows(Row),
            # fairness: no wait without something to wait for
            Row("untimed question after every pushed frame was refused", 0, nothing_taken)]


def framing_rows(Row) -> list:
    """One reading of where a body ends, or a 400 and the connection closed."""
    n = len(BODY)
    chunked_body = b"%x\r\n" % n + BODY + b"\r\n0\r\n\r\n"
    return [
        Row("Content-Length and Transfer-Encoding: chunked, a plain body", 0, refused_at_once(
            f"{POST}\nContent-Length: {n}\nTransfer-Encoding: chunked", BODY)),
        Row("Content-Length and Transfer-Encoding: chunked, a chunked body", 0, refused_at_once(
            f"{POST}\nContent-Length: {len(chunked_body)}\nTransfer-Encoding: chunked", chunked_body)),
        Row("a DELETE hidden behind Content-Length and Transfer-Encoding", 0, smuggled_delete),
        Row("Transfer-Encoding: gzip", 0, refused_at_once(f"{POST}\nTransfer-Encoding: gzip", BODY)),
        Row("Transfer-Encoding: gzip, chunked", 0, refused_at_once(f"{POST}\nTransfer-Encoding: gzip, chunked",
                                                                   chunked_body)),
        Row("Transfer-Encoding: identity with a Content-Length", 0, refused_at_once(
            f"{POST}\nContent-Length: {n}\nTransfer-Encoding: identity", BODY)),
        Row("Transfer-Encoding: chunked twice", 0, refused_at_once(
            f"{POST}\nTransfer-Encoding: chunked\nTransfer-Encoding: chunked", chunked_body)),
        Row("two Content-Length headers that differ", 0, refused_at_once(
            f"{POST}\nContent-Length: {n}\nContent-Length: 5", BODY)),
        Row("one Content-Length naming two lengths", 0, refused_at_once(f"{POST}\nContent-Length: {n}, 5", BODY)),
        Row("Transfer-Encoding: chunked on a GET", 0, refused_at_once(
            "GET /healthz HTTP/1.1\nTransfer-Encoding: chunked", b"0\r\n\r\n")),
        Row("Transfer-Encoding: chunked on a GET, no body sent", 0, refused_at_once(
            "GET /healthz HTTP/1.1\nTransfer-Encoding: chunked")),
    ]


def source_rows(Row) -> list:
    """Each source names a place, or the open is refused naming the field."""
    return [
        Row("source with an empty file name", 0, names_nothing({"file": ""}, "source.file")),
        Row("source with an empty URL", 0, names_nothing({"url": ""}, "source.url")),
        Row("source with an empty file name and an empty URL", 0, names_nothing({"file": "", "url": ""},
                                                                                "source.file")),
        Row("source that is an empty object", 0, names_nothing({}, "source")),
        Row("source with only options, no file or URL", 0, names_nothing({"file": None, "url": None,
                                                                          "realtime": False}, "source")),
    ]
