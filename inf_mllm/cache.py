"""A transformers Cache whose layers evict by policy at turn boundaries and keep positions contiguous.

Each `StreamingLayer` is a `DynamicLayer` that also remembers what its policy needs (the window
scores of the last prompt, or accumulated attention), evicts to its budget when told, and re-rotates
the kept keys so they sit at positions 0..K-1. Because the kept tokens are always contiguous, the
model's default position ids (arange + cache length) and causal mask stay right after a shrink.
"""

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import attention
from .attention import use_observing_attention
from .budget import KVShape, layer_budgets
from .policies import LayerView, Policy, make_policy
from .rope import RotationTable, rope_inv_freq


class StreamingLayer(DynamicLayer):
    def __init__(self, layer_idx: int, cache: "StreamingCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.prompt_len = 0
        self.window_scores: torch.Tensor | None = None
        self.acc_scores: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = key_states.shape[-2]
        if not self.cache.is_decoding:
            self.prompt_len = new
        if self.cache.policy.observe == "all":
            pad = torch.zeros((*keys.shape[:2], new), dtype=torch.float32, device=keys.device)
            self.acc_scores = pad if self.acc_scores is None else torch.cat([self.acc_scores, pad], dim=-1)
        if self.cache.policy.observe is not None:
            attention.announce(self)
        return keys, values

    def window_len(self, q_len: int) -> int:
        """How many of this forward's last queries the policy wants scored (0: none)."""
        observe = self.cache.policy.observe
        if observe == "all":
            return q_len
        if observe == "window" and not self.cache.is_decoding:
            return min(self.cache.policy.window, q_len)
        return 0

    def observe_scores(self, scores: torch.Tensor, l: int) -> None:
        """Called by the attention function with (B, Hq, n) mean attention of the last l queries."""
        if self.cache.policy.observe == "window":
            self.window_scores = scores
        else:
            b, hq, n = scores.shape
            hkv = self.keys.shape[1]
            self.acc_scores += scores.reshape(b, hkv, hq // hkv, n).sum(dim=2) * l

    def evict(self, policy: Policy, budget: int) -> None:
        n = self.get_seq_length()
        if n <= budget:
            return
        view = LayerView(n, self.prompt_len, self.keys.shape[1], self.window_scores, self.acc_scores)
        idx = policy.select(view, budget)
        if idx is None:
            return
        b, h, _, d = self.keys.shape
        idx = idx.to(self.keys.device)
        # one index set for all heads stays (B, 1, K): its shifts and rotation angles are computed once per token
        idx = idx[:, None, :] if idx.dim() == 2 else idx
        gather = idx.unsqueeze(-1).expand(b, h, -1, d)
        keys = self.keys.gather(2, gather)
        delta = torch.arange(idx.shape[-1], device=idx.device) - idx  # (B, 1 or H, K), <= 0
        self.keys = self.cache.rotations.rotate(keys, delta) if bool((delta != 0).any()) else keys
        self.values = self.values.gather(2, gather)
        if self.acc_scores is not None:
            self.acc_scores = self.acc_scores.gather(-1, idx.expand(b, h, -1))
        self.window_scores = None


class StreamingCache(Cache):
    """Bounded KV cache for streams: `evict()` at each turn boundary, `step()` after each decode step."""

    def __init__(self, policy: Policy, budgets: list[int] | None, inv_freq: torch.Tensor, num_layers: int):
        super().__init__(layers=[])
        self.layers = [StreamingLayer(i, self) for i in range(num_layers)]
        self.policy = policy
        self.budgets = budgets
        self.inv_freq = inv_freq
        self.rotations = RotationTable(inv_freq)
        self.is_decoding = False
        # Time spent on scores since the last pop_score_time(). With measure_overhead (benchmarks), it is
        # the cost beyond plain SDPA, found by also running SDPA on the window queries (probe_s).
        self.score_s = self.probe_s = 0.0
        self.measure_overhead = False
        if budgets is not None:
            for budget in budgets:
                policy.check(budget)

    @classmethod
    def for_model(cls, model, policy: str | Policy = "inf_mllm", budget=None, batch: int = 1, **policy_kwargs):
        """Build a cache for `model`; `budget` is tokens, bytes ("512MB") or a per-layer list."""
        if isinstance(policy, str):
            policy = make_policy(policy, **policy_kwargs)
        inv_freq = rope_inv_freq(model)
        shape = KVShape.from_config(model.config, torch.finfo(model.dtype).bits // 8, batch)
        budgets = layer_budgets(budget, shape) if policy.name != "full" else None
        if policy.observe is not None:
            use_observing_attention(model)
        return cls(policy, budgets, inv_freq, shape.num_layers)

    @contextmanager
    def decoding(self):
        """Mark forwards as decode steps: they neither open a new turn nor refresh window scores."""
        self.is_decoding = True
        try:
            yield self
        finally:
            self.is_decoding = False

    def evict(self) -> None:
        """Turn boundary: every layer keeps at most its budget, chosen by the policy."""
        if self.budgets is None:
            return
        for layer, budget in zip(self.layers, self.budgets, strict=True):
            if layer.is_initialized:
                layer.evict(self.policy, budget)

    def step(self) -> None:
        """After a decode step: evict only for policies that evict while decoding (H2O)."""
        if self.policy.evict_while_decoding:
            self.evict()

    def pop_score_time(self) -> tuple[float, float]:
        """(score seconds, probe seconds) since the last call; probe time is measurement, not work."""
        spent, self.score_s, probe, self.probe_s = self.score_s, 0.0, self.probe_s, 0.0
        return spent, probe

    @property
    def kv_tokens(self) -> int:
        return max((layer.get_seq_length() for layer in self.layers), default=0)

    @property
    def kv_bytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )
