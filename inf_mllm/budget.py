"""KV budgets: how many tokens each layer may keep after an eviction.

A budget is given in tokens (``1024``) or bytes (``"512MB"``, ``"2GiB"``; the grammar is in spec.py),
uniform or per layer (a list). Bytes become tokens from the cache's own shapes: layers x 2 (K and V)
x KV heads x head dim x dtype size x batch.
"""

from dataclasses import dataclass

from .spec import parse_bytes


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
    """Per-layer token budgets, or None for an unbounded cache.

    ``budget`` is None, an int (tokens per layer), a str with a memory unit (total bytes, split
    evenly), or a list of per-layer token counts.
    """
    if budget is None:
        return None
    if isinstance(budget, str):
        if budget.strip().isdigit():
            budget = int(budget)
        else:
            total = parse_bytes(budget)
            tokens = total // (shape.bytes_per_token_layer * shape.num_layers)
            return [int(tokens)] * shape.num_layers
    if isinstance(budget, int):
        return [budget] * shape.num_layers
    budgets = [int(b) for b in budget]
    if len(budgets) != shape.num_layers:
        raise ValueError(f"per-layer budget has {len(budgets)} entries but the model has {shape.num_layers} layers")
    return budgets
