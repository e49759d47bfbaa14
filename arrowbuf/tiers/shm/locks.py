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

from ...errors import ArrowbufError, StoreClosed, StoreCorrupt
from ..futex import FUTEX
from ..libc import libc


class _Pthread:
    """libc's process-shared robust mutexes through ctypes (Linux: glibc or musl)."""

    PROCESS_SHARED = 1
    ROBUST = 1

    def __init__(self) -> None:
        blocking = libc()  # releases the GIL while it waits
        quick = libc(keep_gil=True)  # keeps the GIL: cheaper for calls that never wait
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


#: glibc keeps a robust mutex's holder thread id in the first int of pthread_mutex_t (with FUTEX_WAITERS and
#: FUTEX_OWNER_DIED as the top bits); other C libraries lay it out differently, and the stuck-holder check is off there.
def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # type: ignore[union-attr]
    except (ValueError, OSError, AttributeError):
        return False


_GLIBC = sys.platform.startswith("linux") and _is_glibc()
_FUTEX_TID_MASK = 0x3FFFFFFF
#: Consecutive 50 ms waits with the same holder before the holder is checked (a live holder is never declared stuck).
_STUCK_SLICES = 10
#: A waiter that waited this long asks for the lock to be handed to it (see `RobustMutex`).
_STARVE_S = 0.002
#: Byte offset, in a lock's 64-byte slot, of the hand-off word pair (thread id, pid) after the pthread_mutex_t.
_HAND_AT = 48


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class RobustMutex:
    """A process-shared robust pthread mutex in shared memory: the lock of a shared store.

    When its holder dies (SIGKILL included) the kernel marks it owner-dead; the next locker gets it with EOWNERDEAD,
    marks it consistent and goes on, so a crashed holder never blocks the others. It also excludes the threads of one
    process. An uncontended acquire/release is two libc calls and no system call; a contended one sleeps on a futex.
    Works as the lock of a `threading.Condition`.

    Fair by hand-off: a pthread mutex lets a thread that releases it and locks it again at once (a writer in a tight
    loop) win over a waiter every time, starving it. Here a waiter that waited `_STARVE_S` writes its thread id and pid
    into the hand-off word beside the mutex; while it is set, every other locker (except waiters starved too) first
    waits for it to clear (a futex on the word), so the starved waiter gets the lock at the next release, clears the
    word and wakes them. A hand-off word left by a thread that no longer exists is cleared by whoever waits on it.
    """

    def __init__(self, mem: np.ndarray, init: bool, where: str = "", store_dir: str | None = None,
                 file_ino: int = -1) -> None:
        self._mem = mem  # keeps the mapping alive while the lock is used
        self.where = where or "a shared-memory lock"
        self._store_dir = store_dir  # to tell a holder that can hold this lock from one that cannot
        self._file_ino = file_ino    # inode of the file the lock lives in (a holder has it mapped)
        lib = pthread_lib()
        if lib is None:
            raise ArrowbufError("process-shared robust mutexes are not available here; use flock locks")
        self._lib: _Pthread = lib
        self._addr = mem.ctypes.data
        self._hand = mem[_HAND_AT:_HAND_AT + 8].view(np.uint32)  # (thread id, pid) of a starved waiter, or zeros
        self._hand_addr = self._addr + _HAND_AT
        if init:
            self._lib.init(self._addr)
            self._hand[:] = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lib = self._lib
        forever = timeout is None or timeout < 0
        if self._hand[0] and not self._wait_hand_off(blocking, None if forever else time.time() + timeout):
            return False
        r = lib.trylock(self._addr)
        if r == errno.EBUSY:
            if not blocking:
                return False
            deadline = time.time() + (0.0 if forever else timeout)
            seen, same = -1, 0
            slice_s = _STARVE_S  # the first wait is short: a waiter starved that long asks for a hand-off
            try:
                while True:  # in slices: between them Python runs signal handlers (Ctrl-C stops a blocked process)
                    at = time.time() + slice_s if forever else min(deadline, time.time() + slice_s)
                    ts = _Timespec(int(at), int((at % 1) * 1e9))
                    r = lib.timedlock(self._addr, ctypes.addressof(ts))
                    if r != errno.ETIMEDOUT:
                        break
                    if not forever and time.time() >= deadline:
                        return False
                    if slice_s == _STARVE_S:
                        slice_s = 0.05
                    if not self._hand[0]:
                        self._hand[1] = os.getpid()
                        self._hand[0] = threading.get_native_id()
                    seen, same = self._wait_slice(seen, same)
            finally:
                if r != 0 and r != errno.EOWNERDEAD:
                    self._clear_hand()
        if self._hand[0]:
            self._clear_hand()
        if r == errno.EOWNERDEAD:  # its holder died: what it guarded is in a state the store tolerates
            lib.consistent(self._addr)
            r = 0
        if r:
            raise StoreCorrupt(f"{self.where} cannot be locked (pthread_mutex_lock: {os.strerror(r)}): its memory "
                               "was overwritten. The store cannot be used safely: recreate it")
        return True

    def _wait_slice(self, seen: int, same: int) -> tuple[int, int]:
        """After a timed-out slice: the same holder for many slices must be one that can ever release the lock.
        Returns the new (seen, same)."""
        word = self._word()
        same = same + 1 if word == seen else 0
        seen = word
        if same == _STUCK_SLICES:
            why = self._unreleasable(word)
            if why:
                raise StoreCorrupt(f"{self.where} is {why}: its memory was overwritten, nobody can ever "
                                   "release it. The store cannot be used safely: recreate it")
            same = 0
        return seen, same

    def _clear_hand(self) -> None:
        """Clear the hand-off word if this thread set it, and wake the lockers waiting for it to clear."""
        hand = self._hand
        if hand[0] == threading.get_native_id() and hand[1] == os.getpid():
            hand[0] = 0
            hand[1] = 0
            if FUTEX is not None:
                FUTEX.wake(self._hand_addr)

    def _wait_hand_off(self, blocking: bool, deadline: float | None) -> bool:
        """Another waiter starved and asked for the lock: wait until it got it (the word clears). False when not
        `blocking` or past `deadline`. A word naming a thread that does not exist is cleared here."""
        hand = self._hand
        since = time.time()
        while True:
            tid, pid = int(hand[0]), int(hand[1])
            if not tid or (tid == threading.get_native_id() and pid == os.getpid()):
                return True
            if not blocking:
                return False
            now = time.time()
            if deadline is not None and now >= deadline:
                return False
            if now - since > 0.05:  # slow: is the thread that asked still there?
                if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                    if hand[0] == tid:
                        hand[0] = 0
                        hand[1] = 0
                    continue
                since = now
            left = 0.05 if deadline is None else min(0.05, max(0.0, deadline - now))
            if FUTEX is not None:
                FUTEX.wait(self._hand_addr, tid, left)
            else:
                time.sleep(min(left, 0.0005))

    def _word(self) -> int:
        """The mutex's lock word (glibc: the holder's thread id and the FUTEX_WAITERS and FUTEX_OWNER_DIED bits; -1
        where the layout is unknown)."""
        return ctypes.c_uint32.from_address(self._addr).value if _GLIBC else -1

    def _unreleasable(self, word: int) -> str:
        """Why the holder named by the lock word can never release it ('' when it may, or when that is unknown).

        A robust mutex's holder that dies is marked by the kernel (the next locker gets EOWNERDEAD), so a lock word
        naming a thread that does not exist, or a thread of a process that does not have the lock's memory mapped
        (a forked child of a process with the store open has), can only come from overwritten memory. Checked only
        where every process with the store open is visible in this process's /proc (one pid namespace), since
        thread ids are per namespace, and only for processes whose memory map this one may read.
        """
        tid = word & _FUTEX_TID_MASK
        if word < 0 or tid == 0 or self._store_dir is None:
            return ""
        if tid == threading.get_native_id():
            return f"marked as held by this very thread (id {tid}), which is waiting for it"
        from .janitor import lease_holders
        from .paths import start_time

        if any(start_time(pid) != started for pid, started in lease_holders(self._store_dir)):
            return ""  # a process with the store open is not ours to see (another pid namespace): cannot tell
        try:
            with open(f"/proc/{tid}/status") as f:
                tgid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
        except FileNotFoundError:
            return f"marked as held by thread {tid}, which does not exist"
        except (OSError, StopIteration, ValueError):
            return ""
        try:
            with open(f"/proc/{tgid}/maps") as f:
                mapped = any(len(parts) > 4 and parts[4] == str(self._file_ino) for parts in map(str.split, f))
        except OSError:  # gone meanwhile, or not ours to read
            return ""
        if not mapped and self._file_ino > 0:
            return f"marked as held by thread {tid} of process {tgid}, which does not have the store's locks mapped"
        return ""

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
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)  # never through a link
            self._fd = os.open(self.path, flags, 0o600)
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
