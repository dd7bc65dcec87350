"""Decode speed with and without cuDNN's attention among SDPA's GPU kernels (a diagnostic, issue 23).

cuDNN plans its attention for each new key length; a streaming cache's length changes at every decode step,
and the full cache never comes back to a length it had. `inf_mllm.attention.GPU_SDPA_BACKENDS` leaves cuDNN
out; this prints what that changes, per policy, on a random `--shape` model streamed to 2K tokens: medians
over 7 answers of 16 tokens, each after a 32-token question, the (backends, policy) pairs taken round-robin.
Prints only (no JSON): a GPU check, not a curve.
"""

import statistics
import time

import torch

from inf_mllm import StreamSession, attention

from . import shapes

ANSWERS = 7


def run(args):
    model = shapes.build(args.shape or "vicuna-7b", args.device)
    ids = torch.randint(3, model.config.vocab_size, (1, 2048 + 40 * ANSWERS), device=args.device)
    ours = list(attention.GPU_SDPA_BACKENDS)
    variants = {"with cuDNN": ours + [attention.SDPBackend.CUDNN_ATTENTION], "without": ours}
    sessions = {}
    for label in variants:
        for policy in args.policies or ("full", "streaming_llm", "inf_mllm"):
            session = StreamSession(model, None, policy, budget=None if policy == "full" else 1024)
            for i in range(0, 2048, 512):
                session.append(ids[:, i:i + 512])
            sessions[label, policy] = (session, [])
    try:
        for r in range(ANSWERS):  # each answer at key lengths the full cache has not had before
            for (label, _), (session, times) in sessions.items():
                attention.GPU_SDPA_BACKENDS = variants[label]
                session.append(ids[:, 2048 + 40 * r: 2048 + 40 * r + 32])
                shapes.sync(args.device)
                t0 = time.perf_counter()
                n = len(list(session.generate(17, eos_token_id=[])))
                shapes.sync(args.device)
                times.append(1e3 * (time.perf_counter() - t0) / (n - 1))
    finally:
        attention.GPU_SDPA_BACKENDS = ours
    for (label, policy), (session, times) in sessions.items():
        print(f"{label:10s} {policy:14s} decode {statistics.median(times):6.1f} ms/token "
              f"(min {min(times):.1f}, max {max(times):.1f}), kv {session.kv_tokens}")
