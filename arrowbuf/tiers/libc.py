"""The C library, loaded once for the ctypes calls arrowbuf makes (futexes, robust mutexes, madvise, sync_file_range).

`libc.so.6` (glibc) is opened by name, with no `ldconfig` subprocess: `ctypes.util.find_library` runs one, and a
process forked for it from a thread of a process with torch loaded can hang in an at-fork handler. Elsewhere (musl,
macOS) the library is looked up once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_lock = threading.Lock()
_names: list[str] = []


def _name() -> str | None:
    with _lock:
        if not _names:
            try:
                ctypes.CDLL("libc.so.6")
                _names.append("libc.so.6")
            except OSError:
                _names.append(ctypes.util.find_library("c") or "")
        return _names[0] or None


def libc(keep_gil: bool = False) -> ctypes.CDLL:
    """The C library: a `CDLL` (calls release the interpreter lock: for calls that may wait) or, with `keep_gil`, a
    `PyDLL` (calls keep it: cheaper for calls that never wait). `errno` is kept for `ctypes.get_errno`.

    Raises:
        OSError: no C library could be loaded.
    """
    cls = ctypes.PyDLL if keep_gil else ctypes.CDLL
    return cls(_name(), use_errno=True)
