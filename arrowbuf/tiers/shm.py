"""The shared-memory tier: a store's arenas as plain files in /dev/shm that every process on the node maps.

Usage::

    store = ExperienceStore(schema, capacity=1_000_000, tier="shm", name="replay")   # creates the segments
    other = ExperienceStore.attach("replay")     # in another process: the same store over the same memory
    other.extend(batch); other.sample(256)       # writers and samplers in any process
    store.close()                                # the creator's close removes the name (see Lifetime)

Layout: one directory per store, ``/dev/shm/arrowbuf.<name>/`` (``$ARROWBUF_SHM_DIR`` overrides the root)::

    owner.lock      flock'ed by the creating process for its whole life; the kernel drops the lock when that process
                    dies, which is how the janitor tells a live store from a stale one (no pid-reuse race)
    owner.json      pid and start time of the creator (informational)
    manifest.json   written by seal(): format version, schema, geometry, sampler and rate-limiter specs, the arenas
    arena.<key>     one file per arena (a column's slots, the ring index, counters), reserved with posix_fallocate at
                    creation so that a later write can never SIGBUS, and mmap'd MAP_SHARED
    arena.tier.locks  the store's locks: process-shared robust pthread mutexes (the kernel marks a dead holder's
                    mutex owner-dead and the next locker takes it over); where libc lacks them, lock.<key> files
                    with flock
    lease.<pid>-..  one per open handle (process), flock'ed while it is open (listing; pruned by the janitor)

Plain files rather than `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks a segment when
any process that attached to it exits.

Lifecycle (Plasma's create, write, seal, get, release, at two levels):

- The store: `SharedMemoryTier.create(name)` makes the directory under a temporary name, takes the owner lock and
  renames it into place (the name is claimed atomically); the store then allocates its arenas (write) and calls
  `seal(meta)`, which publishes the manifest: from then on `attach(name)` (get) maps the same memory in any process.
  `close()` releases this process's mappings and lease (release).
- Rows and chunks: a writer fills free arena rows (create, write; the ring keeps one spare chunk, so no live row is
  touched) and commits them under the state lock (seal: they become visible; a full chunk is sealed and immutable
  until the ring evicts it); readers gather rows or take zero-copy views of sealed chunks (get); views are released by
  dropping them. A sampler checks each row's seq after its gather (a seqlock), so a recycled row is drawn again.

Lifetime: the creator owns the segments. Its `close()` (or `unlink()` from any process) removes the name: processes
still attached keep using their mappings, which the kernel frees when the last one unmaps; new attaches fail. If the
creator dies, the janitor (`gc()`, run on every create and attach, and by ``arrowbuf shm gc``) removes the store.

Views: `to_table()` columns are zero-copy views of the mappings, marked read-only (numpy flags, immutable Arrow
buffers); samples are gathered copies, and `SampleBatch.to_torch()` copies any read-only array, so no tensor it makes
aliases shared memory. The mappings themselves stay writable (a tensor over a read-only mapping segfaults on `add_`);
torch ignores read-only flags in DLPack, so `torch.from_dlpack(column)` of a `to_table()` column aliases the store:
copy it first.

Crash safety: every cross-process lock is a robust mutex (or an flock), which the kernel hands on when its holder
dies, so a writer killed mid-extend never blocks the others; rows it had not committed are invisible and are
overwritten by the next writer.
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import errno
import fcntl
import importlib
import inspect
import json
import mmap
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any
from urllib.parse import quote

import numpy as np

from ..errors import ArrowbufError, InvalidArgument, OutOfSpace, StoreClosed, StoreExists, StoreNotFound
from .base import Tier

#: Version of the on-disk layout (manifest, file names); attach refuses other versions.
FORMAT_VERSION = 1
PREFIX = "arrowbuf."
_NEW_PREFIX = ".arrowbuf-new."     # a store being created (renamed to PREFIX + name when its owner lock is held)
_GONE_PREFIX = ".arrowbuf-gone."   # a store being removed (renamed away first, so the name is free at once)
_OWNER_LOCK = "owner.lock"
_OWNER = "owner.json"
_MANIFEST = "manifest.json"
_GRACE_S = 30.0                    # a directory without an owner lock is left alone this long (not ours, or racing)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
_PAGE = mmap.PAGESIZE
_LOCK_BYTES = 64   # one pthread_mutex_t (40 bytes on x86-64, 48 on arm64) per cache line
_LOCK_SLOTS = 16
#: Modules whose classes a manifest may name as the sampler or rate limiter (attach imports nothing else).
SPEC_MODULES = ("arrowbuf.samplers", "arrowbuf.rate_limiters")


def shm_root(root: str | os.PathLike[str] | None = None) -> str:
    """The directory shared stores live in: `root`, else ``$ARROWBUF_SHM_DIR``, else /dev/shm."""
    return os.fspath(root) if root is not None else os.environ.get("ARROWBUF_SHM_DIR", "/dev/shm")


def store_path(name: str, root: str | os.PathLike[str] | None = None) -> str:
    """The directory of the shared store `name`."""
    _check_name(name)
    return os.path.join(shm_root(root), PREFIX + name)


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


def _pthread() -> _Pthread | None:
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
        lib = _pthread()
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


class SharedMemoryTier(Tier):
    """Arenas in files under /dev/shm, mapped by every process that opens the store.

    Make one with `create(name)` (a new store: `fresh`, its arrays need initialising) or `attach(name)` (an existing,
    sealed store: `manifest` says how to rebuild it; nothing is re-initialised). `ExperienceStore(..., tier="shm")`
    and `ExperienceStore.attach(name)` do this for you.
    """

    name = "shm"
    shared = True

    def __init__(self, store_name: str, path: str, *, fresh: bool, owner_fd: int = -1,
                 manifest: dict[str, Any] | None = None, populate: bool = True) -> None:
        self.store_name = store_name
        self.path = path
        self.fresh = fresh
        self.manifest: dict[str, Any] = manifest or {}
        self.populate = populate
        self._owner_fd = owner_fd          # the creator holds the owner lock for its lifetime
        self._owner_ino = _ino(os.path.join(path, _OWNER_LOCK))
        self._layout: dict[str, dict[str, Any]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._locks: dict[str, RobustMutex | FlockLock] = {}
        info = self.manifest.get("locks", {})
        use_flock = os.environ.get("ARROWBUF_SHM_LOCKS") == "flock" or _pthread() is None
        self._lock_kind = info.get("kind") if not fresh else ("flock" if use_flock else "pthread")
        self._lock_slots: dict[str, int] = dict(info.get("slots", {}))
        self._lock_mem: np.ndarray | None = None
        self._sealed = not fresh
        self._closed = False
        self._lease_fd, self._lease_path = _take_lease(path)

    # ------------------------------------------------------------------ create / attach
    @classmethod
    def create(cls, name: str, *, root: str | os.PathLike[str] | None = None,
               populate: bool = True) -> "SharedMemoryTier":
        """Claim the name `name` for a new store (reclaiming it first if its owner is dead).

        Args:
            name: the store's name: letters, digits, `_`, `.`, `-`.
            root: directory of the segments (default /dev/shm or ``$ARROWBUF_SHM_DIR``).
            populate: pre-fault the mappings (MAP_POPULATE), so the first writes run at memcpy speed.

        Raises:
            StoreExists: a live store of that name exists (attach to it, or pick another name).
        """
        final = store_path(name, root)
        root = shm_root(root)
        gc(root)
        tmp = tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=root)
        try:
            owner_fd = os.open(os.path.join(tmp, _OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(owner_fd, fcntl.LOCK_EX)
            _write_json(os.path.join(tmp, _OWNER), {"pid": os.getpid(), "start_time": _start_time(os.getpid()),
                                                    "name": name, "created": time.time()})
            for attempt in range(2):
                try:
                    os.rename(tmp, final)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    if attempt or not _reclaim_if_stale(final):  # a dead owner's store is reclaimed, then retried
                        raise StoreExists(
                            f"a shared store named {name!r} already exists at {final} (owner {_owner_desc(final)}): "
                            f"attach to it with ExperienceStore.attach({name!r}), or pick another name"
                        ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(name, final, fresh=True, owner_fd=owner_fd, populate=populate)

    @classmethod
    def attach(cls, name: str, *, root: str | os.PathLike[str] | None = None, timeout: float = 0.0,
               populate: bool = True) -> "SharedMemoryTier":
        """Open the sealed store `name`, waiting up to `timeout` seconds for it to be created and sealed.

        Raises:
            StoreNotFound: no live, sealed store of that name.
        """
        path = store_path(name, root)
        gc(root)
        deadline = time.monotonic() + max(0.0, timeout)
        pause = 1e-3
        while True:
            why = f"no shared store named {name!r} ({path} does not exist)"
            if os.path.isdir(path):
                if _reclaim_if_stale(path):
                    why = f"the shared store {name!r} was stale (its owner died) and has been reclaimed"
                else:
                    try:
                        with open(os.path.join(path, _MANIFEST)) as f:
                            manifest = json.load(f)
                        break
                    except FileNotFoundError:
                        why = f"the shared store {name!r} is being created and is not sealed yet"
            left = deadline - time.monotonic()
            if left <= 0:
                wait = "did not wait (timeout=0)" if timeout <= 0 else f"waited {timeout}s"
                raise StoreNotFound(f"{why}; {wait}. Create it with ExperienceStore(..., tier='shm', "
                                    f"name={name!r}) or pass attach(..., timeout=) to wait for it")
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.05)
        if manifest.get("format") != FORMAT_VERSION:
            raise ArrowbufError(f"shared store {name!r} has format {manifest.get('format')!r}; this arrowbuf reads "
                                f"format {FORMAT_VERSION}: open it with the arrowbuf version that created it")
        return cls(name, path, fresh=False, manifest=manifest, populate=populate)

    # ------------------------------------------------------------------ Tier interface
    def reserve(self, nbytes: int) -> None:
        """Fail now, with OutOfSpace, if `nbytes` more will not fit in the file system (creation only)."""
        if not self.fresh or self._sealed:
            return
        vfs = os.statvfs(self.path)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        needed = int(nbytes) + 64 * _PAGE
        if needed > free:
            self._abort()
            raise OutOfSpace(
                f"shared store {self.store_name!r} needs {_fmt(needed)} in {os.path.dirname(self.path)} but only "
                f"{_fmt(free)} is free (of {_fmt(total)}): free space there (docker: --shm-size), or create the "
                "store with a smaller capacity"
            )

    def allocate(self, key: str, dtype: Any, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """A writable array [rows, *shape] over the file of `key`: created (and reserved) by the creator, mapped
        as it is by an attaching process, which checks it against the manifest."""
        self._check_open()
        dtype, rows, shape = np.dtype(dtype), int(rows), tuple(int(s) for s in shape)
        count = rows * int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        entry = {"file": "arena." + quote(key, safe=""), "dtype": dtype.str, "rows": rows, "shape": list(shape),
                 "bytes": size}
        file = os.path.join(self.path, entry["file"])
        if self.fresh:
            if self._sealed or key in self._layout:
                raise ArrowbufError(f"arena {key!r}: the store is sealed or the key exists; arenas are made once")
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                self._reserve_file(fd, size, key)
                mm = self._map(fd, size)
            finally:
                os.close(fd)
        else:
            want = self.manifest.get("arenas", {}).get(key)
            if want is None:
                raise ArrowbufError(f"shared store {self.store_name!r} has no arena {key!r}; it has "
                                    f"{sorted(self.manifest.get('arenas', {}))}: was it made by another version?")
            if want != entry:
                raise ArrowbufError(f"shared store {self.store_name!r}: arena {key!r} is {want}, expected {entry}")
            fd = os.open(file, os.O_RDWR | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_size != size:
                    raise ArrowbufError(f"shared store {self.store_name!r}: {file} has the wrong size")
                mm = self._map(fd, size)
            finally:
                os.close(fd)
        self._layout[key] = entry
        self._maps[key] = mm
        return np.frombuffer(mm, dtype=dtype, count=count).reshape((rows, *shape))

    def _map(self, fd: int, size: int) -> mmap.mmap:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self.populate else 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def _reserve_file(self, fd: int, size: int, key: str) -> None:
        """Back the whole file with pages now: a store that does not fit fails here, never with SIGBUS later."""
        vfs = os.statvfs(self.path)
        free = vfs.f_bavail * vfs.f_frsize
        try:
            if size > free:
                raise OSError(errno.ENOSPC, "no space")
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: size it only
                os.ftruncate(fd, size)
                return
            self._abort()
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
                raise OutOfSpace(
                    f"shared store {self.store_name!r}: arena {key!r} needs {_fmt(size)} in "
                    f"{os.path.dirname(self.path)} but only {_fmt(free)} is free: free space there "
                    "(docker: --shm-size), or create the store with a smaller capacity"
                ) from None
            raise

    def nbytes(self) -> int:
        return sum(e["bytes"] for e in self._layout.values())

    def lock(self, key: str) -> RobustMutex | FlockLock:  # type: ignore[override]
        """The cross-process lock `key` of this store (one object per key and process): a robust pthread mutex in
        the store's memory where libc has them, else an flock on a file. Both are released when the holder dies."""
        self._check_open()
        if key in self._locks:
            return self._locks[key]
        if self._lock_kind == "flock":
            lk: RobustMutex | FlockLock = FlockLock(os.path.join(self.path, "lock." + quote(key, safe="")))
        else:
            if self._lock_mem is None:
                self._lock_mem = self.allocate("tier.locks", np.dtype(np.uint8), _LOCK_SLOTS * _LOCK_BYTES)
            fresh = key not in self._lock_slots
            if fresh:
                if not self.fresh or self._sealed or len(self._lock_slots) >= _LOCK_SLOTS:
                    raise ArrowbufError(f"shared store {self.store_name!r} has no lock {key!r}; it has "
                                        f"{sorted(self._lock_slots)} (locks are made before the store is sealed)")
                self._lock_slots[key] = len(self._lock_slots)
            at = self._lock_slots[key] * _LOCK_BYTES
            lk = RobustMutex(self._lock_mem[at:at + _LOCK_BYTES], init=fresh)
        self._locks[key] = lk
        return lk

    def seal(self, meta: dict[str, Any]) -> None:
        """Publish the manifest: `meta` (what the store needs to rebuild itself; sampler and rate-limiter objects
        are written as spec strings) plus the format version, owner and arenas. The store is attachable from here."""
        if not self.fresh or self._sealed:
            return
        try:
            owner = _read_json(os.path.join(self.path, _OWNER))
            manifest = {"format": FORMAT_VERSION, "name": self.store_name, **meta,
                        "owner": {"pid": owner["pid"], "start_time": owner["start_time"]},
                        "locks": {"kind": self._lock_kind, "slots": self._lock_slots},
                        "arenas": self._layout}
            manifest = json.loads(json.dumps(manifest, default=to_spec))
            _write_json(os.path.join(self.path, _MANIFEST), manifest)
        except BaseException:
            self._abort()
            raise
        self.manifest = manifest
        self._sealed = True

    # ------------------------------------------------------------------ lifetime
    @property
    def owner(self) -> bool:
        """True in the process that created the store (its close() removes the name)."""
        return self._owner_fd >= 0

    def info(self) -> dict[str, Any]:
        """Where the store lives, who owns it and which processes have it open."""
        return {"path": self.path, "owner_pid": self.manifest.get("owner", {}).get("pid", os.getpid()),
                "attached_pids": _live_leases(self.path), "bytes": self.nbytes()}

    def address_range(self, key: str) -> tuple[int, int]:
        """(first address, size) of the mapping of `key` in this process (to check that views are zero-copy)."""
        arr = np.frombuffer(self._maps[key], dtype=np.uint8)
        return arr.ctypes.data, arr.nbytes

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"shared store {self.store_name!r} is closed in this process")

    def _abort(self) -> None:
        """Creation failed: remove everything made so far (nobody else can have attached: not sealed)."""
        self.unlink()
        self.close()

    def unlink(self) -> None:
        """Remove the store's name now (any process may): attached processes keep their mappings until they
        close; new attaches fail. Idempotent; never removes a newer store that took the same name."""
        _remove_dir(self.path, self._owner_ino)

    def close(self) -> None:
        """Release this process's mappings and lease; the creator also removes the name. Idempotent.

        Arrays still referenced (views handed out) keep their pages mapped until they are dropped.
        """
        if self._closed:
            return
        self._closed = True
        for lk in self._locks.values():
            lk.close()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # views still alive: unmapped when the last one goes
                pass
        self._maps.clear()
        _drop_lease(self._lease_fd, self._lease_path)
        self._lease_fd = -1
        if self._owner_fd >= 0:
            self.unlink()
            os.close(self._owner_fd)
            self._owner_fd = -1

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("owner" if self.owner else "attached")
        return f"SharedMemoryTier({self.store_name!r}, {self.path!r}, {state})"


# ---------------------------------------------------------------------- the janitor
def gc(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Reclaim the shared stores whose owner process is dead; return their names.

    Also removes half-created stores of dead creators, half-removed ones, and lease files of dead processes.
    Safe to run at any time from any process: a live owner holds its owner lock, which the janitor never gets.
    """
    root = shm_root(root)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            if e.name.startswith(PREFIX):
                if _reclaim_if_stale(e.path):
                    out.append(e.name[len(PREFIX):])
                else:
                    _live_leases(e.path, prune=True)
            elif e.name.startswith(_GONE_PREFIX):
                shutil.rmtree(e.path, ignore_errors=True)
            elif e.name.startswith(_NEW_PREFIX) and _owner_dead(e.path):
                shutil.rmtree(e.path, ignore_errors=True)
        except OSError:  # raced with another janitor or the owner
            continue
    return out


def list_stores(root: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One dict per shared store under `root`: name, path, owner pid, alive, sealed, bytes, attached pids."""
    root = shm_root(root)
    out = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for e in entries:
        if not (e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)):
            continue
        try:
            owner = _read_json(os.path.join(e.path, _OWNER))
        except (OSError, ValueError):
            owner = {}
        size = 0
        for f in os.scandir(e.path):
            if f.name.startswith("arena."):
                size += f.stat().st_blocks * 512
        out.append({"name": e.name[len(PREFIX):], "path": e.path, "owner_pid": owner.get("pid"),
                    "alive": not _owner_dead(e.path), "sealed": os.path.exists(os.path.join(e.path, _MANIFEST)),
                    "bytes": size, "attached_pids": _live_leases(e.path)})
    return out


def remove(name: str, root: str | os.PathLike[str] | None = None) -> bool:
    """Remove the shared store `name` whatever its state (for cleanup; live users keep their mappings)."""
    path = store_path(name, root)
    existed = os.path.isdir(path)
    _remove_dir(path, None)
    return existed


def _owner_dead(path: str) -> bool:
    """True when nobody holds the owner lock of the store directory `path` (probe with a non-blocking flock)."""
    try:
        fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return time.time() - os.stat(path).st_mtime > _GRACE_S
        except FileNotFoundError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _reclaim_if_stale(path: str) -> bool:
    """Remove the store at `path` if its owner is dead; True when it did."""
    lock = os.path.join(path, _OWNER_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if _owner_dead(path):
            _remove_dir(path, None)
            return True
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        # we hold the dead owner's lock: nobody else can be reclaiming this very directory
        return _remove_dir(path, os.fstat(fd).st_ino)
    finally:
        os.close(fd)


def _remove_dir(path: str, expected_ino: int | None) -> bool:
    """Rename the store directory away (freeing the name at once), then delete it. With `expected_ino`, only if its
    owner lock is still that file (a newer store of the same name is put back)."""
    root, base = os.path.split(path)
    gone = os.path.join(root, f"{_GONE_PREFIX}{base[len(PREFIX):]}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return False
    if expected_ino is not None and _ino(os.path.join(gone, _OWNER_LOCK)) != expected_ino:
        try:
            os.rename(gone, path)
            return False
        except OSError:
            pass
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _take_lease(path: str) -> tuple[int, str]:
    lease = os.path.join(path, f"lease.{os.getpid()}-{_start_time(os.getpid())}-{os.urandom(4).hex()}")
    fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, lease


def _drop_lease(fd: int, lease: str) -> None:
    if fd < 0:
        return
    try:
        os.unlink(lease)
    except FileNotFoundError:
        pass
    os.close(fd)


def _live_leases(path: str, prune: bool = False) -> list[int]:
    """Pids with the store open (their lease file is locked); with `prune`, delete the leases of dead ones."""
    pids = []
    try:
        names = [n for n in os.listdir(path) if n.startswith("lease.")]
    except FileNotFoundError:
        return []
    for n in names:
        file = os.path.join(path, n)
        try:
            fd = os.open(file, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if prune:
                os.unlink(file)
        except BlockingIOError:
            pids.append(int(n.split(".", 1)[1].split("-", 1)[0]))
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return sorted(pids)


# ---------------------------------------------------------------------- sampler / rate-limiter specs
def to_spec(obj: Any) -> str:
    """A spec string naming `obj`'s class and constructor arguments: ``arrowbuf.samplers:FifoSampler()``.

    Each parameter of the class's `__init__` is read back from the attribute of the same name; objects whose
    arguments are not recoverable that way (or not literals) cannot be shared and raise TypeError.
    """
    cls = type(obj)
    if cls.__module__ not in SPEC_MODULES:
        raise TypeError(f"{cls.__name__} cannot be recorded in a shared store's manifest: only classes of "
                        f"{', '.join(SPEC_MODULES)} can (other processes rebuild it from the manifest)")
    args = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(obj, p.name):
            if p.default is p.empty:
                raise TypeError(f"{cls.__name__}: argument {p.name!r} is not kept as an attribute of the same name; "
                                "it cannot be recorded in a shared store's manifest")
            continue
        value = getattr(obj, p.name)
        if isinstance(value, np.generic):
            value = value.item()
        if ast.literal_eval(repr(value)) != value:  # raises on non-literals too
            raise TypeError(f"{cls.__name__}.{p.name}={value!r} is not a literal")
        args.append(f"{p.name}={value!r}")
    return f"{cls.__module__}:{cls.__name__}({', '.join(args)})"


def from_spec(spec: str | None) -> Any:
    """Build the object a `to_spec` string names (classes of `SPEC_MODULES` only; arguments are literals)."""
    if spec is None:
        return None
    module, _, call = spec.partition(":")
    if module not in SPEC_MODULES:
        raise ArrowbufError(f"manifest names {module!r}; expected one of {SPEC_MODULES}")
    node = ast.parse(call, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ArrowbufError(f"malformed spec {spec!r}")
    cls = getattr(importlib.import_module(module), node.func.id, None)
    if not isinstance(cls, type):
        raise ArrowbufError(f"spec {spec!r}: {module} has no class {node.func.id!r}")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    return cls(**kwargs)


# ---------------------------------------------------------------------- helpers
def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(f"shared store name {name!r}: use letters, digits, '_', '.', '-' (1-201 characters)")


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (tells a pid from a later process with the same pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _ino(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1


def _owner_desc(path: str) -> str:
    try:
        return f"pid {_read_json(os.path.join(path, _OWNER))['pid']}"
    except (OSError, ValueError, KeyError):
        return "unknown"


def _read_json(file: str) -> dict[str, Any]:
    with open(file) as f:
        return json.load(f)


def _write_json(file: str, obj: dict[str, Any]) -> None:
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.rename(tmp, file)


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


__all__ = ["SharedMemoryTier", "RobustMutex", "FlockLock", "gc", "list_stores", "remove", "shm_root", "store_path",
           "to_spec", "from_spec", "FORMAT_VERSION"]
