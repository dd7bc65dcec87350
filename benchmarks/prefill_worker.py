"""One side of `python -m benchmarks prefill --old-tree DIR`: the code of another checkout prefilling the same clip
turn, one turn per "go" line on stdin, its time on stdout.

Run as `python -P prefill_worker.py TURN BUDGET` with PYTHONPATH at that checkout and neither OMP_WAIT_POLICY nor
GOMP_SPINCOUNT set, so that checkout's `streaming` sets its own OpenMP waiting before torch loads, as its
`stream-qa` did. It uses only what every checkout since the turn engine has: `load_adapter`, `new_session`,
`append(inputs_embeds=…)` and `last.prefill_s`.
"""

import sys

import streaming  # noqa: F401  (that checkout's OpenMP setting, before torch loads)


def main(turn_path: str, budget: int) -> None:
    import torch  # after `streaming`, whatever an import sorter would do

    from models import load_adapter

    turn = torch.load(turn_path)
    session = load_adapter("tiny-vlm").new_session("inf_mllm", budget=budget)
    with torch.inference_mode():
        while session.kv_tokens < budget:  # full, so that every timed turn evicts, as on the other side
            session.append(inputs_embeds=turn)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            session.append(inputs_embeds=turn)
            print(session.last.prefill_s, session.last.evict_s, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
