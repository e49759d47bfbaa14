"""Page preparation ahead of the write head: a store's first fill at memory speed.

A fresh ring is untouched memory: the first write of every page faults, and the kernel (on a VM, the host too)
finds, zeroes and maps a page before the copy goes on. cpprb pays this up front (its constructor zeroes the whole
ring); a plain numpy ring pays it inside the first fill. `PagePreparer` pays it beside the writer instead: a
background thread asks the kernel to map the pages of the next `window` bytes of every ring arena ahead of the
write head (`madvise(MADV_POPULATE_WRITE)`, Linux >= 5.14; `mlock` + `munlock` of small steps where that is
missing), so the writer copies into pages that are already there, and the store's constructor returns at once.

    prep = PagePreparer([obs_arena, action_arena], ring_rows=arena_rows)   # starts preparing rows [0, window)
    prep.advance(head)      # the writer, after reserving rows up to seq `head` (cheap: a store and a compare)
    prep.wait_idle()        # (tests) until the thread has prepared up to its target or finished
    prep.close()            # stops and joins the thread; it holds no reference to the arenas afterwards

Rules:
- It never writes a byte of the arenas (populating maps pages, contents stay as they are), never takes a store
  lock, and the writer never waits for it: `advance` stores the head and, only when the thread is waiting for
  work, notifies it. A writer that overtakes it (the copy is faster than the kernel maps pages) faults the rest of
  its batch itself while the thread goes on past the batch (the head is passed on when rows are reserved, before
  they are copied): both then fault different pages at once (on a VM, the host maps guest pages for two vCPUs in
  parallel).
- A forked child does not prepare (the thread stays in the parent).
- How far ahead it goes adapts to what a page costs (`_adapt`): where the kernel maps pages at memory speed
  (> 3 GB/s) it leads by two steps only (the writer's own faults are cheap there, and a page zeroed long before
  its copy has left the cache); where pages are slow (a VM whose host must back guest memory first, measured at
  0.05-0.5 GB/s here), by the whole window.
- It runs once per ring: when the head passes the ring's end, every page has been written and the thread ends.
- It holds only weak references to the arenas while it waits, and a strong one for one `madvise` call at a time,
  so a store dropped without `close` frees its memory (a finaliser stops the thread).
- Only rings that fit in RAM are prepared (`fits_in_ram`: the ring plus a window within MemAvailable); a tiered
  store's sparse arenas (rings bigger than RAM, memory held per chunk) are never prepared.

`HostTier` (tiers/host.py) owns the decision and makes one per store (`HostTier(prefault=False)` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .libc import libc

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python < 3.12 lacks the constant
#: Bytes prepared ahead of the write head (summed over a store's arenas).
DEFAULT_WINDOW = 256 << 20
#: Rings smaller than this are not worth a thread: their pages fault in a few milliseconds.
MIN_RING_BYTES = 32 << 20
_STEP = 16 << 20  # bytes of one arena prepared per call (bounds how long `close` waits for the thread); each call
# gives the GIL back and takes it again, which on a busy machine can cost the writer a scheduler wake-up
_FAST_BPS = 3e9  # pages mapped faster than this (bytes/s) are cheap: prepare only a little ahead (`_adapt`)
_SMALL = 1 << 20  # arenas with fewer ring bytes (rewards, flags, actions) are left to fault in the writer
_NEVER = 1 << 62

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = libc()
        # (a CDLL releases the GIL during these calls: the writer copies meanwhile)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mlock.argtypes = lib.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.restype = lib.mlock.restype = lib.munlock.restype = ctypes.c_int
        _libc = lib
    return _libc


def populate(address: int, nbytes: int, method: str = "populate") -> int:
    """Map the pages of [address, address + nbytes) writable without changing their contents; returns 0 or errno.

    `method`: "populate" (`madvise(MADV_POPULATE_WRITE)`) or "mlock" (`mlock` then `munlock`; keep `nbytes` under
    RLIMIT_MEMLOCK). The range is widened to whole pages.
    """
    start = address - address % PAGE
    length = -(-(address + nbytes - start) // PAGE) * PAGE
    lib = _lib()
    if method == "populate":
        rc = lib.madvise(start, length, MADV_POPULATE_WRITE)
    else:
        rc = lib.mlock(start, length)
        if rc == 0:
            lib.munlock(start, length)
    return 0 if rc == 0 else (ctypes.get_errno() or errno.EINVAL)


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where unknown (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits_in_ram(ring_bytes: int, window: int = DEFAULT_WINDOW) -> bool:
    """True when a ring of `ring_bytes` plus one window fits in the memory available now."""
    avail = mem_available()
    return avail is not None and ring_bytes + window <= avail


def _method() -> str | None:
    """How this kernel lets us populate pages: "populate", "mlock", or None (neither works)."""
    buf = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(buf)
        addr = ctypes.addressof(view)
        try:
            for method in ("populate", "mlock"):
                if populate(addr, PAGE, method) == 0:
                    return method
            return None
        finally:
            del view
    finally:
        buf.close()


_METHOD: list[str | None] = []


def kernel_method() -> str | None:
    """`_method()` once per process."""
    if not _METHOD:
        _METHOD.append(_method())
    return _METHOD[0]


class PagePreparer:
    """Prepares the pages of ring arenas ahead of the write head in a background thread (see the module docstring).

    Args:
        arenas: C-contiguous arrays whose first `ring_rows` rows are ring positions (row `seq % ring_rows`); rows
            after those (a column's final observations) and arenas of under 1 MiB are left to the writer.
        ring_rows: rows of the ring.
        window: bytes (summed over the arenas) prepared ahead of the head.
        method: "populate" or "mlock"; None: what the kernel offers (`kernel_method`).
        name: thread name suffix (the store's name).
    """

    def __init__(self, arenas: Sequence[np.ndarray], ring_rows: int, window: int = DEFAULT_WINDOW,
                 method: str | None = None, name: str = "") -> None:
        self.ring_rows = int(ring_rows)
        self.method = method or kernel_method()
        total = max(1, sum(int(a.strides[0]) for a in arenas))  # the window counts every arena
        arenas = [a for a in arenas if int(a.strides[0]) * self.ring_rows >= _SMALL]
        self.row_bytes = [int(a.strides[0]) for a in arenas]
        self.window_rows = max(1, int(window) // total)
        self.lead_rows = self.window_rows  # how far ahead it prepares now (`_adapt`)
        self.step_rows = max(1, _STEP // max(self.row_bytes, default=1))
        if self.method == "mlock":  # keep each locked range well under RLIMIT_MEMLOCK
            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            cap = _STEP if soft == resource.RLIM_INFINITY else max(PAGE, soft // 4)
            self.step_rows = max(1, min(self.step_rows, cap // max(self.row_bytes, default=1)))
        self._refs = [weakref.ref(a) for a in arenas]
        self.head = 0            # the writer's reservation head (a seq), from `advance`
        self.prepared = 0        # ring rows [0, prepared) are prepared or written (seq space: the first lap)
        self.prepared_bytes = 0  # bytes the thread populated
        self.error: int | None = None  # errno that stopped it, if any
        self.wake = _NEVER       # `advance` notifies the thread once the head reaches this
        self._stop = False
        self._ended = False  # the thread finished (set before it exits, under the condition)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if self.method is None:
            self.error = errno.ENOSYS
            return
        self._thread = threading.Thread(target=self._run, name=f"arrowbuf-prefault-{name}", daemon=True)
        _LIVE.add(self)
        for a in arenas:  # an arena freed without close (the store was dropped): stop
            weakref.finalize(a, self._finalize, weakref.ref(self))
        self._thread.start()

    # ------------------------------------------------------------------ writer side
    def advance(self, head: int) -> None:
        """Rows up to seq `head` are reserved (the writer, after reserving; costs a store and a compare)."""
        self.head = head
        if head >= self.wake:
            with self._cond:
                self._cond.notify_all()

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        """Whether the thread is still preparing or waiting for the writer."""
        return self._thread is not None and not self._ended and self._thread.is_alive()

    @property
    def target(self) -> int:
        """Ring rows the thread prepares up to now: the head plus the window, at most the ring."""
        return min(self.ring_rows, self.head + self.lead_rows)

    def describe(self) -> dict[str, Any]:
        """State for `stats()`: running, done or stopped, rows prepared, bytes populated, method, error."""
        state = "running" if self.running else ("done" if self.prepared >= self.ring_rows else "stopped")
        return {"state": state, "prepared_rows": self.prepared, "populated_bytes": self.prepared_bytes,
                "window_rows": self.window_rows, "lead_rows": self.lead_rows, "method": self.method,
                "error": None if self.error is None else errno.errorcode.get(self.error, str(self.error))}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the thread has prepared up to its target (the head plus the window) or ended; True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ended or self.prepared >= self.target, timeout)

    def close(self) -> None:
        """Stop the thread and wait for it (at most one populate step); idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _forked(self) -> None:
        """In a forked child: the thread is not there (and its lock may be held): stop preparing."""
        self._cond = threading.Condition()
        self._thread = None
        self._stop = True
        self.wake = _NEVER

    @staticmethod
    def _finalize(ref: weakref.ref[PagePreparer]) -> None:
        self = ref()
        if self is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while self._next():
                pass
        finally:
            with self._cond:
                self.wake = _NEVER
                self._ended = True
                self._cond.notify_all()

    def _adapt(self, nbytes: int, seconds: float) -> None:
        """Pages the kernel maps at memory speed cost the writer little, and a page zeroed long before its copy has
        left the cache (the copy then reads it back from memory): lead by two steps only. Slow pages (a VM's host
        backing guest memory, reclaim): lead by the whole window."""
        if nbytes >= _STEP // 2:
            fast = nbytes >= _FAST_BPS * seconds
            self.lead_rows = min(self.window_rows, 2 * self.step_rows) if fast else self.window_rows

    def _next(self) -> bool:
        """Wait for work, prepare one step of rows; False when finished or stopped."""
        with self._cond:
            while True:
                if self._stop:
                    return False
                # the writer reserved past us: its batch is its own to fault; we go on beyond it (the head is
                # passed on at reservation, before the copy), so both fault different pages at once
                self.prepared = max(self.prepared, min(self.head, self.ring_rows))
                if self.prepared >= self.ring_rows:
                    return False
                if self.target > self.prepared:
                    break
                # wait until the head has moved by a step (re-checked after the store: see `advance`)
                self.wake = self.prepared - self.lead_rows + min(self.step_rows, self.lead_rows)
                if self.head >= self.wake:
                    continue
                self._cond.wait()
            self.wake = _NEVER  # busy: the writer need not notify
            r0 = self.prepared
            r1 = min(self.target, r0 + self.step_rows)
        arenas = [a for a in (w() for w in self._refs) if a is not None]
        if len(arenas) < len(self._refs):  # freed: the store went without close
            return False
        t0, done = time.perf_counter(), 0
        for a, rb in zip(arenas, self.row_bytes):
            n = (r1 - r0) * rb
            if n <= 0:
                continue
            rc = populate(a.ctypes.data + r0 * rb, n, self.method or "populate")
            if rc:
                self.error = rc
                return False
            done += n
        del arenas
        self.prepared_bytes += done
        self._adapt(done, time.perf_counter() - t0)
        with self._cond:
            self.prepared = max(self.prepared, r1)
            self._cond.notify_all()  # (wait_idle)
        return True


_LIVE: weakref.WeakSet[PagePreparer] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    def _after_fork() -> None:
        for p in list(_LIVE):
            p._forked()

    os.register_at_fork(after_in_child=_after_fork)
