"""What a cache policy and a budget are, as plain data: parsed once at the edge, checked on construction.

This module imports no torch, so `stream-qa` and the app check a user's `--policy` and `--budget` with
the real grammars before any model loads. A policy string names three independent parts and an
optional recall, `scorer[+allocator][+reducer][+recall…][+reuse]`:

    inf_mllm                          the paper's algorithm with its default allocator and reducer
    inf_mllm+vl_cache_budgets+merge   Inf-MLLM's scores, VL-Cache's budgets, Elastic Cache's merging
    inf_mllm+recall                   evicted turns come back from the span store when asked about
    inf_mllm+recall+mpic              ... and part of each linked turn is recomputed with the question (MPIC-k)

The catalogue below is the one list of names; `inf_mllm.policies` imports a part's class when a spec
is built. A budget is tokens per layer (``512``), a memory size (``512MB``, ``2GiB``) or ``auto``.
"""

import random
import re
from dataclasses import dataclass, field, replace

# name -> "module:Class" in inf_mllm.policies, in the order `python -m inf_mllm policies` lists them
SCORERS = {
    "full": "full:Full",
    "window": "window:Window",
    "streaming_llm": "streaming_llm:StreamingLLM",
    "h2o": "h2o:H2O",
    "inf_mllm": "inf_mllm:InfMLLM",
    "inf_mllm_plus": "inf_mllm_plus:InfMLLMPlus",
    "snapkv": "snapkv:SnapKV",
    "vl_cache": "vl_cache:VLCache",
    "prefixkv": "prefixkv:PrefixKV",
    "elastic": "elastic:Elastic",
}
ALLOCATORS = {
    "uniform": "allocators:Uniform",
    "prefixkv_budgets": "allocators:PrefixKVBudgets",
    "vl_cache_budgets": "allocators:VLCacheBudgets",
}
REDUCERS = ("evict", "merge")

# the mixes the tests run on the real model (listed by `python -m inf_mllm policies`)
COMBINATIONS = (
    "inf_mllm+merge",
    "inf_mllm+vl_cache_budgets",
    "inf_mllm+prefixkv_budgets",
    "inf_mllm+vl_cache_budgets+merge",
    "inf_mllm_plus+vl_cache_budgets",
    "snapkv+vl_cache_budgets",
    "vl_cache+merge",
    "elastic+prefixkv_budgets",
    "h2o+vl_cache_budgets",
)

RECALL_MODES = ("attention", "oracle", "random")
# how a linked turn's stored KV is used (recall.py, `recompute_rows`): as stored (MPIC's full reuse), with its text
# and first `mpic_k` visual tokens recomputed in the question's forward (MPIC-k), with the `blend_r` share of its
# tokens whose KV deviates most recomputed (CacheBlend-r), or every token recomputed (re-encoding, the ceiling)
REUSE_MODES = ("full", "mpic", "blend", "reencode")


@dataclass
class Recall:
    """How evicted turns come back (see recall.py). `oracle` links exactly the right span and `random` k
    random ones: the references attention-based recall is measured against."""

    mode: str = "attention"
    k: int = 4
    named: bool = True  # link exactly the turns the caller resolved a question to (`named`); False: keys only
    at: str = "end"  # where recalled spans sit: "end" (before the question) or "front" (after the sinks)
    reps: int = 32  # representative keys per scoring layer and KV head, besides the mean key
    # the layers whose keys score spans: fractions of the model's depth (layers 5 and 7 of SmolLM2's 30 and of a
    # 7B's 32; layer 0 of a 2-layer model), or `layers`, given indices (checked against the depth when a session
    # is built); depth=() with layers=None: every layer
    depth: tuple[float, ...] = (1 / 6, 7 / 30)
    layers: tuple[int, ...] | None = None
    window: int = 64  # turn queries observed to pick representatives (policies without a window of their own)
    resident: float = 0.5  # a span with at least this share of its tokens still cached is not recalled
    reuse: str = "full"  # one of REUSE_MODES
    # MPIC-k: the first visual tokens of a linked turn recomputed besides its text; 4 by measurement (k = 0, 4, 8 close
    # the same share of re-encoding's lead on tiny-vlm at 1.18x, 1.30x, 1.34x full reuse's time to first token:
    # benchmarks/results/README.md, link_modes), keeping a few of the tokens the paper finds move the most
    mpic_k: int = 4
    blend_r: float = 0.15  # CacheBlend-r: the share of linked tokens recomputed (CacheBlend's default 15%)
    seed: int = 0
    rng: random.Random = field(init=False, repr=False, compare=False)  # the random mode's draws

    def __post_init__(self):
        if self.mode not in RECALL_MODES:
            raise ValueError(f"recall mode must be one of {', '.join(RECALL_MODES)}, got {self.mode!r}")
        if self.at not in ("end", "front"):
            raise ValueError(f"recall placement must be 'end' or 'front', got {self.at!r}")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"recall reuse must be one of {', '.join(REUSE_MODES)}, got {self.reuse!r}")
        if self.mpic_k < 0 or not 0 <= self.blend_r <= 1:
            raise ValueError(f"recall mpic_k must be >= 0 and blend_r in [0, 1], got {self.mpic_k}, {self.blend_r}")
        if self.k < 1 or self.reps < 1 or self.window < 1:
            raise ValueError("recall k, reps and window must be at least 1")
        if not all(0 <= f < 1 for f in self.depth):
            raise ValueError(f"recall depth fractions must lie in [0, 1), got {self.depth}")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ValueError(f"recall layers must be layer indices from 0, got {self.layers}")
        self.rng = random.Random(self.seed)

    @property
    def kind(self) -> str:
        """The policy suffix that names this recall (and its reuse, unless full)."""
        kind = f"recall_{self.mode}" if self.mode != "attention" else "recall" if self.named else "recall_keys"
        return kind if self.reuse == "full" else f"{kind}+{self.reuse}"


RECALL_KINDS = {"recall": {}, "recall_keys": {"named": False}, "recall_oracle": {"mode": "oracle"},
                "recall_random": {"mode": "random"}}


@dataclass(frozen=True)
class PolicySpec:
    """One cache policy: a scorer, an allocator and a reducer (None: the scorer's defaults), recall
    options, and the options of the scorer and allocator (their dataclass fields, checked when built)."""

    scorer: str = "inf_mllm"
    allocator: str | None = None
    reducer: str | None = None
    recall: Recall | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown policy {self.scorer!r}; choose one of: {', '.join(SCORERS)}")
        if self.allocator is not None and self.allocator not in ALLOCATORS:
            raise ValueError(f"unknown budget allocator {self.allocator!r}; choose one of: {', '.join(ALLOCATORS)}")
        if self.reducer is not None and self.reducer not in REDUCERS:
            raise ValueError(f"unknown reducer {self.reducer!r}; choose one of: {', '.join(REDUCERS)}")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def parse(cls, text: str, **options) -> "PolicySpec":
        """'inf_mllm+vl_cache_budgets+merge+recall' -> its parts; each part is optional after the scorer,
        in that order."""
        scorer, *parts = str(text).strip().split("+")
        if scorer not in SCORERS:
            raise ValueError(f"unknown policy {scorer!r}; choose one of: {', '.join(SCORERS)} "
                             "(a combination: python -m inf_mllm policies; each may end in +recall)")
        allocator = reducer = recall = None
        for part in parts:
            if part in ALLOCATORS and allocator is reducer is recall is None:
                allocator = part
            elif part in REDUCERS and reducer is recall is None:
                reducer = part
            elif part in RECALL_KINDS and recall is None:
                recall = Recall(**RECALL_KINDS[part])
            elif part in REUSE_MODES[1:] and recall is not None and recall.reuse == "full":
                recall = replace(recall, reuse=part)
            else:
                allocators, reducers, recalls, reuses = (" ".join("+" + n for n in names) for names in
                                                         (ALLOCATORS, REDUCERS, RECALL_KINDS, REUSE_MODES[1:]))
                raise ValueError(f"unknown or misplaced policy part {'+' + part!r} in {text!r}: write "
                                 f"<scorer>[+<allocator>][+<reducer>][+<recall>[+<reuse>]]; allocators {allocators}, "
                                 f"reducers {reducers}, recall {recalls}, reuse of linked turns {reuses}")
        return cls(scorer, allocator, reducer, recall, options)

    @property
    def policy_name(self) -> str:
        """The cache policy's name: the parts given, without recall ('inf_mllm+merge')."""
        return "+".join(p for p in (self.scorer, self.allocator, self.reducer) if p)

    @property
    def name(self) -> str:
        """The whole spec as a policy string (options aside)."""
        return self.policy_name + (f"+{self.recall.kind}" if self.recall else "")

    @property
    def bounded(self) -> bool:
        return self.scorer != "full"

    def with_options(self, **options) -> "PolicySpec":
        return replace(self, options={**self.options, **options}) if options else self

    def with_recall(self, recall: Recall | None) -> "PolicySpec":
        return replace(self, recall=recall)

    def __str__(self) -> str:
        return self.name


def as_spec(policy: "PolicySpec | str", **options) -> PolicySpec:
    """A spec from a spec or a policy string (the same parser), with `options` added."""
    spec = policy if isinstance(policy, PolicySpec) else PolicySpec.parse(policy)
    return spec.with_options(**options)


# --- budgets -----------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]i?b|b)\s*")


def parse_bytes(text: str) -> int:
    m = _SIZE.fullmatch(text.lower())
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}: use e.g. 512MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Budget:
    """A KV budget as the user gave it, parsed once: tokens per layer (`tokens`), a memory size for the whole
    cache (`bytes`), tokens per layer listed layer by layer (`layers`), or `auto` (sized from free memory once
    the model has loaded; `streaming.memory`). `text` is how it was written. `inf_mllm.budget.layer_budgets`
    turns one into per-layer tokens for a model's shape."""

    tokens: int | None = None
    bytes: int | None = None
    layers: tuple[int, ...] | None = None
    auto: bool = False
    text: str = ""

    def __str__(self) -> str:
        return self.text


def parse_budget(value) -> "Budget | None":
    """A user's budget (an int, a list per layer, or text: "512", "512MB", "2GiB", "auto"; a `Budget` as it is) as
    a `Budget`; None (no budget) stays None. Anything else is a ValueError with one line saying what to write."""
    if value is None or isinstance(value, Budget):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"a budget must be at least 1 token, got {value}")
        return Budget(tokens=value, text=str(value))
    if isinstance(value, list | tuple):
        layers = tuple(int(b) for b in value)
        if not layers or min(layers) < 1:
            raise ValueError(f"a per-layer budget needs at least 1 token in every layer, got {list(value)}")
        return Budget(layers=layers, text=",".join(map(str, layers)))
    text = str(value).strip()
    if text.lower() == "auto":
        return Budget(auto=True, text="auto")
    if text.isdigit():
        return parse_budget(int(text))
    try:
        size = parse_bytes(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"budget {text!r}: give tokens per layer (512), a memory size (512MB, 2GiB) or auto")
    return Budget(bytes=size, text=text)
