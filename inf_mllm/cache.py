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


class ProbeDone(Exception):
    """Ends a probe forward (`StreamingCache.probe_layers`) once its last wanted layer has run."""


class StreamingLayer(DynamicLayer):
    def __init__(self, layer_idx: int, cache: "StreamingCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.prompt_len = 0
        self.window_scores: torch.Tensor | None = None
        self.acc_scores: torch.Tensor | None = None
        # which turn each cached token came from, (B, H, n); linked (recalled) tokens carry -1 - span id
        self.turn_ids: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.cache.probe_layers is not None and self.layer_idx >= self.cache.probe_layers:
            raise ProbeDone  # the probe has the keys it needs: the deeper layers need not run
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = key_states.shape[-2]
        if not self.cache.is_decoding:
            self.prompt_len = new
        if self.cache.track_turns:
            tag = torch.full((*keys.shape[:2], new), self.cache.turn, dtype=torch.long, device=keys.device)
            self.turn_ids = tag if self.turn_ids is None else torch.cat([self.turn_ids, tag], dim=-1)
        if self.cache.policy.observe == "all":
            pad = torch.zeros((*keys.shape[:2], new), dtype=torch.float32, device=keys.device)
            self.acc_scores = pad if self.acc_scores is None else torch.cat([self.acc_scores, pad], dim=-1)
        if self.cache.policy.observe is not None or self.cache.recall_window:
            attention.announce(self)
        return keys, values

    def window_len(self, q_len: int) -> int:
        """How many of this forward's last queries the policy (or recall) wants scored (0: none)."""
        observe = self.cache.policy.observe
        if observe == "all":
            return q_len
        if self.cache.is_decoding:
            return 0
        if observe == "window":
            return min(self.cache.policy.window, q_len)
        return min(self.cache.recall_window, q_len)

    def observe_scores(self, scores: torch.Tensor, l: int) -> None:
        """Called by the attention function with (B, Hq, n) mean attention of the last l queries."""
        self.window_scores = scores
        if self.cache.policy.observe == "all":
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
        self.keep(idx)
        self.window_scores = None

    def keep(self, idx: torch.Tensor) -> None:
        """Keep the tokens at sorted indices idx, (B, K) or (B, H, K), re-rotated to positions 0..K-1."""
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
        if self.turn_ids is not None:
            self.turn_ids = self.turn_ids.gather(-1, idx.expand(b, h, -1))

    def insert(self, at: int, keys: torch.Tensor, values: torch.Tensor, tags: torch.Tensor) -> None:
        """Link a stored block (B, H, m, d) whose keys sit at positions 0..m-1 in at position `at`; the
        tokens after it move right by m (keys re-rotated), so positions stay contiguous."""
        m = keys.shape[2]
        rotate = self.cache.rotations.rotate
        head_k, tail_k = self.keys[:, :, :at], self.keys[:, :, at:]
        block = rotate(keys.to(self.keys), torch.full((1, 1, m), at, device=keys.device)) if at else keys
        if tail_k.shape[2]:
            tail_k = rotate(tail_k, torch.full((1, 1, tail_k.shape[2]), m, device=keys.device))
        self.keys = torch.cat([head_k, block.to(self.keys.dtype), tail_k], dim=2)
        self.values = torch.cat([self.values[:, :, :at], values.to(self.values), self.values[:, :, at:]], dim=2)
        b, h = self.keys.shape[:2]
        if self.turn_ids is not None:
            ids = tags.to(self.turn_ids.device).expand(b, h, m)
            self.turn_ids = torch.cat([self.turn_ids[..., :at], ids, self.turn_ids[..., at:]], dim=-1)
        if self.acc_scores is not None:
            zeros = torch.zeros((b, h, m), dtype=self.acc_scores.dtype, device=self.acc_scores.device)
            self.acc_scores = torch.cat([self.acc_scores[..., :at], zeros, self.acc_scores[..., at:]], dim=-1)

    def mark(self) -> tuple:
        """What `rollback` needs to undo the forwards that follow (a probe, or a turn that failed)."""
        acc = self.acc_scores.clone() if self.acc_scores is not None else None
        return self.get_seq_length(), self.prompt_len, self.window_scores, acc

    def rollback(self, mark: tuple) -> None:
        n, self.prompt_len, self.window_scores, self.acc_scores = mark
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        if self.turn_ids is not None:
            self.turn_ids = self.turn_ids[..., :n]


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
        # recall (see recall.py): turn ids per token, window scores for every turn, captured queries
        self.track_turns = False
        self.turn = 0
        self.recall_window = 0
        self.probe_layers: int | None = None  # a probe forward stops before this layer
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

    def enable_recall(self, model, window: int) -> None:
        """Track which turn each token came from and observe every turn's window (recall needs both)."""
        self.track_turns, self.recall_window = True, window
        use_observing_attention(model)

    @contextmanager
    def decoding(self):
        """Mark forwards as decode steps: they neither open a new turn nor refresh window scores."""
        self.is_decoding = True
        try:
            yield self
        finally:
            self.is_decoding = False

    def mark(self) -> list[tuple]:
        return [layer.mark() for layer in self.layers]

    def rollback(self, marks: list[tuple]) -> None:
        """Back to `mark()`: every layer as it was, whatever part of a forward ran since."""
        for layer, mark in zip(self.layers, marks, strict=True):
            layer.rollback(mark)

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
