"""Names to classes: the catalogue in `inf_mllm.spec` says which file holds each part; it is imported
when first asked for, so the spec parser needs no torch and a new method is one file and one line."""

import importlib

from ..spec import ALLOCATORS, SCORERS


def _load(where: str):
    """"module:Class" in this package, or "package.module:Class" anywhere (a policy kept outside the core)."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module if "." in module else f"{__package__}.{module}"), name)


def scorer_class(name: str):
    return _load(SCORERS[name])


def allocator_class(name: str):
    return _load(ALLOCATORS[name])
