"""Inf-MLLM core: a bounded, policy-driven KV cache for streaming inference on transformers.

The names below load on first use (PEP 562), so `inf_mllm.spec` — the policy and budget grammar the
command line checks before anything heavy loads — is importable without torch."""

import importlib

_EXPORTS = {
    "ATTN_IMPLEMENTATION": "attention", "use_observing_attention": "attention",
    "KVShape": "budget", "layer_budgets": "budget",
    "StreamingCache": "cache", "StreamingLayer": "layer",
    "AssetError": "loader", "load_model": "loader",
    "POLICIES": "policies", "LayerView": "policies", "Policy": "policies", "build": "policies",
    "make_policy": "policies",
    "rerotate": "rope",
    "StreamSession": "session",
    "PolicySpec": "spec", "Recall": "spec", "parse_budget": "spec", "parse_bytes": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'inf_mllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
