"""The one codec of sampler and rate-limiter specs: what checkpoints and shared-memory manifests record.

A spec names a class by its registered `spec_name` (not by its module, so classes can move between modules without
breaking saved checkpoints) and gives its constructor arguments, read back from the attributes of the same names::

    {"kind": "prioritized", "args": {"alpha": 0.6, "beta": 0.4, "eps": 1e-06}}
    {"kind": "sequence", "args": {"length": 8, "priority": {"kind": "prioritized", "args": {...}}}}

`to_spec` raises `InvalidArgument` for an object that cannot be recorded; `from_spec` builds only registered classes
from literal arguments (never imports a module a file names) and raises `StoreCorrupt` naming `where` (the file the
spec came from) for anything else. Checkpoints written before specs were keyed on names (`{"module": ...,
"class": "PrioritizedSampler", "args": ...}`) still read.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import numpy as np

from ..errors import InvalidArgument, StoreCorrupt
from ..rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
from .base import Sampler
from .fifo import FifoSampler, LifoSampler
from .group import GroupSampler
from .prioritized import PrioritizedSampler
from .sequence import SequenceSampler
from .uniform import UniformSampler

#: Every class a spec may name, by `spec_name`.
REGISTRY: dict[str, type] = {c.spec_name: c for c in (
    UniformSampler, FifoSampler, LifoSampler, PrioritizedSampler, SequenceSampler, GroupSampler,
    MinSize, SampleToInsertRatio)}
# the class names older checkpoints recorded (under "arrowbuf.samplers" or "arrowbuf.rate_limiters")
_LEGACY = {c.__name__: name for name, c in REGISTRY.items()}
_LEGACY_MODULES = ("arrowbuf.samplers", "arrowbuf.rate_limiters")
#: Nesting depth a spec may have (a sequence sampler over a prioritized one needs 2).
MAX_DEPTH = 4


def to_spec(obj: Sampler | RateLimiter | None) -> dict[str, Any] | None:
    """The spec of a sampler or rate limiter (None for None).

    Raises:
        InvalidArgument: the class is not registered, or an argument is not kept as an attribute or not a literal.
    """
    if obj is None:
        return None
    cls = type(obj)
    name = getattr(cls, "spec_name", "")
    if REGISTRY.get(name) is not cls:
        raise InvalidArgument(f"{cls.__name__} cannot be recorded (checkpoints, shared-memory stores): only "
                              f"arrowbuf's own samplers and rate limiters can ({', '.join(sorted(REGISTRY))})")
    args: dict[str, Any] = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(obj, p.name):
            if p.default is p.empty:
                raise InvalidArgument(f"{cls.__name__}: argument {p.name!r} is not kept as an attribute of the same "
                                      "name; it cannot be recorded")
            continue
        value = getattr(obj, p.name)
        if isinstance(value, np.generic):
            value = value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            args[p.name] = value
        elif isinstance(value, (Sampler, RateLimiter)):
            args[p.name] = to_spec(value)
        else:
            raise InvalidArgument(f"{cls.__name__}.{p.name}={value!r} is not a literal; it cannot be recorded")
    return {"kind": name, "args": args}


def from_spec(spec: object, where: str, _depth: int = 0) -> Sampler | RateLimiter | None:
    """Build the object a spec names (None for None).

    Args:
        spec: a dict from `to_spec` (or the module/class form of older checkpoints).
        where: the file the spec came from, for error messages.

    Raises:
        StoreCorrupt: malformed, an unknown name, a non-literal argument or arguments the class refuses; the
            message names `where`.
    """
    if spec is None:
        return None
    if _depth > MAX_DEPTH:
        raise StoreCorrupt(f"{where}: sampler/rate-limiter spec nested deeper than {MAX_DEPTH}")
    if not isinstance(spec, dict) or not isinstance(spec.get("args"), dict):
        raise StoreCorrupt(f"{where}: malformed sampler/rate-limiter spec {str(spec)[:200]}")
    if "kind" in spec:
        name = spec["kind"]
    elif spec.get("module") in _LEGACY_MODULES and isinstance(spec.get("class"), str):
        name = _LEGACY.get(spec["class"])
    else:
        name = None
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        named = str(spec.get("kind", spec.get("class")))[:80]
        raise StoreCorrupt(f"{where}: unknown sampler or rate limiter {named!r}; expected one of "
                           f"{', '.join(sorted(REGISTRY))}")
    kwargs: dict[str, Any] = {}
    for k, v in spec["args"].items():
        if isinstance(v, dict) and "spec" in v and len(v) == 1:  # the nested form of older checkpoints
            v = v["spec"]
        if isinstance(v, dict):
            v = from_spec(v, where, _depth + 1)
        elif not (v is None or isinstance(v, (bool, int, float, str))):
            raise StoreCorrupt(f"{where}: argument {str(k)[:80]!r} of {cls.__name__} is not a literal")
        kwargs[str(k)] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, ArithmeticError) as exc:  # InvalidArgument is a ValueError
        raise StoreCorrupt(f"{where}: the spec does not build a {cls.__name__}: {exc}") from None


def spec_class_name(spec: object) -> str | None:
    """The class a spec names (`"PrioritizedSampler"`), for display; None for None or a malformed spec."""
    if not isinstance(spec, dict):
        return None
    if "kind" in spec:
        cls = REGISTRY.get(spec["kind"]) if isinstance(spec["kind"], str) else None
        return cls.__name__ if cls is not None else None
    return spec.get("class") if isinstance(spec.get("class"), str) else None


_BY_NAME: dict[str, type[Sampler]] = {"uniform": UniformSampler, "fifo": FifoSampler, "lifo": LifoSampler,
                                      "prioritized": PrioritizedSampler}


def make_sampler(spec: str | Sampler | type[Sampler] | None) -> Sampler:
    """A sampler from a name ("uniform", "fifo", "lifo", "prioritized"), a class or an instance."""
    if spec is None:
        return UniformSampler()
    if isinstance(spec, Sampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, Sampler) and not inspect.isabstract(spec):
        return cast(Sampler, cast(Any, spec)())
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return cast(Sampler, cast(Any, _BY_NAME[spec.lower()])())
    raise InvalidArgument(f"unknown sampler {spec!r}; expected one of {sorted(_BY_NAME)} or an ab.samplers instance")
