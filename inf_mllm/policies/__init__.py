"""Cache policies in three independent parts, one small file per method:

- a **scorer** (`base.Scored` and its subclasses: full.py, window.py, streaming_llm.py, h2o.py,
  inf_mllm.py, inf_mllm_plus.py, snapkv.py, vl_cache.py, prefixkv.py, elastic.py) says which tokens of
  a layer matter, through the shared selector in base.py;
- an **allocator** (allocators.py) splits the nominal per-layer budgets at each eviction;
- a **reducer** applies the kept indices: `evict` gathers them, `merge` (Elastic Cache) averages every
  other token into its nearest kept one (`StreamingLayer.merge`).

`build(spec)` makes the policy a `PolicySpec` describes; the names live in `inf_mllm.spec`'s
catalogue. Indices come back sorted, (B, K) for one set per layer or (B, Hkv, K) for one per KV head;
None keeps everything.
"""

import dataclasses

from ..spec import ALLOCATORS as ALLOCATOR_NAMES
from ..spec import COMBINATIONS, REDUCERS, SCORERS, PolicySpec, as_spec
from .allocators import Allocator, Uniform
from .base import AccScored, Policy, Scored, WindowScored
from .inf_mllm import recency_bias
from .registry import allocator_class, scorer_class
from .view import LayerView

POLICIES = {name: scorer_class(name) for name in SCORERS}
ALLOCATORS = {name: allocator_class(name) for name in ALLOCATOR_NAMES}


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def parts(spec: PolicySpec) -> tuple[type[Policy], type[Allocator]]:
    cls = scorer_class(spec.scorer)  # from the catalogue as it is now (a policy registered since import included)
    return cls, allocator_class(spec.allocator or cls.default_allocator)


def build(spec: PolicySpec) -> Policy:
    """The policy `spec` describes; its options go to the scorer, or to the allocator that declares them."""
    cls, alloc_cls = parts(spec)
    options = dict(spec.options)
    alloc_opts = {k: options.pop(k) for k in list(options) if k in fields(alloc_cls) and k not in fields(cls)}
    unknown = set(options) - fields(cls)
    if unknown:
        raise ValueError(f"policy {spec.policy_name!r} takes no option {', '.join(sorted(unknown))}"
                         f" (it takes: {', '.join(sorted(fields(cls) | fields(alloc_cls))) or 'none'})")
    policy = cls(**options)
    policy.allocator = alloc_cls(**alloc_opts)
    policy.reducer = spec.reducer or cls.default_reducer
    policy.name = spec.policy_name
    return policy


def make_policy(policy: PolicySpec | str, **options) -> Policy:
    """`build` for a spec or a policy string, with `options` added."""
    return build(as_spec(policy, **options))


def policy_options(policy: PolicySpec | str) -> set[str]:
    """The options a policy accepts (its scorer's and its allocator's)."""
    cls, alloc_cls = parts(as_spec(policy))
    return fields(cls) | fields(alloc_cls)


def window_cap(policy: PolicySpec | str, budget) -> dict:
    """{"window": budget // 4} when the policy's retrieval window (its option, else its default) is larger
    than a quarter of a token budget, else {}: the window's queries are always kept, and a window near the
    budget would leave nothing to choose (at budget 64 the default window, 64, is the whole cache)."""
    spec = as_spec(policy)
    cls = scorer_class(spec.scorer)
    if not isinstance(budget, int) or "window" not in fields(cls):
        return {}
    window = spec.options.get("window", next(f.default for f in dataclasses.fields(cls) if f.name == "window"))
    return {"window": budget // 4} if window > budget // 4 else {}


__all__ = [
    "ALLOCATORS", "AccScored", "Allocator", "COMBINATIONS", "LayerView", "POLICIES", "Policy", "REDUCERS", "Scored",
    "Uniform", "WindowScored", "build", "make_policy", "policy_options", "recency_bias", "window_cap",
]
