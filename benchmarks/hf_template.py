"""How far a streamed conversation is from the one the model's own processor builds (issue 48), per family on its
tiny random checkpoint: two clips (1 fps; 2.5 fps over 1.6 s) and a question, streamed with `full`, against the
model's one forward over the token ids the family's processor recorded for the same messages and frame times
(`tests/fixtures/hf/conversation.*`). Largest logit difference at the question's last position, and whether the
next five greedy tokens agree; by the engine's call (`append_clip` with the clip's start and end) and by the
library's (`add_clip` with the frames' times only); and with our clip caption turned on (`HFVideo(caption=True)`),
its distance from the processor's conversation. Uses only calls older checkouts have, so the same file measures them
too (`--old-tree`)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"


def reference(adapter, frames, clips, conv) -> torch.Tensor:
    """The model's logits over the processor's ids and pixel values of the conversation "asked" (its first two
    clips)."""
    family = adapter.family.name
    ids = conv[f"{family}.asked.input_ids"]
    pix = conv[f"{family}.whole.{'pixel_values' if family == 'smolvlm' else 'pixel_values_videos'}"]
    pix = pix[: len(pix) * len(clips) // 3]
    if family.startswith("qwen"):
        extra = {k: conv[f"{family}.asked.{k}"] for k in ("video_grid_thw", "second_per_grid_ts")
                 if f"{family}.asked.{k}" in conv}
        inputs = dict(pixel_values_videos=pix, mm_token_type_ids=(ids == adapter.placeholder_id).int() * 2, **extra)
    elif family.startswith("llava"):
        inputs = dict(pixel_values_videos=pix)
    else:
        inputs = dict(pixel_values=pix.flatten(0, 1)[None])
    with torch.inference_mode():
        logits = adapter.model(input_ids=ids, **inputs).logits[0, -1]
        greedy = adapter.model.generate(input_ids=ids, **inputs, max_new_tokens=5, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, ids.shape[1]:].tolist()
    return logits, greedy


def streamed(adapter, frames, clips, question: str, library: bool):
    session = adapter.new_session("full")
    for i, (order, times, start, end) in enumerate(clips):
        if library:
            adapter.add_clip(session, frames[order], times, i + 1)
        else:
            adapter.append_clip(session, adapter.encode(frames[order], times), i + 1, start, end)
    with torch.inference_mode():
        logits = session.append_question(adapter.question_turn(question))
    greedy = [int(t[0]) for t in session.generate(5, eos_token_id=[])]
    return logits.reshape(-1, logits.shape[-1])[-1], greedy


def measure() -> list[dict]:
    from models.hf import tiny
    from models.hf.adapter import HFVideo

    conv = load_file(FIXTURES / "conversation.safetensors")
    script = json.loads((FIXTURES / "conversation.json").read_text())
    frames = load_file(FIXTURES / "recorded.safetensors")["frames"].numpy()
    clips, question = script["clips"][:2], script["questions"][0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llava_onevision", "smolvlm", "smolvlm+video_template", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                       "llava_next_video"):
            folder = tiny.save(family.split("+")[0], Path(tmp) / family)
            if family.endswith("+video_template"):  # the checkpoint carries the template SmolVLM's processor uses
                from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

                (folder / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE)
            try:
                adapter = HFVideo(folder)
            except ValueError as err:  # a checkout that refuses the family
                print(f"{family}: {err}", file=sys.stderr)
                rows += [{"family": family, "path": path, "max_logit_diff": float("nan"), "same_greedy": False}
                         for path in ("engine", "library")]
                continue
            want, want_greedy = reference(adapter, frames, clips, conv)
            paths = ["engine", "library"] + (["engine+caption"] if hasattr(adapter, "caption") else [])
            for path in paths:
                adapter.caption = path.endswith("+caption")  # our "Clip N at M:SS." in each clip turn (opt-in)
                try:
                    got, greedy = streamed(adapter, frames, clips, question, library=path == "library")
                except ValueError as err:  # a checkout that cannot lay the clip out at all
                    print(f"{family} ({path}): {err}", file=sys.stderr)
                    rows.append({"family": family, "path": path, "max_logit_diff": float("nan"), "same_greedy": False})
                    continue
                rows.append({"family": family, "path": path, "max_logit_diff": float((got - want).abs().max()),
                             "same_greedy": greedy == want_greedy})
    return rows


def run(args) -> None:
    from .common import machine, print_table, record, write

    trees = {"this checkout": None}
    if args.old_tree:
        trees[f"old tree ({machine(args.old_tree)['commit']})"] = args.old_tree
    records = []
    for label, tree in trees.items():
        if tree is None:
            rows = measure()
        else:  # the old checkout's adapter, this checkout's tiny checkpoints, fixtures and this file
            tiny_now = str(Path(__file__).resolve().parents[1] / "models" / "hf" / "tiny.py")
            code = (f"import sys, json; sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}, {tree!r}]; "
                    "import models.hf.tiny as old; import importlib.util as u; "
                    f"spec = u.spec_from_file_location('tiny_now', {tiny_now!r}); "
                    "now = u.module_from_spec(spec); spec.loader.exec_module(now); old.save = now.save; "
                    "import hf_template; print(json.dumps(hf_template.measure()))")
            out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True, cwd=tree)
            rows = json.loads(out.stdout.strip().splitlines()[-1])
        for row in rows:
            name = f"{row['family']} ({row['path']}, {label})"
            records += [record("hf_template", name, None, "max_logit_diff", row["max_logit_diff"], 0),
                        record("hf_template", name, None, "same_greedy", float(row["same_greedy"]), 0)]
    print_table(records, ["max_logit_diff", "same_greedy"])
    print("wrote", write(args.out, "hf_template", records, []))
