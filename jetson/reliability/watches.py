"""The server's rows for watches (issue 69): every bad watch request a clear 4xx in one JSON line, the session's
watches as they were after it, and the feeds of what sessions say behind the server's token."""

import httpx

from streaming.watches import MAX_WATCHES

PERSON = {"text": "a person"}


def _add(body, kind: str = "application/json", **settings):
    """POST `body` (a dict, or raw bytes) to a fresh session's watches (opened with `settings`); the row fails if the
    session's watches changed (a refusal that still added one)."""
    def send(ctx):
        sid = ctx.open(budget="256", watches=["a car"], **settings)
        try:
            path = f"/v1/sessions/{sid}/watches"
            got = ctx.http.post(path, content=body, headers={"content-type": kind}) if isinstance(body, bytes) \
                else ctx.http.post(path, json=body)
            kept = [w["text"] for w in ctx.http.get(path).json()]
            if got.status_code < 300 or kept == ["a car"]:
                return got
            return {"ok": False, "observed": f"{got.status_code}, and the watches became {kept}"}
        finally:
            ctx.http.delete(f"/v1/sessions/{sid}")
    return send


def _open(watches, **settings):
    return lambda ctx: ctx.http.post("/v1/sessions", json={"budget": "256", "watches": watches, **settings})


def _on(path: str, method: str = "get", closed: bool = False):
    """`method` on `path` (with {sid}) of a fresh session, or of one closed first."""
    def send(ctx):
        sid = ctx.open(budget="256")
        if closed:
            ctx.http.delete(f"/v1/sessions/{sid}")
        try:
            return getattr(ctx.http, method)(path.format(sid=sid))
        finally:
            if not closed:
                ctx.http.delete(f"/v1/sessions/{sid}")
    return send


def _thousand(ctx) -> dict:
    """1,000 watches asked for one after another: the first `MAX_WATCHES` taken, every later one a 400, and the
    session still holding `MAX_WATCHES`."""
    sid = ctx.open(budget="256")
    try:
        codes = [ctx.http.post(f"/v1/sessions/{sid}/watches", json={"text": f"{1 + i % 9} cars"}).status_code
                 for i in range(1000)]
        held = len(ctx.http.get(f"/v1/sessions/{sid}/watches").json())
    finally:
        ctx.http.delete(f"/v1/sessions/{sid}")
    ok = codes[:MAX_WATCHES] == [201] * MAX_WATCHES and set(codes[MAX_WATCHES:]) == {400} and held == MAX_WATCHES
    return {"ok": ok, "observed": f"{codes.count(201)} taken, {codes.count(400)} refused with 400, {held} held"}


def _bare(path: str):
    def send(ctx):
        return httpx.get(f"{ctx.url}{path}", timeout=30)
    return send


def rows(Row) -> list:
    """These rows, after every earlier one (the committed table keeps its numbers)."""
    return [
        Row("watch with empty text", 422, _add({"text": ""})),
        Row("watch of 10 KB", 422, _add({"text": "a person " * 1200})),
        Row("watch of 201 characters", 422, _add({"text": "p" * 201})),
        Row("watch of spaces only", 400, _add({"text": "     "})),
        Row("watch that is only '@once'", 400, _add({"text": "@once"})),
        Row("watch with a NUL and control characters", 400, _add({"text": "a person\x00\x1b[2J"})),
        Row("watch the model judges, on a policy that keeps every question", 400,
            _add({"text": "is the door open?"}, policy="h2o")),
        Row("watch with an unknown field", 422, _add(PERSON | {"webhook": "http://127.0.0.1/"})),
        Row("watch text that is a number", 422, _add({"text": 42})),
        Row("watch text that is a list", 422, _add({"text": ["a person"]})),
        Row("watch with no text", 422, _add({"cooldown_s": 5})),
        Row("watch cooldown negative", 422, _add(PERSON | {"cooldown_s": -1})),
        Row("watch cooldown infinite", 422, _add(b'{"text": "a person", "cooldown_s": 1e999}')),
        Row("watch cooldown of a year", 422, _add(PERSON | {"cooldown_s": 3.2e7})),
        Row("watch re-arming after 0 clips", 422, _add(PERSON | {"rearm_clips": 0})),
        Row("watch re-arming after 100000 clips", 422, _add(PERSON | {"rearm_clips": 100000})),
        Row("watch as malformed JSON", 400, _add(b'{"text": "a per')),
        Row("watch as text/plain", 422, _add(b'{"text": "a person"}', "text/plain")),
        Row("1000 watches on one session", 0, _thousand),
        Row("open with watches that are not a list", 422, _open("a person")),
        Row("open with 65 watches", 422, _open([f"{1 + i % 9} cars" for i in range(MAX_WATCHES + 1)])),
        Row("open with an empty watch", 422, _open([""])),
        Row("open with a watch the model judges, on a policy that keeps every question", 400,
            _open(["a person", "is it raining?"], policy="h2o")),
        Row("watches of an unknown session", 404, lambda ctx: ctx.http.post("/v1/sessions/no-such-session/watches",
                                                                            json=PERSON)),
        Row("watch added to a closed session", 404, _on("/v1/sessions/{sid}/watches", closed=True)),
        Row("watch removed that was never set", 404, _on("/v1/sessions/{sid}/watches/7", "delete")),
        Row("watch removed by a name, not its id", 422, _on("/v1/sessions/{sid}/watches/person", "delete")),
        Row("alerts of a closed session", 404, _on("/v1/sessions/{sid}/alerts", closed=True)),
        Row("events of a closed session", 404, _on("/v1/sessions/{sid}/events", closed=True)),
        Row("watch changed with PUT", 405, _on("/v1/sessions/{sid}/watches", "put")),
        Row("server events without the token", 401, _bare("/v1/events")),
        Row("session events without the token", 401, _bare("/v1/sessions/x/events")),
        Row("alerts without the token", 401, _bare("/v1/sessions/x/alerts")),
    ]
