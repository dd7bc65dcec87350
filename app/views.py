"""What the page shows of a chat: the memory plots' frames, the numbers line, the detector's boxes on the newest
clip, and the chat's lines."""

import pandas as pd

from models.detector import plural
from streaming.lines import clip_record

from .chat import Chat

MAX_POINTS = 400  # per plotted line


def say(history: list, text: str, role: str = "assistant") -> list:
    return [*history, {"role": role, "content": text}]


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
    return clip_record(clip.encoded.meta | {"clip": clip.index, "start": clip.start, "end": clip.end})
