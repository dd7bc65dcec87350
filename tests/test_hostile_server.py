"""The server under attack (issue 61), beyond the table's rows: a real `python -m serve` on loopback keeping session
folders, a loopback listener that counts what reaches it."""

import json
import re

import httpx
import pytest

from jetson.reliability import edges
from jetson.reliability.forgery import listener
from jetson.reliability.server import Row, run_rows
from jetson.reliability.serving import TOKEN, serving
from streaming.sources import bundled_clip

pytestmark = pytest.mark.slow  # a server of its own (~30 s to load the model)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    folders = root / "sessions"
    with serving(root, "--sessions", str(folders)) as (url, media, process):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
            yield http, folders, process


def test_refused_opens_leave_no_folder(server):
    http, folders, _ = server
    before = set(folders.iterdir()) if folders.exists() else set()
    for body in ({"budget": "3"}, {"window": 100000, "budget": "96"}, {"source": {"url": "http://10.0.0.1/x"}},
                 {"source": {"file": "nothing.mp4"}}, {"policy": "fastest"}):
        assert http.post("/v1/sessions", json=body).status_code in (400, 403, 404)
    assert set(folders.iterdir()) == before


def test_credentials_in_a_url_stay_in_memory(server):
    """A camera URL with a password, on a host the operator allowed: the session opens, and neither its state nor
    its folder nor any message holds the password."""
    http, folders, _ = server
    video = bundled_clip().read_bytes()
    with listener("127.0.0.1", {"/cam.mp4": (200, {"Content-Type": "video/mp4"}, video)}) as (base, hits):
        url = base.replace("http://", "http://admin:hunter2@") + "/cam.mp4"
        opened = http.post("/v1/sessions", json={"source": {"url": url, "realtime": False}})
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        try:
            assert "hunter2" not in opened.text and hits  # FFmpeg fetched it, with the credentials it was given
            answer = http.post(f"/v1/sessions/{sid}/questions", json={"text": "what is on screen?", "at": 4.0,
                                                                     "stream": False})
            assert answer.status_code == 200 and answer.json()["answer"]
            saved = (folders / sid / "session.json").read_text()
            assert "hunter2" not in saved and json.loads(saved)["source"]["url"].startswith("http://***@127.0.0.1")
            assert "hunter2" not in http.get(f"/v1/sessions/{sid}").text
        finally:
            http.delete(f"/v1/sessions/{sid}")
    assert not any("hunter2" in p.read_text(errors="replace") for p in folders.rglob("*") if p.is_file()
                   and p.suffix in (".json", ".jsonl"))


def _rows(http, table) -> list[dict]:
    """`table`'s rows of the reliability table, run against this module's server."""
    names = "|".join(re.escape(row.name) for row in table(Row))
    rows = run_rows(str(http.base_url).rstrip("/"), None, only=f"^({names})$")
    assert len(rows) == len(table(Row))
    return rows


def test_a_body_two_parsers_would_read_two_ways_is_refused_at_once_and_its_connection_closed(server):
    """Content-Length with chunked (the shape that hung 30 s, and let a DELETE hidden in its body run), other
    codings, lengths that differ, a chunked GET: each a 400 within 2 s on a raw socket that waits 3 s at most."""
    http, _, process = server
    bad = [r for r in _rows(http, edges.framing_rows) if not r["ok"]]
    assert not bad, bad
    assert process.poll() is None


def test_a_source_that_names_nothing_is_a_422_naming_its_field_and_opens_nothing(server):
    http, folders, _ = server
    before = set(folders.iterdir()) if folders.exists() else set()
    opened = http.get("/healthz").json()["sessions"]
    bad = [r for r in _rows(http, edges.source_rows) if not r["ok"]]
    assert not bad, bad
    assert http.get("/healthz").json()["sessions"] == opened
    assert (set(folders.iterdir()) if folders.exists() else set()) == before


def test_an_untimed_question_on_a_session_that_took_no_frame_is_refused_at_once(server):
    """Every pushed frame refused (undecodable), then a question without `at`: nothing will ever come to answer it
    from, so a 4xx within 2 s (it waited past 30 s)."""
    http, _, _ = server
    (row,) = _rows(http, lambda Row: [r for r in edges.rows(Row) if r.name.startswith("untimed question")])
    assert row["ok"], row
