"""What the page shows of a chat: the memory plots' frames, the numbers line, the detector's boxes on the newest
clip, the watches and their alerts, and the chat's lines."""

import pandas as pd

from models.detector import plural
from models.intent import clock
from streaming.lines import clip_record
from streaming.page_sources import PlaybackSource

from .chat import Chat

MAX_POINTS = 400  # per plotted line
KV, FULL, RSS, GPU, ALERT = "KV cache", "full cache, same clips", "RSS", "torch (GPU)", "alert"
STORE, STORE_CAP, WEIGHTS = "span store", "store bound", "weights"  # short: four fit in one row of the legend
# a plot's colour for each series: a limit paler than the line it limits
COLOURS = {KV: "#2563eb", FULL: "#f97316", "budget": "#fca5a5", RSS: "#1e3a8a", STORE: "#16a34a",
           STORE_CAP: "#86efac", WEIGHTS: "#9ca3af", GPU: "#9333ea", ALERT: "#dc2626"}


def say(history: list, text: str, role: str = "assistant") -> list:
    return [*history, {"role": role, "content": text}]


def store_of(chat: Chat | None):
    """The recall store holding every clip's KV (None: a policy without recall, or a closed session)."""
    session = getattr(chat, "session", None)
    return getattr(session, "store", None) if session is not None else None


def weights_mb(chat: Chat) -> float:
    """The model's parameters and buffers: loaded once per process, shared by every tab's session."""
    model = chat.adapter.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20


def series(chat: Chat | None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Long-format frames for the three plots: KV tokens, KV megabytes, process memory. Each frame holds its
    series one after another, in the order the plot draws them (the first drawn lowest), so where lines meet the
    one that matters is seen."""
    lines: tuple[dict, dict, dict] = ({}, {}, {})
    store = store_of(chat)
    samples = list(chat.samples) if chat else []
    weights = weights_mb(chat) if chat else None
    stride = max(1, len(samples) // MAX_POINTS)  # hours of video: every k-th sample, and always the last
    for i in [*range(0, len(samples), stride), *([len(samples) - 1] if (len(samples) - 1) % stride else [])]:
        s = samples[i]
        points = ((0, "budget", s["budget_tokens"] or None), (0, FULL, s["full_tokens"]), (0, KV, s["kv_tokens"]),
                  (1, FULL, s["full_mb"]), (1, KV, s["kv_mb"]),
                  (2, STORE_CAP, store.ram_cap / 2**20 if store is not None and store.ram_cap else None),
                  (2, WEIGHTS, weights), (2, STORE, s.get("store_mb")), (2, GPU, s["torch_mb"]), (2, RSS, s["rss_mb"]))
        for plot, name, value in points:
            if value is not None:
                lines[plot].setdefault(name, []).append((s["video_s"], value, name))
    lines[0][ALERT] = alert_marks(chat, lines[0])
    columns = ["video_s", "value", "series"]
    return tuple(pd.DataFrame([row for rows in by_name.values() for row in rows], columns=columns)
                 .astype({"video_s": float, "value": float}) for by_name in lines)


def alert_marks(chat: Chat | None, plotted: dict) -> list:
    """A vertical mark at each alert's video time on the token plot, from zero to the plot's top: one series whose
    line runs along the axis from the first sample and up and down at each alert (the plot sorts a line's points by
    time, keeping the order of points at one time). Present from the first sample on, as a point on the axis: the
    page's plot keeps the series it first drew, and one added later would get no colour."""
    rows = [row for series_ in plotted.values() for row in series_]
    if not rows:
        return []
    top = max(v for _, v, _ in rows)
    return [(min(t for t, _, _ in rows), 0, ALERT),
            *((a["video_t"], v, ALERT) for a in watched_alerts(chat) for v in (0, top, 0))]


def watched_alerts(chat: Chat | None) -> list[dict]:
    watches = getattr(chat, "watches", None)
    return list(watches.alerts) if watches is not None else []


def alert_items(chat: Chat | None) -> list[dict]:
    """The alerts the list shows, newest first: those with a snapshot (an alert of a clip without a frame is said in
    the chat only)."""
    return [a for a in reversed(watched_alerts(chat)) if a.get("snapshot")]


def alert_caption(alert: dict) -> str:
    return f"{clock(alert['video_t'])} {alert['alert']}: {alert['description']} (clip {alert['clip']})"


def alert_said(alert: dict) -> str:
    """An alert's chat line."""
    return (f"[{alert['video_t']:.1f} s] ALERT **{alert['alert']}**: {alert['description']} "
            f"(clip {alert['clip']}; {alert['provenance']})")


def watching(chat: Chat | None, watched: list[str]) -> str:
    """The watches line: what is watched for, and how often each fired."""
    if chat is not None and getattr(chat, "watches", None) is not None:
        said = [f"{w['text']} ({w['alerts']} alert{'' if w['alerts'] == 1 else 's'})" for w in chat.watches.listing()]
    else:
        said = [f"{text} (from Start)" for text in watched]
    return ("**watching** " + " · ".join(said)) if said else \
        "**watching** nothing: type what to watch for (a person, more than 2 cars, the car leaves) and press Watch"


def lap(chat: Chat, video_s: float) -> str:
    """Which play of a looping clip the video time is in ("" on the first): video time keeps counting across laps."""
    source = chat.source
    if not isinstance(source, PlaybackSource) or not source.duration or video_s <= source.duration:
        return ""
    return f" (lap {int(video_s // source.duration) + 1} of the {source.duration:.0f}-s clip)"


def last_answer(chat: Chat) -> str:
    a = chat.transcript[-1] if chat.transcript else None
    if a is None:
        return "none yet: type a question"
    if a.source != "model":
        return f"read off the clip log in {a.ttft_s:.2f} s"
    return f"{a.ttft_s:.2f} s to first token · {a.tokens_per_s:.1f} tokens/s"


def numbers(chat: Chat | None) -> str:
    if chat is None:
        return "No session yet: pick a source and press **Start**."
    t, s, store = chat.telemetry(), chat.samples[-1], store_of(chat)
    budget = chat.settings.budget if chat.budget_tokens else "none"
    if chat.budget_tokens and str(chat.budget_tokens) != str(budget).strip():
        budget = f"{budget} = {chat.budget_tokens} tokens"
    ingest = f"{t['ingest_speed']:.1f}× real time when busy" if t["ingest_speed"] else "–"
    kept = "" if store is None else f" · span store {store.ram_bytes / 2**20:.0f}" + (
        f" of {store.ram_cap / 2**20:.0f} MB" if store.ram_cap else " MB (no bound)")
    return (f"**video** {t['video_s']:.1f} s{lap(chat, t['video_s'])} · **clips** {t['clips']} "
            f"(dropped {t['dropped']}) · **ingest** {ingest}  \n"
            f"**KV** {s['kv_tokens']} tokens a layer, {s['kv_mb']:.1f} MB (budget {budget}) · "
            f"**RSS** {s['rss_mb']:.0f} MB: weights {weights_mb(chat):.0f} MB{kept}  \n"
            f"**last answer** {last_answer(chat)}")


def memory_note(chat: Chat | None) -> str:
    """Why process memory climbs and where it stops: the process plot's caption."""
    store = store_of(chat)
    if store is None:
        return ("RSS: the model weights, the KV cache, and the runtime with the freed memory its allocator keeps"
                + ("" if chat is None else "; this policy keeps no span store"))
    video_s, held, cap = chat.engine.video_t, store.ram_bytes / 2**20, (store.ram_cap or 0) / 2**20
    bound = ("no bound" if not cap else f"bound {cap:.0f} MB" if held >= 0.99 * cap or not held else
             f"bound {cap:.0f} MB, reached near {cap * video_s / held / 60:.0f} min of video")
    return (f"RSS: model weights {weights_mb(chat):.0f} MB + span store, every clip's KV kept for recall "
            f"({held:.0f} MB; {bound}) + KV cache + the runtime with the freed memory its allocator keeps")


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
    return clip_record(clip.encoded.meta | {"clip": clip.index, "start": clip.start, "end": clip.end})
