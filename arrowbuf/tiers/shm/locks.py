"""The cross-process locks of a shared store: robust pthread mutexes in shared memory, or flock'ed files."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from ...errors import ArrowbufError, StoreClosed


class _Pthread:
    """libc's process-shared robust mutexes through ctypes (Linux: glibc or musl)."""

    PROCESS_SHARED = 1
    ROBUST = 1

    def __init__(self) -> None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        blocking = ctypes.CDLL(name, use_errno=True)  # releases the GIL while it waits
        quick = ctypes.PyDLL(name, use_errno=True)    # keeps the GIL: cheaper for calls that never wait
        vp = ctypes.c_void_p
        self.timedlock = _fn(blocking.pthread_mutex_timedlock, vp, vp)
        self.trylock = _fn(quick.pthread_mutex_trylock, vp)
        self.unlock = _fn(quick.pthread_mutex_unlock, vp)
        self.consistent = _fn(quick.pthread_mutex_consistent, vp)
        self._init = _fn(quick.pthread_mutex_init, vp, vp)
        self._attr_init = _fn(quick.pthread_mutexattr_init, vp)
        self._attr_pshared = _fn(quick.pthread_mutexattr_setpshared, vp, ctypes.c_int)
        self._attr_robust = _fn(quick.pthread_mutexattr_setrobust, vp, ctypes.c_int)
        self._attr_destroy = _fn(quick.pthread_mutexattr_destroy, vp)

    def init(self, addr: int) -> None:
        attr = ctypes.create_string_buffer(64)
        for r in (self._attr_init(attr), self._attr_pshared(attr, self.PROCESS_SHARED),
                  self._attr_robust(attr, self.ROBUST), self._init(addr, attr), self._attr_destroy(attr)):
            if r:
                raise OSError(r, f"pthread mutex init: {os.strerror(r)}")


def _fn(f: Any, *argtypes: Any) -> Any:
    f.argtypes, f.restype = list(argtypes), ctypes.c_int
    return f


_PTHREAD: list[_Pthread | None] = []


def pthread_lib() -> _Pthread | None:
    """The libc binding, or None where process-shared robust mutexes are not available (then: flock)."""
    if not _PTHREAD:
        try:
            _PTHREAD.append(_Pthread() if sys.platform.startswith("linux") else None)
        except (OSError, AttributeError):
            _PTHREAD.append(None)
    return _PTHREAD[0]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class RobustMutex:
    """A process-shared robust pthread mutex in shared memory: the lock of a shared store.

    When its holder dies (SIGKILL included) the kernel marks it owner-dead; the next locker gets it with EOWNERDEAD,
    marks it consistent and goes on, so a crashed holder never blocks the others. It also excludes the threads of one
    process. An uncontended acquire/release is two libc calls and no system call; a contended one sleeps on a futex.
    Works as the lock of a `threading.Condition`.
    """

    def __init__(self, mem: np.ndarray, init: bool) -> None:
        self._mem = mem  # keeps the mapping alive while the lock is used
        lib = pthread_lib()
        if lib is None:
            raise ArrowbufError("process-shared robust mutexes are not available here; use flock locks")
        self._lib: _Pthread = lib
        self._addr = mem.ctypes.data
        if init:
            self._lib.init(self._addr)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lib = self._lib
        r = lib.trylock(self._addr)
        if r == errno.EBUSY:
            if not blocking:
                return False
            forever = timeout is None or timeout < 0
            deadline = time.time() + (0.0 if forever else timeout)
            while True:  # in slices: between them Python runs signal handlers (Ctrl-C stops a blocked process)
                at = time.time() + 0.05 if forever else min(deadline, time.time() + 0.05)
                ts = _Timespec(int(at), int((at % 1) * 1e9))
                r = lib.timedlock(self._addr, ctypes.addressof(ts))
                if r != errno.ETIMEDOUT:
                    break
                if not forever and time.time() >= deadline:
                    return False
        if r == errno.EOWNERDEAD:  # its holder died: what it guarded is in a state the store tolerates
            lib.consistent(self._addr)
            r = 0
        if r:
            raise OSError(r, f"pthread_mutex_lock: {os.strerror(r)}")
        return True

    def release(self) -> None:
        r = self._lib.unlock(self._addr)
        if r:
            raise RuntimeError(f"release of a lock this thread does not hold ({os.strerror(r)})")

    def close(self) -> None:
        """Nothing to release (the memory goes with the tier's mappings)."""

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RobustMutex(0x{self._addr:x})"


class FlockLock:
    """A lock shared by the threads of one process (a `threading.Lock`) and by processes (flock on a file): the
    fallback where robust pthread mutexes are not available.

    The kernel drops a process's flock when it dies, so a holder killed with SIGKILL never blocks the others. Works
    as the lock of a `threading.Condition` (waits release and re-take both). A forked child reopens the file: flock
    belongs to an open file description, which fork shares.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._tlock = threading.Lock()
        self._fd = -1
        self._pid = -1
        self._closed = False
        self._file()  # open now: a handle keeps working after the store's name is removed

    def _file(self) -> int:
        if self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
        return self._fd

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not (self._tlock.acquire(True, timeout) if blocking else self._tlock.acquire(False)):
            return False
        try:
            if self._closed:
                raise StoreClosed(f"lock {self.path} is closed")
            fd = self._file()
            if blocking and timeout < 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
                return True
            deadline = time.monotonic() + max(0.0, timeout)
            pause = 1e-4
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if not blocking or left <= 0:
                        self._tlock.release()
                        return False
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, 0.01)
        except BaseException:
            self._tlock.release()
            raise

    def release(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            if self._closed and self._fd >= 0:
                self._close_fd()
            self._tlock.release()

    def locked(self) -> bool:
        return self._tlock.locked()

    def _close_fd(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = -1, -1

    def close(self) -> None:
        """Close the file; a holder's `release()` closes it if the lock is held now. Idempotent."""
        self._closed = True
        if self._tlock.acquire(False):
            try:
                self._close_fd()
            finally:
                self._tlock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"FlockLock({self.path!r}, locked={self.locked()})"
