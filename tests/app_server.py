"""The app as a user meets it: `python -m app` in its own process on a free 127.0.0.1 port."""

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from jetson.reliability.serving import stop, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
ARTEFACTS = ROOT / "tests" / "artefacts"  # screenshots and logs of the browser tests (git-ignored)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(*args, log_name="app.log"):
    """Start the app, wait for it to print its URL and answer HTTP, yield the URL, then stop it."""
    port = free_port()
    ARTEFACTS.mkdir(exist_ok=True)
    log = open(ARTEFACTS / log_name, "w")
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url, ARTEFACTS / log_name, timeout=120)
        assert url in (ARTEFACTS / log_name).read_text()  # the URL is printed for the user
        yield url
    finally:
        stop(proc, log, grace=15)


CHROMIUM = "/usr/bin/chromium"  # Debian's package: Playwright cannot download browsers here
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync",
                 "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]  # a fake camera


@contextmanager
def chromium(*extra: str):
    """Debian's Chromium under Playwright, with the arguments every browser test needs (and `extra`)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *extra])
        try:
            yield browser
        finally:
            browser.close()
