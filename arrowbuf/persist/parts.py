"""What `arrowbuf.persist` sees of a store: its parts, handed over by the store itself (`store._persist_parts()`).

The store builds a `StoreParts` from its own components; persist reads and restores state only through these
objects' public surfaces (`ColumnArenas.view`/`write`, `RingIndex` arrays, `Sampler` state, `EpisodeTracker`), never
through the store's private attributes. Samplers and rate limiters are recorded as specs (`to_spec`/`from_spec`): a
class of `arrowbuf.samplers` or `arrowbuf.rate_limiters` and its literal constructor arguments (nested samplers, as
`Sequence(priority=Prioritized(...))`, are specs too).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument, StoreCorrupt

#: Modules whose classes a checkpoint may name (restore imports nothing else).
SPEC_MODULES = ("arrowbuf.samplers", "arrowbuf.rate_limiters")


@dataclass
class StoreParts:
    """A store's components, as its `_persist_parts()` hands them to persist.

    Attributes:
        schema: the store's `ExperienceSchema`.
        cols: its `ColumnArenas` (or `TieredColumnArenas`).
        directory: its `ChunkDirectory` (ring geometry).
        index: its `RingIndex` (seqs, episode ids, steps, successors, sampleability, header counters).
        sampler: its `Sampler`.
        episodes: its `EpisodeTracker` (this process's open streams).
        rng: the `np.random.Generator` its sampler draws from.
        final_owner: per final-observation slot, the seq of the row that owns it (-1 none).
        times_sampled: per ring position, deliveries so far (empty without `max_times_sampled`).
        lock: the state lock (commits, sampling); write_lock: held by writers for a whole batch.
        config: the constructor arguments that rebuild an equal store (capacity, chunk_rows, ...).
        tier_name: "host", "shm", or "tiered".
        consume: its `ConsumeTracker` (tasks, consumption per task, policy version), or None.
    """

    schema: Any
    cols: Any
    directory: Any
    index: Any
    sampler: Any
    episodes: Any
    rng: np.random.Generator
    final_owner: np.ndarray
    times_sampled: np.ndarray
    lock: Any
    write_lock: Any
    config: dict[str, Any]
    rate_limiter: Any
    tier_name: str
    consume: Any = None

    @property
    def arena_rows(self) -> int:
        return int(self.directory.arena_rows)

    @property
    def chunk_rows(self) -> int:
        return int(self.directory.chunk_rows)


def to_spec(obj: Any) -> dict[str, Any] | None:
    """A JSON-able spec of a sampler or rate limiter: its class and constructor arguments read back from the
    attributes of the same names.

    Raises:
        InvalidArgument: the object is not of `SPEC_MODULES`, or an argument is not recoverable.
    """
    if obj is None:
        return None
    cls = type(obj)
    if cls.__module__ not in SPEC_MODULES:
        raise InvalidArgument(f"{cls.__name__} cannot be recorded in a checkpoint: only classes of "
                              f"{', '.join(SPEC_MODULES)} can (restore rebuilds them from the manifest)")
    args: dict[str, Any] = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(obj, p.name):
            if p.default is p.empty:
                raise InvalidArgument(f"{cls.__name__}: argument {p.name!r} is not kept as an attribute; it cannot "
                                      "be recorded in a checkpoint")
            continue
        value = getattr(obj, p.name)
        if isinstance(value, np.generic):
            value = value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            args[p.name] = value
        elif type(value).__module__ in SPEC_MODULES:
            args[p.name] = {"spec": to_spec(value)}
        else:
            raise InvalidArgument(f"{cls.__name__}.{p.name}={value!r} cannot be recorded in a checkpoint")
    return {"module": cls.__module__, "class": cls.__name__, "args": args}


def from_spec(spec: Any, where: str) -> Any:
    """Build the object a `to_spec` dict names (classes of `SPEC_MODULES` only; literal arguments).

    Raises:
        StoreCorrupt: the spec is malformed (the message names `where`, the file it came from).
    """
    if spec is None:
        return None
    from ..rate_limiters import RateLimiter
    from ..samplers import Sampler

    if not (isinstance(spec, dict) and spec.get("module") in SPEC_MODULES and isinstance(spec.get("class"), str)
            and isinstance(spec.get("args"), dict)):
        raise StoreCorrupt(f"{where}: malformed sampler/rate-limiter spec {str(spec)[:200]}")
    cls = getattr(importlib.import_module(spec["module"]), spec["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, (Sampler, RateLimiter)) and cls.__module__ == spec["module"]):
        raise StoreCorrupt(f"{where}: {spec['module']} has no sampler or rate-limiter class {spec['class']!r}")
    kwargs: dict[str, Any] = {}
    for k, v in spec["args"].items():
        if isinstance(v, dict) and "spec" in v:
            v = from_spec(v["spec"], where)
        elif not (v is None or isinstance(v, (bool, int, float, str))):
            raise StoreCorrupt(f"{where}: argument {k!r} of {spec['class']} is not a literal")
        kwargs[str(k)] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise StoreCorrupt(f"{where}: spec does not build a {cls.__name__}: {exc}") from None
