"""What the page's events do: start a session from the chosen source and settings (a changed setting restarts it),
ask and stream the answer, set a watch, tick (plots, notices, alerts, the detector's view), show a picked alert and
ask about it, take the browser camera's frames, and let a session go when its tab closes or idles. One `Handlers` per
page (`ui.build`), holding its open chats."""

import json
import queue
import tempfile
import time
import uuid
from dataclasses import fields
from pathlib import Path

import gradio as gr
import numpy as np

from models.intent import clock
from streaming.errors import one_line
from streaming.events import Done, Handler, Started, Token, Unanswered
from streaming.hosted import Host
from streaming.page_sources import BrowserCamera, PlaybackSource
from streaming.provenance import notes
from streaming.questions import MAX_QUESTION_CHARS
from streaming.settings import BadInput, Settings
from streaming.source_spec import SourceSpec
from streaming.sources import SourceError, bundled_clip
from streaming.watches import MAX_WATCHES, watcher

from .chat import Chat
from .views import (
    alert_caption,
    alert_items,
    alert_said,
    memory_note,
    numbers,
    say,
    series,
    sighted,
    sighted_label,
    watching,
)

VIDEO_TYPES = {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi"}
TRANSCRIPTS = Path(tempfile.gettempdir()) / "inf_mllm_app"
PICKED_HOLD_S = 10.0  # a picked alert's frame stays in the detector's view this long before the newest clip's
WAIT_LINE_S = 1.0  # how often a question without its first token says again what it waits for
SETTLE_S = 10.0  # the most a tick waits for the page to show an answer's last update before writing the chat


def check_upload(path: str | None, max_mb: float) -> Path:
    """Type and size, from the name and the first bytes, before anything decodes the file."""
    if not path:
        raise BadInput("choose a video file to upload first")
    p = Path(path)
    name = p.name
    if p.suffix.lower() not in VIDEO_TYPES:
        raise BadInput(f"{name} is not a video (accepted: {', '.join(sorted(VIDEO_TYPES))})")
    size = p.stat().st_size
    if size == 0:
        raise BadInput(f"{name} is empty (0 bytes)")
    if size > max_mb * 2**20:
        raise BadInput(f"{name} is {size / 2**20:.1f} MB; the limit is {max_mb:g} MB")
    head = p.read_bytes()[:16]
    if not (head[4:8] == b"ftyp" or head[:4] in (b"\x1a\x45\xdf\xa3", b"RIFF") or head[4:8] in (b"moov", b"mdat")):
        raise BadInput(f"{name} does not start like a video file (mp4, webm, mkv, avi)")
    return p


def number(text, kind, name):
    """An optional number typed in a box: empty means the policy's default."""
    text = str(text if text is not None else "").strip()
    try:
        return kind(text) if text else None
    except ValueError:
        raise BadInput(f"{name} {text!r} is not a{'n integer' if kind is int else ' number'}") from None


# the settings the page lays out by hand (the model and the cache); every other one gets a control of its own
PAGE_SETTINGS = ("model", "policy", "budget", "bias", "window")
MORE_SETTINGS = tuple(f.name for f in fields(Settings) if f.name not in PAGE_SETTINGS)


def write_transcript(chat: Chat) -> str:
    TRANSCRIPTS.mkdir(exist_ok=True)
    if chat.transcript_path is None:
        chat.transcript_path = TRANSCRIPTS / f"transcript-{uuid.uuid4().hex[:12]}.jsonl"
    chat.transcript_path.write_text("".join(json.dumps(a.as_dict()) + "\n" for a in chat.transcript))
    return str(chat.transcript_path)


def answered(stamp: str, a) -> str:
    """An answer's chat line: the answer, then its timings, KV size and what was looked up and linked. An answer
    read off the clip log decoded no token, so it shows no decoding speed (it would read 0 tokens/s)."""
    logged = a.source != "model"
    said = [f"{a.ttft_s:.2f} s to first token", "read off the clip log" if logged else f"{a.tokens_per_s:.0f} tokens/s",
            f"{a.kv_tokens} KV tokens", notes(a).removesuffix("; read off the clip log") if logged else notes(a)]
    return f"{stamp}{a.answer}\n\n*{' · '.join(p for p in said if p)}*"


def looped(chat) -> str | None:
    """A chat notice the first time the looping player starts the clip again: the page's video time keeps counting
    past the clip's length, which would otherwise puzzle a viewer (the numbers line shows the lap from then on)."""
    source = getattr(chat, "source", None)
    if not isinstance(source, PlaybackSource) or source.lap < 1 or chat.lap_said:
        return None
    chat.lap_said = True
    return (f"↻ {chat.label} looped: lap {source.lap + 1} begins at video time {source.now():.1f} s. Video time keeps "
            f"counting past the clip's {source.duration:.1f} s and the cache takes the frames in again as new video; "
            f"the numbers line shows the lap.")


def settled(chat, history: list) -> bool:
    """Whether the tick may write the chat. It writes the chat it was handed, the page's as it was when the tick fired:
    while a question is being answered, or before the answer's last update has reached the page, that chat is behind,
    and writing it would overwrite the answer (its timings line once went missing that way, a lap notice in its
    place). Notices and alerts wait for the next tick; after `SETTLE_S` a chat without the answer (cleared) is taken."""
    if chat is None or chat.asking or chat.in_flight:
        return False
    if chat.answer_shown is None:
        return True
    last_line, at = chat.answer_shown
    return time.monotonic() - at > SETTLE_S or any(last_line in str(m) for m in history[-4:])


def new_alerts(chat) -> list[str]:
    """The chat lines of the alerts fired since the last tick."""
    if chat is None:
        return []
    alerts = chat.watches.alerts
    fresh, chat.alerts_said = alerts[chat.alerts_said:], len(alerts)
    return [alert_said(a) for a in fresh]


def alerts_list(chat) -> tuple:
    """The alerts list (its snapshots and captions, newest first) and its visibility; unchanged: no update."""
    items = alert_items(chat)
    if chat is None or [a["id"] for a in items] == [a["id"] for a in chat.listed]:
        return (gr.skip(),)
    chat.listed = items
    return (gr.update(value=[(a["snapshot"], alert_caption(a)) for a in items], visible=True,
                      label=f"Alerts ({len(items)}, newest first; click one to see its frame and ask about it)"),)


class Handlers:
    """The events' functions of one page; `open_chats` by browser session, so that closing a tab ends its engine
    at once."""

    def __init__(self, max_upload_mb: float = 200, clock_speed: float = 1.0, host: Host | None = None):
        self.max_upload_mb, self.clock_speed = max_upload_mb, clock_speed
        self.host = host or Host()  # the models the page offers, each loaded once with its pool
        self.open_chats: dict[str, Chat] = {}

    def release(self, chat: Chat | None) -> None:
        """Idle timeout or a replaced session: stop the engine and drop every reference to its cache."""
        if chat is not None:
            chat.close()
            for key in [k for k, c in self.open_chats.items() if c is chat]:
                del self.open_chats[key]

    def leave(self, request: gr.Request):
        """The tab closed: Gradio would keep its state an hour; the engine and its cache go now."""
        self.release(self.open_chats.get(request.session_hash))

    def source(self, kind, clip, upload, camera, settings: Settings):
        """(label, make(stop) -> source, the player's video or None) for the chosen source."""
        if kind in ("Bundled clip", "Upload"):
            path = bundled_clip(clip) if kind == "Bundled clip" else check_upload(upload, self.max_upload_mb)
            label = clip if kind == "Bundled clip" else path.name
            spec = SourceSpec("player", str(path), fps=settings.fps, speed=self.clock_speed)
            return label, spec.open, str(path)
        if kind == "Device camera":
            index = int(camera or 0)
            return f"device camera {index}", SourceSpec("webcam", index, fps=settings.fps).open, None
        if kind == "Browser camera":
            return "browser camera", SourceSpec("browser-camera", fps=settings.fps).open, None
        raise BadInput(f"unknown source {kind!r}")

    def start(self, chat, watched, history, kind, clip, upload, camera, model, policy, budget, bias, window, *more,
              request: gr.Request = None):
        """`watched`: the watches set on the page, judged from the first clip; `more`: the other settings' controls,
        in `MORE_SETTINGS`' order (a control left empty: the default)."""
        self.release(chat)
        try:
            given = {k: v for k, v in zip(MORE_SETTINGS, more, strict=False) if v is not None and v != ""}
            settings = Settings(model=model, policy=policy, budget=str(budget).strip(),
                                bias=number(bias, float, "bias"), window=number(window, int, "window"), **given)
            label, make, video = self.source(kind, clip, upload, camera, settings)
            name = f"app-{uuid.uuid4().hex[:12]}"  # its alerts' ids and its snapshots' folder
            chat = Chat(self.host, settings, make, label, name=name, watches=watched or (),
                        snapshots=TRANSCRIPTS / "alerts" / name)
            if request is not None:
                self.open_chats[request.session_hash] = chat
        except (BadInput, SourceError) as err:
            return None, say(history, f"⚠ {err}"), gr.update(value=None)
        note = f"New session: {label} · {settings.describe()}. Ask about what has played so far."
        return chat, say(history, note), gr.update(value=video)

    def restart(self, chat, watched, history, kind, clip, upload, camera, model, policy, budget, bias, window, *more,
                request: gr.Request = None):
        """A changed model or cache setting starts a new session (only when one is running)."""
        if chat is None:
            return chat, gr.skip(), gr.skip()
        return self.start(chat, watched, history, kind, clip, upload, camera, model, policy, budget, bias, window,
                          *more, request=request)

    @staticmethod
    def watch(chat, watched, history, text):
        """A watch typed in the box: set on the running session at once, and kept for the sessions Start opens."""
        text = " ".join((text or "").split())
        if not text:
            return watched, say(history, "⚠ Type what to watch for first (a person, more than 2 cars, the car "
                                         "leaves)."), gr.skip(), gr.skip()
        try:
            if len(watched) >= MAX_WATCHES:
                raise ValueError(f"at most {MAX_WATCHES} watches on a stream")
            running = chat is not None and not chat.finished.is_set()
            # read now (a watch that cannot be watched is said at once); set when Start opens a session, if none runs
            watch = (chat.watches.add(text) if running else watcher(text, 0)).watch
        except ValueError as err:
            return watched, say(history, f"⚠ {one_line(err)}"), gr.skip(), gr.skip()
        watched = [*watched, text]
        when = "from the next clip on" if running else "from the first clip once you press Start"
        where = f" where the detector counts {' and '.join(watch.things)}" if watch.things else ""
        asked = f" (the model is asked {watch.question!r} after each clip{where})"
        how = "" if watch.judged_by == "detector" else asked
        note = f"Watching for {text!r} {when}{how}: an alert is said here, listed under the chat and marked on the " \
               "graph."
        return watched, say(history, note), "", watching(chat if running else None, watched)

    @staticmethod
    def pick(chat, event: gr.SelectData):
        """An alert clicked in the list: its frame in the detector's view, and the question about it in the box."""
        listed = getattr(chat, "listed", [])
        if not 0 <= event.index < len(listed):
            return gr.skip(), gr.skip()
        alert = listed[event.index]
        chat.held_until, chat.drawn = time.monotonic() + PICKED_HOLD_S, False  # then the newest clip's again
        frame = gr.update(value=(alert["snapshot"], []), label=f"Alert · {alert_caption(alert)}", visible=True)
        return f"what happened at {clock(alert.get('snapshot_t') or alert['start'])}?", frame

    @staticmethod
    def refusal(chat, text: str) -> str | None:
        """Why a question is not asked (one line), or None."""
        if not text:
            return "⚠ Type a question first."
        if len(text) > MAX_QUESTION_CHARS:
            return f"⚠ That question is {len(text):,} characters; the limit is {MAX_QUESTION_CHARS:,}."
        if chat is None or chat.finished.is_set():
            why = "the video has ended" if chat else "no video is loaded"
            return f"⚠ Cannot answer: {why}. Pick a source and press Start."
        return None

    def ask(self, chat, history, text):
        text = (text or "").strip()
        history = say(history, text or "(empty)", "user")
        refused = self.refusal(chat, text)
        if refused:
            yield chat, say(history, refused), gr.skip(), ""
            return
        chat.asking += 1
        try:
            at = chat.source.asked_at()  # what ask() takes by itself; kept to say what the question waits for
            out = chat.ask(text, at=at)
            history = say(history, "…")
            yield chat, history, gr.skip(), ""
            shown, waiting = _Shown(chat, history), "…"  # what the chat shows until the first token
            while True:
                try:
                    event = out.get(timeout=WAIT_LINE_S)
                except queue.Empty:
                    if (line := waiting_line(chat, at)) != waiting:
                        waiting, history[-1] = line, {"role": "assistant", "content": line}
                        yield chat, history, gr.skip(), gr.skip()
                    continue
                if (update := event.to(shown)) is not None:
                    yield update
                if event.final:
                    chat.answer_shown = str(shown.history[-1]["content"]).splitlines()[-1], time.monotonic()
                    return
        finally:
            chat.asking -= 1

    @staticmethod
    def tick(video: gr.Video, chat, history, boxes_on, watched):
        """The plots (shown from a session's first sample on, in place of the note before it), the numbers, the
        chat's notices and alerts, the alerts list and the watches line, and the detector's view."""
        position = getattr(video, "playback_position", None) if video is not None else None
        if chat is not None and position is not None and isinstance(chat.source, PlaybackSource):
            chat.source.report(position)
        # an empty frame would leave the plot blank for good (Gradio 6.31), so no data: no update
        if chat is not None:
            tokens, mb, process = series(chat)
            plots = (gr.update(value=tokens, visible=True), gr.update(value=mb, visible=True),
                     gr.update(value=process, visible=True, caption=memory_note(chat)), gr.update(visible=False))
        else:
            plots = (gr.skip(),) * 4
        notices, chat_out = chat.notices if chat else [], gr.skip()
        said = [*notices, *filter(None, [looped(chat)]), *new_alerts(chat)] if settled(chat, history) else []
        if said:
            for n in said:
                history = say(history, n)
            notices.clear()
            chat_out = history
        clip, held = getattr(chat, "shown", None), chat is not None and time.monotonic() < chat.held_until
        drawn = gr.skip() if held or boxes_on and chat is not None and clip is chat.drawn else \
            gr.update(value=sighted(chat, boxes_on), label=sighted_label(chat), visible=boxes_on)
        if chat is not None and not held:
            chat.drawn = clip if boxes_on else None  # redrawn only when a new clip comes in
        return *plots, numbers(chat), chat_out, drawn, *alerts_list(chat), watching(chat, watched)

    @staticmethod
    def push_frame(frame, chat):
        if chat is not None and isinstance(chat.source, BrowserCamera) and frame is not None:
            chat.source.push(np.asarray(frame))


def waiting_line(chat, at: float | None) -> str:
    """The placeholder of a question still without its first token: "…", or what it waits for when the stream has
    not yet seen the moment it asks about (a busy CPU's ingest behind the player), so a slow answer says why."""
    seen = chat.engine.video_t
    if at is None or seen >= at:
        return "…"
    return f"… waiting for the stream to reach {clock(at)} (seen up to {clock(seen)})"


class _Shown(Handler):
    """A question's events as the chat shows them: its answer's text as it comes, stamped with its video time."""

    def __init__(self, chat, history: list):
        self.chat, self.history, self.text, self.stamp = chat, history, "", ""

    def on_started(self, event: Started) -> None:
        self.stamp = f"[{event.video_t:.1f} s] "

    def on_token(self, event: Token) -> tuple:
        self.text += event.text
        self.history[-1] = {"role": "assistant", "content": self.stamp + self.text}
        return self.chat, self.history, gr.skip(), gr.skip()

    def on_done(self, event: Done) -> tuple:
        self.history[-1] = {"role": "assistant", "content": answered(self.stamp, event.answer)}
        return self.chat, self.history, write_transcript(self.chat), gr.skip()

    def on_unanswered(self, event: Unanswered) -> tuple:
        self.history[-1] = {"role": "assistant", "content": "⚠ The stream ended before this question's turn."}
        return self.chat, self.history, gr.skip(), gr.skip()
