"""Fingerprints of every policy path, so a change that must not change behaviour can prove it did not.

A fingerprint is what a user of a path would see and what decides it: after every turn, the logits of its
last position (a SHA-256 of their fp32 bytes, and their top 5), the KV length (mean and per layer, and the
position the next token takes) and the tokens seen; every answer's greedy tokens with the margin between the
two best logits at each step; which stored clips recall linked. Paths:

- **text**: every registered policy, every listed combination and every recall kind on the real SmolLM2-135M
  (fp32): a system turn, clip-like turns of input embeddings with a vision span, questions kept and
  left (`keep=False`), one named to recall; a folder store reopened and restored; K/V kept as transformers'
  dynamic layers do (`static=False`).
- **multimodal**: a tiny random Qwen2-VL checkpoint (multimodal RoPE), clips of random frames, with the
  policies whose positions work differently there (eviction, merging, per-layer budgets, decode eviction,
  recall).
- **stream-qa**: the bundled clip through the real command (`--fast --json`), with and without recall, at
  `make demo`'s budget; answers, KV figures and what each question was read as (timings left out).

`python -m benchmarks fingerprint` writes them (`--out`); `--old-tree DIR` also runs this file against another
checkout (in its own process, with that checkout's code) and compares the two, path by path: identical means
the same bytes of every logit. This file uses only what both sides have (`StreamSession`, `load_model`,
`HFVideo`, `stream-qa`), so it runs unchanged on the code before a change. `tests/test_fingerprint.py` checks the
committed record within a tolerance on any machine (a different CPU rounds differently).
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUDGET = 24  # tokens per layer: every turn evicts
POLICIES = (
    "full", "window", "streaming_llm", "h2o", "inf_mllm", "inf_mllm_plus", "snapkv", "vl_cache", "prefixkv",
    "elastic",
    "inf_mllm+merge", "inf_mllm+vl_cache_budgets", "inf_mllm+prefixkv_budgets", "inf_mllm+vl_cache_budgets+merge",
    "inf_mllm_plus+vl_cache_budgets", "snapkv+vl_cache_budgets", "vl_cache+merge", "elastic+prefixkv_budgets",
    "h2o+vl_cache_budgets",
    "inf_mllm+recall", "inf_mllm+recall_keys", "inf_mllm+recall_oracle", "inf_mllm+recall_random",
    "inf_mllm+merge+recall",
)
MULTIMODAL = ("full", "streaming_llm", "inf_mllm", "inf_mllm+merge", "inf_mllm+vl_cache_budgets", "h2o",
              "inf_mllm+recall")
CLI_RUNS = {
    "recall": ["--budget", "96"],
    "inf_mllm": ["--budget", "96", "--policy", "inf_mllm"],
}
ANSWER_FIELDS = ("video_t", "question", "answer", "kv_tokens", "kv_mb", "recalled", "looked_up", "source")


def logits_print(logits) -> dict:
    import torch

    row = logits.reshape(-1, logits.shape[-1])[0].float()
    top = row.topk(5)
    return {"sha": hashlib.sha256(row.contiguous().numpy().tobytes()).hexdigest()[:16],
            "top": [[int(i), float(v)] for i, v in zip(top.indices, top.values, strict=True)],
            "finite": bool(torch.isfinite(row).all())}


def cache_print(session) -> dict:
    cache = session.cache
    return {"kv_tokens": session.kv_tokens, "seq": cache.get_seq_length(), "seen": session.seen,
            "lengths": [layer.get_seq_length() for layer in cache.layers]}


def answer_print(session, tokens: int) -> dict:
    """Greedy tokens with each step's margin (the best logit less the second: a tie a CPU may break either way)."""
    logits = session._logits
    out, margins = [], []
    for step, token in enumerate(session.generate(tokens, eos_token_id=[])):
        out.append(int(token[0]))
        if step == 0:
            top = logits[0].float().topk(2).values
            margins.append(float(top[0] - top[1]))
    return {"tokens": out, "first_margin": margins[0] if margins else None, **cache_print(session)}


def text_path(model, tokenizer, policy: str, store=None, static: bool = True) -> list[dict]:
    """One stream on SmolLM2: a system turn, 6 clip-like turns (embeddings, a vision span), 3 questions."""
    import torch

    from inf_mllm import StreamSession
    from inf_mllm.policies import policy_options

    g = torch.Generator().manual_seed(7)
    options = {"window": 6} if "window" in policy_options(policy) else {}
    session = StreamSession(model, tokenizer, policy, budget=BUDGET, store=store, static=static, **options)
    steps = []

    def turn(name, logits):
        steps.append({"step": name, "logits": logits_print(logits[:, -1]), **cache_print(session)})

    with torch.inference_mode():
        turn("system", session.append(torch.randint(100, 20000, (1, 12), generator=g), store=False))
        for clip in range(1, 7):
            ids = torch.randint(100, 20000, (1, 18), generator=g)
            embeds = model.get_input_embeddings()(ids)
            meta = {"clip": clip, "start": 4.0 * (clip - 1), "end": 4.0 * clip}
            turn(f"clip {clip}", session.append(inputs_embeds=embeds, vision=(2, 14), meta=meta))
            if clip in (2, 4, 6):
                ids = torch.randint(100, 20000, (1, 7), generator=g)
                extra = {"keep": clip != 4}
                if session.recall is not None:
                    extra["named"] = (lambda meta: meta.get("clip") == 1) if clip == 6 else None
                    extra["oracle"] = lambda meta: meta.get("clip") == 1
                turn(f"question after clip {clip}", session.append_question(ids, **extra))
                recalled = [i for i, _ in session.last_recalled]
                steps.append({"step": f"answer after clip {clip}", "recalled": recalled, **answer_print(session, 5)})
    if session.store is not None:
        session.store.close()  # its folder is free for the next session
    return steps


def restore_path(model, tokenizer, folder: str) -> list[dict]:
    """A recall stream written to a folder store, then reopened by a new session and restored."""
    import torch

    from inf_mllm import StreamSession

    steps = text_path(model, tokenizer, "inf_mllm+recall", store=folder)
    session = StreamSession(model, tokenizer, "inf_mllm+recall", budget=BUDGET, store=folder, window=6)
    with torch.inference_mode():
        session.append(torch.arange(100, 112)[None], store=False)
        restored = session.restore()
        logits = session.append_question(torch.arange(200, 207)[None])
    steps.append({"step": "restored", "restored": restored, "logits": logits_print(logits[:, -1]),
                  **answer_print(session, 5)})
    return steps


def multimodal_path(adapter, policy: str) -> list[dict]:
    import numpy as np
    import torch

    from inf_mllm.policies import policy_options

    rng = np.random.default_rng(3)
    options = {"window": 6} if "window" in policy_options(policy) else {}
    session = adapter.new_session(policy, budget=3 * adapter.turn_tokens() // 2 if policy != "full" else None,
                                  **options)
    steps = []
    with torch.inference_mode():
        for clip in range(1, 6):
            frames = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
            adapter.add_clip(session, frames, [4.0 * (clip - 1) + i for i in range(4)], clip)
            steps.append({"step": f"clip {clip}", "logits": logits_print(session._logits), **cache_print(session)})
            if clip in (3, 5):
                ids = adapter.question_turn("what is in the video?")
                extra = {"named": (lambda meta: meta.get("clip") == 1)} if session.recall is not None else {}
                session.append_question(ids, **extra)
                recalled = [i for i, _ in session.last_recalled]
                steps.append({"step": f"answer after clip {clip}", "recalled": recalled,
                              "logits": logits_print(session._logits), **answer_print(session, 4)})
    return steps


def cli_path(args: list[str]) -> list[dict]:
    """stream-qa on the bundled clip, as `make demo` runs it, every answer's fields but its timings."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", "import sys; from streaming.cli import main; sys.exit(main())",
                           "--fast", "--json", *args], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        return [{"step": "exit", "code": done.returncode, "stderr": done.stderr[-400:]}]
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [{"step": f"answer {i}", **{k: a.get(k) for k in ANSWER_FIELDS}} for i, a in enumerate(answers)]


def fingerprints(log=print) -> dict:
    """{path: [steps]} for every path (this checkout's code: run from its root)."""
    import torch

    torch.manual_seed(0)
    from inf_mllm import load_model
    from models.hf import tiny
    from models.hf.adapter import HFVideo

    out = {}
    model, tokenizer = load_model()
    for policy in POLICIES:
        log(f"text {policy}")
        out[f"text {policy}"] = text_path(model, tokenizer, policy)
    log("text inf_mllm dynamic")
    out["text inf_mllm static=False"] = text_path(model, tokenizer, "inf_mllm", static=False)
    with tempfile.TemporaryDirectory() as tmp:
        log("text restore")
        out["text inf_mllm+recall restored"] = restore_path(model, tokenizer, str(Path(tmp) / "store"))
        adapter = HFVideo(tiny.save("qwen2_vl", Path(tmp) / "qwen2_vl"))
        for policy in MULTIMODAL:
            log(f"qwen2_vl {policy}")
            out[f"qwen2_vl {policy}"] = multimodal_path(adapter, policy)
    for name, args in CLI_RUNS.items():
        log(f"stream-qa {name}")
        out[f"stream-qa {name}"] = cli_path(args)
    return out


def compare(mine: dict, theirs: dict, tolerance: float | None = None) -> list[str]:
    """What differs between two fingerprint sets, one line each (nothing: identical). With `tolerance`, logits
    count as equal when their top 5 ids match and values lie within it (another machine's rounding), and
    answer tokens only up to the first step whose margin is below 1e-3 (a near tie either CPU may break)."""
    diffs = []
    for path in sorted(set(mine) | set(theirs)):
        a, b = mine.get(path), theirs.get(path)
        if a is None or b is None:
            diffs.append(f"{path}: only on one side")
            continue
        if len(a) != len(b):
            diffs.append(f"{path}: {len(a)} vs {len(b)} steps")
            continue
        for x, y in zip(a, b, strict=True):
            diffs += [f"{path} / {x.get('step')}: {d}" for d in _step_diffs(x, y, tolerance)]
    return diffs


def _step_diffs(x: dict, y: dict, tolerance: float | None) -> list[str]:
    out = []
    for key in sorted(set(x) | set(y)):
        u, v = x.get(key), y.get(key)
        if key == "logits" and tolerance is not None and u and v:
            # ranked values within the tolerance (two near-equal logits may swap ids)
            far = max(abs(p - q) for (_, p), (_, q) in zip(u["top"], v["top"], strict=True))
            if far > tolerance or u["finite"] != v["finite"]:
                out.append(f"logits top {u['top'][:2]} vs {v['top'][:2]}")
        elif key == "tokens" and tolerance is not None and (x.get("first_margin") or 1.0) < 1e-3:
            continue
        elif key == "first_margin" and tolerance is not None:
            continue
        elif u != v:
            out.append(f"{key}: {str(u)[:80]} vs {str(v)[:80]}")
    return out


def run(args) -> None:
    """`python -m benchmarks fingerprint [--old-tree DIR] [--out DIR]`."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = fingerprints(lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    record = {"machine": _machine(), "fingerprints": mine}
    (out_dir / "fingerprint.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(mine)} paths, {sum(len(s) for s in mine.values())} steps -> {out_dir / 'fingerprint.json'}")
    if args.old_tree:
        theirs = _run_in(args.old_tree)
        diffs = compare(mine, theirs)
        (out_dir / "fingerprint_old_tree.json").write_text(json.dumps(
            {"machine": _machine(args.old_tree), "fingerprints": theirs}, indent=1) + "\n")
        print(f"against {args.old_tree}: " + ("identical (every path, every step, every logit's bytes)"
                                              if not diffs else f"{len(diffs)} differences"))
        for line in diffs[:200]:
            print("  " + line)


def _machine(tree: str | None = None) -> dict:
    try:
        from benchmarks.common import machine
    except ImportError:  # a checkout from before records named their machine
        return {}
    return machine(tree)


def _run_in(tree: str) -> dict:
    """This file's `fingerprints` on the code of the checkout in `tree`, in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "fingerprint.json"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["PYTHONPATH"] = str(Path(tree).resolve())
        subprocess.run([sys.executable, "-P", __file__, str(result)], cwd=tree, env=env, check=True)
        return json.loads(result.read_text())


if __name__ == "__main__":  # the other side of --old-tree: run from that checkout's root
    import streaming  # noqa: F401  (its OpenMP setting, before torch loads)

    Path(sys.argv[1]).write_text(json.dumps(fingerprints(lambda text: print(f"  old: {text}", file=sys.stderr,
                                                                            flush=True))))
