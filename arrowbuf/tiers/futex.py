"""Linux futexes through libc's syscall(): sleep until a 32-bit word in (shared) memory changes, and wake sleepers.

Not private (no FUTEX_PRIVATE_FLAG): a word in a shared mapping wakes waiters of every process that maps it. `FUTEX`
is None where this is not available (not Linux, or an unknown architecture); callers then sleep briefly instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

from .libc import libc


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE (not private: works across processes on a shared mapping) through libc's syscall()."""

    WAIT, WAKE = 0, 1

    def __init__(self, number: int) -> None:
        self._syscall = libc().syscall  # (a CDLL: drops the GIL)
        self._syscall.restype = ctypes.c_long
        self._number = number

    def wait(self, addr: int, expected: int, seconds: float) -> None:
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        self._syscall(ctypes.c_long(self._number), ctypes.c_void_p(addr), ctypes.c_int(self.WAIT),
                      ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0))

    def wake(self, addr: int) -> None:
        self._syscall(ctypes.c_long(self._number), ctypes.c_void_p(addr), ctypes.c_int(self.WAKE),
                      ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


def _futex() -> _Futex | None:
    if not sys.platform.startswith("linux") or _FUTEX_SYSCALL is None or sys.byteorder != "little":
        return None
    try:
        return _Futex(_FUTEX_SYSCALL)
    except (OSError, AttributeError):
        return None


FUTEX = _futex()
