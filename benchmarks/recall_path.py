"""Recall's hot path on the model's thread: what a clip turn and a question cost beside the model's own work, at
1,000 stored spans (issue 50, item 4). `python -m benchmarks recall_path [--old-tree DIR] [--quick]`.

A session of the real SmolLM2-135M (fp32) with `inf_mllm+recall` and a folder store takes 1,000 clip-like turns
(24 tokens of input embeddings each), then answers questions, each between two more clip turns: named questions
(the engine resolved them to one old clip, linked exactly) and questions ranked by their keys (no words: the
probe forward, span scoring over every stored span, the gate). Every call of recall's bookkeeping is timed where
the model's thread makes it: storing a turn (`recall.make_span` + `SpanStore.add`), and per question `unlink` (at
the next turn), `resident_spans`, `choose` and `link`. The keyed question's probe forward is the model's work
and is left out.

`--old-tree DIR` runs this same file on the code of another checkout (in its own process, taking turns with this
one), so both sides are measured in one run on one machine: the figure is each side's median per question and
per turn, and their ratio.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPANS, QUESTIONS, BUDGET, TURN = 1000, 40, 256, 24
TIMED = (("inf_mllm.recall", "make_span"), ("inf_mllm.store", "SpanStore.add"), ("inf_mllm.recall", "unlink"),
         ("inf_mllm.recall", "resident_spans"), ("inf_mllm.recall", "choose"), ("inf_mllm.recall", "link"))


def measure(spans: int = SPANS, questions: int = QUESTIONS, log=print) -> dict:
    """{call: [seconds per call]} for recall's calls on the model's thread, and per-question totals; this
    checkout's code (run from its root)."""
    import importlib

    import torch

    from inf_mllm import StreamSession, load_model

    torch.manual_seed(0)
    spent: dict[str, list[float]] = {name: [] for _, name in TIMED}
    for module, name in TIMED:  # each call timed where the session makes it
        owner = importlib.import_module(module)
        cls, _, attr = name.rpartition(".")
        target = getattr(owner, cls) if cls else owner
        inner = getattr(target, attr)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - t0)
        setattr(target, attr, timed)
    model, tok = load_model()
    embed = model.get_input_embeddings()
    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        session = StreamSession(model, tok, "inf_mllm+recall", budget=BUDGET, store=folder, window=16)
        session.append(torch.arange(100, 120)[None], store=False)

        def clip(k):
            session.append(inputs_embeds=embed(torch.randint(100, 20000, (1, TURN), generator=g)),
                           meta={"clip": k, "start": 4.0 * (k - 1), "end": 4.0 * k}, vision=(2, TURN - 4))

        t0 = time.perf_counter()
        for k in range(1, spans + 1):
            clip(k)
            if k % 200 == 0:
                log(f"  {k} spans stored ({time.perf_counter() - t0:.0f} s)")
        for name in spent:
            spent[name].clear()  # the timed part: questions at `spans` stored spans
        per_question = {"named": [], "keys": []}
        for q in range(questions):
            kind = "named" if q % 2 == 0 else "keys"
            before = {name: len(calls) for name, calls in spent.items()}
            target = 1 + (q * 37) % (spans // 2)
            ids = torch.randint(100, 20000, (1, 9), generator=g)
            named = (lambda meta, t=target: meta.get("clip") == t) if kind == "named" else None
            session.append_question(ids, named=named)
            list(session.generate(2, eos_token_id=[]))
            clip(spans + q + 1)  # the next turn unlinks what the question linked
            per_question[kind].append(sum(sum(spent[n][before[n]:]) for n in ("unlink", "resident_spans", "choose",
                                                                              "link")))
        close = time.perf_counter()
        session.store.close()  # what is still being written (the old code wrote on the model's thread)
        close = time.perf_counter() - close
    turn = [a + b for a, b in zip(spent["make_span"], spent["SpanStore.add"], strict=False)]
    return {"calls": spent, "per_question": per_question, "turn": turn, "close_s": close}


def summary(result: dict) -> dict:
    med = statistics.median
    return {"named question ms": 1000 * med(result["per_question"]["named"]),
            "keyed question ms": 1000 * med(result["per_question"]["keys"]),
            "stored turn ms": 1000 * med(result["turn"]),
            **{f"{name} ms": 1000 * med(calls) for name, calls in result["calls"].items() if calls}}


def run(args) -> None:
    from .common import record, write

    spans, questions = (200, 10) if args.quick else (SPANS, QUESTIONS)
    sides = {"this checkout": None}
    if args.old_tree:
        sides[f"old tree ({_commit(args.old_tree)})"] = args.old_tree
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(2):  # the sides take turns, so a machine slowing down weighs on both
        for side, tree in sides.items():
            print(f"round {round_ + 1}: {side}", file=sys.stderr, flush=True)
            results[side].append(_run_in(tree or os.getcwd(), spans, questions))
    table = {}
    for side, runs in results.items():
        merged = {"calls": {k: sum((r["calls"][k] for r in runs), []) for k in runs[0]["calls"]},
                  "per_question": {k: sum((r["per_question"][k] for r in runs), []) for k in runs[0]["per_question"]},
                  "turn": sum((r["turn"] for r in runs), []), "close_s": max(r["close_s"] for r in runs)}
        table[side] = summary(merged)
    names = list(table)
    print(f"recall's bookkeeping on the model's thread, SmolLM2-135M fp32, {spans} stored spans, budget {BUDGET}; "
          f"medians over {2 * questions} questions and {2 * questions} turns:")
    for key in table[names[0]]:
        row = " | ".join(f"{table[n].get(key, float('nan')):9.3f}" for n in names)
        ratio = (f" | {table[names[1]][key] / table[names[0]][key]:.2f}x faster"
                 if len(names) == 2 and key in table[names[1]] and table[names[0]][key] > 0 else "")
        print(f"  {key:28s} | {row}{ratio}")
    records = [record("recall_path", side, BUDGET, "round_ms", value, key) for side, row in table.items()
               for key, value in row.items()]
    write(args.out, "recall_path", records, [])


def _commit(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _run_in(tree: str, spans: int, questions: int) -> dict:
    """`measure` on the code of the checkout in `tree`, in its own process (its own OpenMP setting)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "recall_path.json"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["PYTHONPATH"] = str(Path(tree).resolve())
        subprocess.run([sys.executable, "-P", __file__, str(out), str(spans), str(questions)], cwd=tree, env=env,
                       check=True)
        return json.loads(out.read_text())


if __name__ == "__main__":  # one side: run from the root of the checkout measured
    import streaming  # noqa: F401  (its OpenMP setting, before torch loads)

    result = measure(int(sys.argv[2]), int(sys.argv[3]), lambda text: print(text, file=sys.stderr, flush=True))
    Path(sys.argv[1]).write_text(json.dumps(result))
