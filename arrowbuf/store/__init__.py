"""The store: `ExperienceStore` (the facade over one engine, `arrowbuf.engine`) and its write paths (`writes`: direct;
`durable`: journaled), `PendingWrite`, and the facade's views (`inspection`) and persistence (`persistence`)."""

from __future__ import annotations

import importlib
from types import ModuleType

from .facade import ExperienceStore

#: Modules of the engine that lived in this package before it moved (`arrowbuf.engine`): `from arrowbuf.store
#: import writer` keeps working for tools written against the old layout.
_MOVED = frozenset({"core", "writer", "reader", "update", "consume", "consume_state", "tokens", "leases",
                    "shared_leases", "episodes", "stepcheck", "nstep", "pieces", "pieces_writer", "reservation"})


def __getattr__(name: str) -> ModuleType:
    if name in _MOVED:
        return importlib.import_module(f"arrowbuf.engine.{name}")
    raise AttributeError(f"module 'arrowbuf.store' has no attribute {name!r}")


__all__ = ["ExperienceStore"]
