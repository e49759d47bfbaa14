"""What a shared store's manifest records: sampler and rate-limiter objects as spec strings, and back."""

from __future__ import annotations

import ast
import importlib
import inspect
from typing import Any

import numpy as np

from ...errors import ArrowbufError

#: Modules whose classes a manifest may name as the sampler or rate limiter (attach imports nothing else).
SPEC_MODULES = ("arrowbuf.samplers", "arrowbuf.rate_limiters")


def to_spec(obj: Any) -> str:
    """A spec string naming `obj`'s class and constructor arguments: ``arrowbuf.samplers:FifoSampler()``.

    Each parameter of the class's `__init__` is read back from the attribute of the same name; objects whose
    arguments are not recoverable that way (or not literals) cannot be shared and raise TypeError.
    """
    cls = type(obj)
    if cls.__module__ not in SPEC_MODULES:
        raise TypeError(f"{cls.__name__} cannot be recorded in a shared store's manifest: only classes of "
                        f"{', '.join(SPEC_MODULES)} can (other processes rebuild it from the manifest)")
    args = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(obj, p.name):
            if p.default is p.empty:
                raise TypeError(f"{cls.__name__}: argument {p.name!r} is not kept as an attribute of the same name; "
                                "it cannot be recorded in a shared store's manifest")
            continue
        value = getattr(obj, p.name)
        if isinstance(value, np.generic):
            value = value.item()
        if ast.literal_eval(repr(value)) != value:  # raises on non-literals too
            raise TypeError(f"{cls.__name__}.{p.name}={value!r} is not a literal")
        args.append(f"{p.name}={value!r}")
    return f"{cls.__module__}:{cls.__name__}({', '.join(args)})"


def from_spec(spec: str | None) -> Any:
    """Build the object a `to_spec` string names (classes of `SPEC_MODULES` only; arguments are literals)."""
    if spec is None:
        return None
    module, _, call = spec.partition(":")
    if module not in SPEC_MODULES:
        raise ArrowbufError(f"manifest names {module!r}; expected one of {SPEC_MODULES}")
    node = ast.parse(call, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ArrowbufError(f"malformed spec {spec!r}")
    cls = getattr(importlib.import_module(module), node.func.id, None)
    if not isinstance(cls, type):
        raise ArrowbufError(f"spec {spec!r}: {module} has no class {node.func.id!r}")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    return cls(**kwargs)
