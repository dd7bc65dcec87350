"""`python -m app.measure`: the app's goal figures, measured on the served app, written as JSON.

1. Send → first token on the page, against the engine's own time to first token: a real Chromium
   (Playwright) plays the bundled clip and asks `--questions` questions; the page times the click
   and the first answer text with a MutationObserver, the engine's TTFT is read from the answer.
2. Memory of a bounded session over `--minutes` of video (API client; the server clock runs at
   `--speed`, a question every 30 s of video): every sample within budget + one turn; a full-cache
   session over `--full-minutes` for the climbing line.
3. Two browser sessions at once for `--concurrent-minutes` of playback, each asking every 15 s:
   cross-talk (a question seen in the other page) and errors (⚠ messages, page errors) counted.
"""

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from gradio_client import Client

from streaming.questions import SAMPLE_QUESTION

from .ui import launch

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]

TIME_CLICK = """(n) => new Promise(resolve => {
  const chat = document.querySelector('#chat');
  const t0 = performance.now();
  const obs = new MutationObserver(() => {
    const ms = chat.querySelectorAll('.message');
    if (ms.length > n + 1 && /^\\[\\d/.test(ms[ms.length - 1].innerText)) {
      obs.disconnect(); resolve(performance.now() - t0);
    }
  });
  obs.observe(chat, {subtree: true, childList: true, characterData: true});
  document.querySelector('#send').click();
})"""


def wait(check, timeout=120, every=0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"no result in {timeout} s")


def messages(page) -> list[str]:
    return [m.inner_text() for m in page.query_selector_all("#chat .message")]


def clips(page) -> int:
    m = re.search(r"clips\s+(\d+)", page.inner_text("#stats"))
    return int(m.group(1)) if m else 0


def set_budget(page, budget: str) -> None:
    """Open "Model and cache" and type the budget. The accordion mounts its fields on first opening
    and a field that mounts just after Playwright typed into it shows its default again (a CI run
    started a "128" session at 256), so type until the value has held for half a second."""
    page.get_by_text("Model and cache").click()
    field = page.locator("#budget textarea, #budget input").first

    def held():
        if field.input_value() != budget:
            field.fill(budget)
            return False
        time.sleep(0.5)
        return field.input_value() == budget

    wait(held, timeout=20)


def open_page(page, url, budget=None):
    """Load the app in `page`, start the bundled clip and play it (muted: autoplay is blocked)."""
    page.set_viewport_size({"width": 1400, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#send")
    if budget:
        set_budget(page, budget)
    page.get_by_role("button", name="Start").click()
    page.wait_for_selector("#player video")
    page.evaluate("(() => { const v = document.querySelector('#player video'); v.muted = true; return v.play(); })()")
    wait(lambda: clips(page) >= 2)
    return page


def ask(page, question, timeout=120) -> str:
    before = len(messages(page))
    page.fill("#question textarea", question)
    page.click("#send")
    return wait(lambda: next((m for m in messages(page)[before + 1:] if "to first token" in m or "⚠" in m), None),
                timeout)


def send_to_first_token(browser, url, n: int) -> dict:
    page = open_page(browser.new_page(), url)
    questions = [SAMPLE_QUESTION, "what shape is in the image?", "is there a circle?"]
    page_s, engine_s = [], []
    for i in range(n):
        page.fill("#question textarea", questions[i % len(questions)])
        before = len(messages(page))
        page_s.append(page.evaluate(TIME_CLICK, before) / 1000)
        final = wait(lambda before=before: next((m for m in messages(page)[before + 1:] if "to first token" in m),
                                                None))
        engine_s.append(float(re.search(r"([\d.]+) s to first token", final).group(1)))
    page.close()
    over = [p - e for p, e in zip(page_s, engine_s, strict=True)]
    return {"questions": n, "page_send_to_first_token_s": _summary(page_s), "engine_ttft_s": _summary(engine_s),
            "page_minus_engine_s": _summary(over),
            "goal_met": statistics.median(page_s) <= statistics.median(engine_s) + 0.3}


def _summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def memory(url, minutes: float, policy: str, budget: str, question_every: float = 30.0) -> dict:
    c = Client(url, verbose=False)
    c.predict([], "Bundled clip", "bikes.mp4", None, 0, "tiny-vlm", policy, budget, None, None, api_name="/start")
    t0, next_q, asked = time.monotonic(), question_every, 0
    while True:
        samples, telemetry = c.predict(api_name="/memory")
        if telemetry["video_s"] >= minutes * 60:
            break
        if telemetry["video_s"] >= next_q:
            c.predict([], SAMPLE_QUESTION, api_name="/ask")
            asked, next_q = asked + 1, next_q + question_every
        time.sleep(0.5)
    samples, telemetry = c.predict(api_name="/memory")
    grows = [b["full_tokens"] - a["full_tokens"] for a, b in zip(samples, samples[1:], strict=False)]
    turn = max(grows)
    kv = [s["kv_tokens"] for s in samples]
    out = {"policy": policy, "budget": None if policy == "full" else int(budget), "video_s": telemetry["video_s"],
           "wall_s": round(time.monotonic() - t0, 1), "samples": len(samples), "questions": asked,
           "clips": telemetry["clips"], "longest_turn_tokens": turn, "kv_tokens_max": max(kv),
           "kv_tokens_last": kv[-1], "kv_mb_max": round(max(s["kv_mb"] for s in samples), 3),
           "full_cache_tokens_last": samples[-1]["full_tokens"],
           "rss_mb_at_0_25_50_75_100_pct": [round(samples[min(len(samples) - 1, len(samples) * q // 4)]["rss_mb"])
                                            for q in range(5)],
           "series": [{k: round(s[k], 1) if k == "rss_mb" else s[k]
                       for k in ("video_s", "kv_tokens", "full_tokens", "rss_mb", "after")} for s in samples[::5]]}
    if policy != "full":
        out["over_budget_after_clips"] = sum(s["kv_tokens"] > int(budget) for s in samples if s["after"] == "clip")
        out["within_budget_plus_one_turn"] = all(k <= int(budget) + turn for k in kv)
    else:
        out["climbs"] = kv == sorted(kv) and kv[-1] > 4 * kv[1]
    return out


def concurrent(browser, url, minutes: float) -> dict:
    errors: list[str] = []
    pages = {}
    for name, budget in (("a", "256"), ("b", "128")):
        page = browser.new_context().new_page()
        page.on("pageerror", lambda e, name=name: errors.append(f"{name}: {e}"))
        pages[name] = open_page(page, url, budget)
    asks = {"a": "is there a circle?", "b": "what shape is in the image?"}
    answered = {"a": 0, "b": 0}
    t0 = time.monotonic()
    while time.monotonic() - t0 < minutes * 60:
        for name, page in pages.items():
            reply = ask(page, asks[name])
            answered[name] += "to first token" in reply
            errors += [f"{name}: {reply}"] if "⚠" in reply else []
        time.sleep(15)
    chats = {name: " ".join(messages(page)) for name, page in pages.items()}
    crosstalk = int(asks["b"] in chats["a"]) + int(asks["a"] in chats["b"])
    budgets = {name: re.search(r"budget (\w+)", page.inner_text("#stats")).group(1) for name, page in pages.items()}
    crosstalk += int(budgets != {"a": "256", "b": "128"})
    for page in pages.values():
        page.context.close()
    return {"minutes": minutes, "answers": answered, "crosstalk": crosstalk, "errors": len(errors),
            "error_lines": errors[:5], "goal_met": crosstalk == 0 and not errors and min(answered.values()) > 0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m app.measure", description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--minutes", type=float, default=10.0, help="video minutes of the bounded memory run")
    p.add_argument("--full-minutes", type=float, default=3.0)
    p.add_argument("--concurrent-minutes", type=float, default=5.0)
    p.add_argument("--speed", type=float, default=8.0, help="server clock (API runs): video seconds per second")
    p.add_argument("--budget", default="256")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/app.json"))
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright  # optional (the `ui` extra): only the browser measurement uses it

    demo = launch(block=False, clock_speed=args.speed, idle_s=60)  # finished runs' sessions are released
    url = demo.local_url.rstrip("/")
    result = {"benchmark": "app", "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "command": "python -m app.measure " + " ".join(sys.argv[1:] if argv is None else argv)}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            print("1/4 send → first token in Chromium …", flush=True)
            result["send_to_first_token"] = send_to_first_token(browser, url, args.questions)
            print(json.dumps(result["send_to_first_token"]), flush=True)
            print("2/4 bounded memory over the video …", flush=True)
            result["memory_bounded"] = memory(url, args.minutes, "inf_mllm", args.budget)
            print("3/4 full-cache memory …", flush=True)
            result["memory_full"] = memory(url, args.full_minutes, "full", args.budget)
            print("4/4 two browser sessions at once …", flush=True)
            result["concurrent"] = concurrent(browser, url, args.concurrent_minutes)
            browser.close()
    finally:
        demo.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)} |
                     {k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in result.items()
                      if isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
