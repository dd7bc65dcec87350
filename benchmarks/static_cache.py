"""K/V in preallocated buffers written in place against transformers' dynamic layers (issue 23, item 1).

SmolLM2 on the Gutenberg stream, two sessions per policy on the same weights, one with buffers
(`inf_mllm/buffer.py`, the default) and one with `static=False` (every append a `torch.cat`), streamed to
the same point; then question rounds (a 32-token question, a 32-token answer) alternate between the two,
so both see the same machine load. Medians of decode ms per token and time to first token, their ratio,
and whether the two answered the same tokens (they must: the buffers change where K/V live, not what).
`inf_mllm` at budget 1,024 and the full cache, where every decode step's copy is largest.
"""

from tqdm import tqdm

from inf_mllm import StreamSession, load_model

from .common import RoundTimer, median, print_table, record, tokens_per_s, write
from .corpus import token_stream

FEED, QUESTION, ANSWER = 512, 32, 32
PATHS = {"buffers (new)": True, "torch.cat (old)": False}


def run(args):
    rounds = 4 if args.quick else 15
    length = 2048 if args.quick else 6144
    model, tok = load_model()
    ids = token_stream(tok, length + 2 * rounds * QUESTION)
    records = []
    for policy, budget in (("inf_mllm", 1024), ("full", None)):
        sessions = {path: StreamSession(model, tok, policy, budget=budget, static=static)
                    for path, static in PATHS.items()}
        for session in sessions.values():
            for start in range(0, length, FEED):
                session.append(ids[start:start + FEED][None])
        decode, ttft, answers = ({path: [] for path in PATHS} for _ in range(3))
        for r in tqdm(range(rounds), desc=f"static_cache: {policy}", unit="round"):
            q = ids[length + r * QUESTION: length + (r + 1) * QUESTION][None]
            for path, session in sessions.items():
                timer = RoundTimer(session)
                session.append(q)
                ttft[path].append(timer.turn())
                tokens = [int(t[0]) for t in session.generate(ANSWER, eos_token_id=[])]
                answers[path].append(tokens)
                decode[path].append(1e3 / tokens_per_s(len(tokens), session.last.decode_s))
        for path in PATHS:
            records += [record("static_cache", f"{policy}, {path}", budget, "decode_ms_per_token", median(decode[path]),
                               length),
                        record("static_cache", f"{policy}, {path}", budget, "ttft_s", median(ttft[path]), length)]
        new, old = (median(decode[path]) for path in PATHS)
        same = answers["buffers (new)"] == answers["torch.cat (old)"]
        records += [record("static_cache", f"{policy}: speed-up (old / new)", budget, "ratio", old / new, length),
                    record("static_cache", f"{policy}: same answers", budget, "rate", float(same), length)]
    print_table(records, ["decode_ms_per_token", "ttft_s", "ratio", "rate"])
    write(args.out, "static_cache", records, [])
