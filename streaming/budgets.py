"""What a stream's KV budget must hold, and the one way `stream-qa`, the app and the soak open a session on it.

A budget is parsed once (`inf_mllm.spec.Budget`), an `auto` one sized from free memory once the model has loaded
(`auto_budget_for`), and checked once, here: it holds one clip turn and a question (`floor`: the engine never
shrinks a cache below it after an out-of-memory error either), and with a turn and an answer on top of it
(`headroom`, what the engine reserves in the buffers) it stays inside the positions the model was trained on.
"""

import importlib.util

from .checks import check_context
from .errors import ConfigError
from .memory import MB, AutoBudget, MemorySample, auto_budget, budget_tokens
from .questions import SAMPLE_QUESTION


def compiles_decode(device: str, asked: bool | None = None) -> bool:
    """Whether decode steps run compiled: as asked, else wherever it is faster (a GPU; benchmarks compiled_decode).
    Inductor's GPU kernels are Triton's: a CUDA build without it (some Jetson wheels) decodes eagerly."""
    if asked is not None:
        return asked
    return str(device).split(":")[0] == "cuda" and importlib.util.find_spec("triton") is not None


def turn_and_question(adapter) -> int:
    """Tokens of one clip turn and a typical question."""
    return adapter.turn_tokens() + adapter.question_tokens(SAMPLE_QUESTION)


def floor(adapter, policy=None) -> int:
    """The smallest budget that still holds one clip turn and a question, and that `policy` accepts."""
    need = turn_and_question(adapter)
    return need if policy is None else max(need, policy.min_budget() + 1)


def headroom(adapter, max_new_tokens: int) -> int:
    """Rows a cache holds beyond its budget at most: the longest turn, the held-back last answer token that goes in
    front of it, and the longest answer."""
    return adapter.turn_tokens() + 1 + max_new_tokens


def check(budgets: list[int] | None, adapter, max_new_tokens: int) -> None:
    """A bounded cache's per-layer budgets hold a clip turn and a question, and stay inside the model's context with
    a turn, a question and an answer on top; else one line saying what to change."""
    if not budgets:
        return
    need = turn_and_question(adapter)  # the policy's own least it checked when built
    if min(budgets) < need:
        raise ConfigError(f"budget of {min(budgets)} tokens per layer cannot hold one clip turn and a question "
                          f"({need} tokens): raise --budget")
    check_context(max(budgets), turn_and_question(adapter) + max_new_tokens, adapter.describe().context_length)


def auto_budget_for(adapter, max_new_tokens: int = 16, device: str | None = None,
                    sample: MemorySample | None = None) -> tuple[int, AutoBudget]:
    """`--budget auto` for a loaded adapter: (tokens per layer, the byte budget behind them). Call it once the model
    has loaded, so its weights are not counted as free."""
    from inf_mllm.budget import KVShape  # lazy: torch

    model = adapter.model
    shape = KVShape.from_config(model.config, model.dtype.itemsize)
    auto = auto_budget(sample, device if device is not None else str(adapter.device))
    per_token = shape.bytes_per_token_layer * shape.num_layers
    tokens = budget_tokens(auto, per_token, adapter.describe().context_length,
                           turn_and_question(adapter) + max_new_tokens)
    if tokens < turn_and_question(adapter):
        raise ConfigError(f"--budget auto: {auto.free_bytes / MB:.0f} MB free on {auto.kind} leaves no room for a KV "
                          f"cache after the {auto.reserve_bytes / MB:.0f} MB reserve; free memory or give --budget")
    return tokens, auto


def open_session(adapter, spec, budget, max_new_tokens: int = 16, device: str | None = None, **extra):
    """A session of `adapter` under policy `spec` and `budget` (a `Budget`, or anything `parse_budget` reads; ignored
    for an unbounded policy), checked: (session, the auto budget's sizing or None). `extra`: `store`,
    `compile_decode`. A policy that refuses its options or the budget is a one-line `ConfigError`."""
    from inf_mllm.spec import parse_budget

    try:
        budget = parse_budget(budget) if spec.bounded else None
    except ValueError as err:
        raise ConfigError(f"--{err}" if str(err).startswith("budget ") else f"--budget: {err}") from None
    auto = None
    if budget is not None and budget.auto:
        tokens, auto = auto_budget_for(adapter, max_new_tokens, device)
        budget = parse_budget(tokens)
    try:
        session = adapter.new_session(spec, budget=budget, **extra)
    except ValueError as err:  # the policy refuses these options (window larger than the budget, …)
        raise ConfigError(f"--policy {spec.policy_name}: {str(err).strip().splitlines()[0]}") from err
    check(session.cache.budgets, adapter, max_new_tokens)
    return session, auto
