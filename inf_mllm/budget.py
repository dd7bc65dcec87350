"""KV budgets: how many tokens each layer may keep after an eviction.

A budget is given in tokens (``1024``) or bytes (``"512MB"``, ``"2GiB"``), uniform or per layer (a list); spec.py
parses it once into a `Budget`. Bytes become tokens from the cache's own shapes: layers x 2 (K and V)
x KV heads x head dim x dtype size x batch.
"""

from dataclasses import dataclass

from .spec import parse_budget


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    batch: int = 1

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes * self.batch

    @classmethod
    def from_config(cls, config, dtype_bytes: int, batch: int = 1) -> "KVShape":
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, dtype_bytes, batch)


def layer_budgets(budget, shape: KVShape) -> list[int] | None:
    """Per-layer token budgets, or None for an unbounded cache. ``budget`` is a `spec.Budget` or anything
    `spec.parse_budget` reads (an int, "512MB", a per-layer list); a memory size is split evenly over the layers
    by the cache's own bytes per token. An `auto` budget must be sized first (`streaming.memory.auto_budget_for`)."""
    budget = parse_budget(budget)
    if budget is None:
        return None
    if budget.auto:
        raise ValueError("budget auto is sized from free memory once the model has loaded: resolve it to tokens first")
    if budget.bytes is not None:
        return [int(budget.bytes // (shape.bytes_per_token_layer * shape.num_layers))] * shape.num_layers
    if budget.tokens is not None:
        return [budget.tokens] * shape.num_layers
    if len(budget.layers) != shape.num_layers:
        raise ValueError(f"per-layer budget has {len(budget.layers)} entries but the model has {shape.num_layers} "
                         "layers")
    return list(budget.layers)
