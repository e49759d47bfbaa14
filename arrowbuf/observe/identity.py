"""Who acts now: the writer or consumer name recorded in lineage (`arrowbuf.observe.lineage`).

The name is a context variable, so it follows the calling thread (and asyncio task): the Flight server sets it to the
calling client for the duration of each call (`acting_as`), and a user process may name its actors the same way::

    with ab.observe.identity.acting_as("actor-3"):
        store.extend(batch)          # lineage records writer "actor-3"

Without one, the name is this process's: "<hostname>:<pid>". Names are interned into small integer codes
(`NAMES`, one table per process): lineage keeps 4 bytes per row for the writer, whatever the name's length.
"""

from __future__ import annotations

import contextvars
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Longest name kept (longer ones are cut): names come from remote clients, so they are bounded.
MAX_NAME_CHARS = 200
#: Distinct names a store remembers; past this, new names are recorded as OTHER.
MAX_NAMES = 65_536
OTHER = "(other)"


def process_name() -> str:
    """This process's default name: "<hostname>:<pid>"."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Names:
    """Interning of names to int32 codes (code 0 is OTHER); bounded by `MAX_NAMES`. Thread-safe."""

    def __init__(self, limit: int = MAX_NAMES) -> None:
        self._codes: dict[str, int] = {OTHER: 0}
        self._names: list[str] = [OTHER]
        self._limit = int(limit)
        self._lock = threading.Lock()

    def code(self, name: str) -> int:
        """The code of `name` (a new one when unseen, OTHER's when the table is full)."""
        name = str(name)[:MAX_NAME_CHARS]
        c = self._codes.get(name)
        if c is not None:
            return c
        with self._lock:
            c = self._codes.get(name)
            if c is None:
                if len(self._names) >= self._limit:
                    return 0
                c = len(self._names)
                self._names.append(name)
                self._codes[name] = c
            return c

    def names(self) -> list[str]:
        """Every name by code (index = code)."""
        with self._lock:
            return list(self._names)


#: The process-wide name table: lineage arrays hold its codes.
NAMES = Names()
DEFAULT_CODE = [NAMES.code(process_name())]
#: The code of whoever acts in this context (default: this process's name; a forked child resets it).
CURRENT: contextvars.ContextVar[int] = contextvars.ContextVar("arrowbuf_actor", default=DEFAULT_CODE[0])


def current_code() -> int:
    """The code (in `NAMES`) of whoever acts in this context now."""
    return CURRENT.get()


def current() -> str:
    """The name of whoever acts in this context now (see the module docstring)."""
    return NAMES.names()[current_code()]


@contextmanager
def acting_as(name: str) -> Iterator[None]:
    """Within the block, writes and consumes in this context are recorded as `name` (cut to MAX_NAME_CHARS)."""
    token = CURRENT.set(NAMES.code(name))
    try:
        yield
    finally:
        CURRENT.reset(token)


def after_fork() -> None:
    """Refresh the process name in a forked child (its only thread acts as the new process from now on)."""
    DEFAULT_CODE[0] = NAMES.code(process_name())
    CURRENT.set(DEFAULT_CODE[0])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork)
