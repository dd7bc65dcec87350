"""A text-stream demo of the core: facts stream in for many rounds, questions come now and then,
and the KV cache stays at its budget while a full cache would keep growing.

Run with `make demo` (or `python -m inf_mllm demo`). The streaming video demo replaces it once the
`streaming` layer lands.
"""

import random
import time

from .loader import load_model
from .session import StreamSession

WORDS = ("apple river candle falcon garden harbor island jacket kettle lemon marble needle orange pepper "
         "quartz rabbit saddle timber velvet wagon anchor basket cactus dragon engine feather guitar hammer "
         "igloo jungle koala ladder magnet nectar oyster parrot quiver rocket spider tunnel umbrella violin "
         "walnut yogurt zebra bottle cotton donkey ember forest glacier hollow").split()


def main(rounds: int = 40, budget: int = 256, policy: str = "inf_mllm", seed: int = 0) -> int:
    print("loading SmolLM2-135M-Instruct (first run converts the bundled GGUF, ~20 s) ...", flush=True)
    model, tok = load_model()
    session = StreamSession(model, tok, policy, budget=budget, window=32, bias=0.01)
    rng = random.Random(seed)
    words = rng.sample(WORDS, len(WORDS))
    facts, correct, asked = [], 0, 0
    per_token = session.cache.kv_bytes  # filled in after the first turn
    print(f"policy={policy} budget={budget} tokens; every round streams 3 facts, every 4th round asks one\n")
    print(f"{'round':>5} {'streamed':>9} {'kv_tokens':>9} {'kv_MB':>7} {'full_MB':>8}  question -> answer")
    t0 = time.perf_counter()
    for r in range(rounds):
        lines = []
        for _ in range(3):
            word, value = words[len(facts) % len(words)], rng.randint(100, 999)
            facts.append((word, value))
            lines.append(f"{word}: {value}")
        session.append_text("\n".join(lines) + "\n")
        per_token = per_token or session.kv_bytes / max(1, session.kv_tokens)
        note = ""
        if r % 4 == 3:
            word, value = rng.choice(facts[-12:])
            session.append_text(f"{word}:")
            answer = tok.decode([int(t[0]) for t in session.generate(5, eos_token_id=[])]).strip().split("\n")[0]
            session.discard_pending()
            session.append_text(f" {value}\n")
            ok = answer.startswith(str(value))
            correct, asked = correct + ok, asked + 1
            note = f"{word}? -> {answer!r} ({'right' if ok else f'wrong, {value}'})"
        kv_mb, full_mb = session.kv_bytes / 2**20, session.seen * per_token / 2**20
        print(f"{r + 1:>5} {session.seen:>9} {session.kv_tokens:>9} {kv_mb:>7.2f} {full_mb:>8.2f}  {note}")
    print(f"\n{session.seen} tokens streamed in {time.perf_counter() - t0:.1f} s; the cache held at most "
          f"{budget} tokens after each turn; {correct}/{asked} questions answered right (CPU, 135M model).")
    return 0
