"""The configuration registry: every `ARROWBUF_*` environment variable, registered here with its type, default and
meaning, and read when a store (or a shared-memory tier, or a journal) opens, never at import (as Polars' `config.py`
registers every `POLARS_*` variable). Nothing else in the library reads the environment.

Usage::

    from arrowbuf import config
    config.get("ARROWBUF_SHM_DIR")                 # the value now: the environment's, else the default
    with config.override(ARROWBUF_JOURNAL_DIRECT=False):
        store = ab.ExperienceStore(schema, 1000, durable="run/")   # opened under the override (tests, tools)
    config.describe()                              # {name: (value, doc)} of every variable

Variables:

- `ARROWBUF_SHM_DIR` (default `/dev/shm`): where shared-memory stores keep their files.
- `ARROWBUF_SHM_LOCKS` (default: process-shared pthread mutexes where the platform has them): `flock` makes shared
  stores use file locks.
- `ARROWBUF_JOURNAL_DIRECT` (default on): a durable store's journal writes records of 1 MiB and more with direct
  I/O where the filesystem allows it (`arrowbuf.persist.appender`); `0` turns it off. `StoreOptions.journal_direct`
  sets it per store.
- `ARROWBUF_PROGRESS_INTERVAL` (default 2): seconds between two progress lines of a long-running command (the demos,
  `arrowbuf checkpoint verify|export`, `arrowbuf inspect` of a checkpoint) when its output is not a terminal
  (`arrowbuf.observe.meter`); read when a progress display starts.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variable:
    """One registered environment variable: its parser (the environment's string to a value) and default."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off", "")


REGISTRY: dict[str, Variable] = {}
_overrides: dict[str, Any] = {}
_lock = threading.Lock()


def register(name: str, default: Any, parse: Callable[[str], Any], doc: str) -> Variable:
    """Register variable `name` (once; the module docstring lists them)."""
    if not name.startswith("ARROWBUF_"):
        raise ValueError(f"arrowbuf's variables start with ARROWBUF_, got {name!r}")
    var = REGISTRY[name] = Variable(name, default, parse, doc)
    return var


register("ARROWBUF_SHM_DIR", "/dev/shm", str, "where shared-memory stores keep their files")
register("ARROWBUF_SHM_LOCKS", "pthread", lambda s: s.strip().lower(),
         "'flock' makes shared-memory stores use file locks instead of process-shared pthread mutexes")
register("ARROWBUF_JOURNAL_DIRECT", True, _flag,
         "a durable store's journal writes records of 1 MiB and more with direct I/O where the filesystem allows it")
register("ARROWBUF_PROGRESS_INTERVAL", 2.0, lambda s: max(0.0, float(s)),
         "seconds between two progress lines of a long-running command when its output is not a terminal")


def get(name: str) -> Any:
    """The value of registered variable `name` now: an `override`, else the environment's (parsed), else the
    default.

    Raises:
        KeyError: `name` is not registered.
    """
    var = REGISTRY[name]
    with _lock:
        if name in _overrides:
            return _overrides[name]
    text = os.environ.get(name)
    return var.default if text is None else var.parse(text)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set registered variables for the stores opened inside the block (then restore them)."""
    unknown = sorted(set(values) - set(REGISTRY))
    if unknown:
        raise KeyError(f"unknown arrowbuf variables {unknown}; registered: {sorted(REGISTRY)}")
    with _lock:
        saved = {k: _overrides[k] for k in values if k in _overrides}
        _overrides.update(values)
    try:
        yield
    finally:
        with _lock:
            for k in values:
                _overrides.pop(k, None)
            _overrides.update(saved)


def describe() -> dict[str, tuple[Any, str]]:
    """Every registered variable: its value now and what it means."""
    return {name: (get(name), var.doc) for name, var in REGISTRY.items()}


__all__ = ["REGISTRY", "Variable", "describe", "get", "override", "register"]
