"""Inf-MLLM core: a bounded, policy-driven KV cache for streaming inference on transformers."""

from .attention import ATTN_IMPLEMENTATION, use_observing_attention
from .budget import KVShape, layer_budgets, parse_bytes
from .cache import StreamingCache, StreamingLayer
from .loader import AssetError, load_model
from .policies import POLICIES, LayerView, Policy, make_policy
from .rope import rerotate
from .session import StreamSession

__all__ = [
    "ATTN_IMPLEMENTATION", "AssetError", "KVShape", "LayerView", "POLICIES", "Policy", "StreamSession",
    "StreamingCache", "StreamingLayer", "layer_budgets", "load_model", "make_policy", "parse_bytes",
    "rerotate", "use_observing_attention",
]
