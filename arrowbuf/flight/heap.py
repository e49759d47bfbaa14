"""Give the C heap's free memory back to the operating system after a large Flight message.

gRPC receives a message into many small heap pieces (slices) and Arrow copies them into one buffer; once the batch is
built the pieces are freed, but glibc keeps freed memory of its per-thread arenas in the process (measured: about
half to all of the payload stays resident after each large receive, so the peaks of repeated transfers add up).
`release_after(nbytes)` asks glibc to return its free pages (`malloc_trim(0)`) after a message of at least
`LARGE_MESSAGE` bytes; it only releases memory that is already free. Elsewhere (another libc, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

#: A message at least this large (bytes) is followed by a trim; smaller ones leave too little behind to matter.
LARGE_MESSAGE = 16 << 20


def _malloc_trim() -> Callable[[int], Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...)
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_after(nbytes: int) -> None:
    """Return the heap's free pages to the OS when a message of `nbytes` was large enough to leave many behind."""
    if _TRIM is not None and nbytes >= LARGE_MESSAGE:
        _TRIM(0)


__all__ = ["LARGE_MESSAGE", "release_after"]
