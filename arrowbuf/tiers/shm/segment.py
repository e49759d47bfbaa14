"""`SharedMemoryTier`: a store's arenas as files under /dev/shm, created, sealed, attached and closed."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import tempfile
import time
from typing import Any
from urllib.parse import quote

import numpy as np

from ... import config
from ...errors import ArrowbufError, OutOfSpace, StoreClosed, StoreCorrupt, StoreExists, StoreNotFound
from ..base import Tier
from .janitor import drop_lease, gc, live_leases, reclaim_if_stale, remove_dir, take_lease
from .locks import FlockLock, RobustMutex, pthread_lib
from .manifest import read_manifest
from .paths import (
    FORMAT_VERSION,
    LOCK_BYTES,
    LOCK_SLOTS,
    MANIFEST,
    NEW_PREFIX,
    OWNER_FILE,
    OWNER_LOCK,
    PAGE,
    fmt_bytes,
    inode,
    owner_desc,
    read_json,
    shm_root,
    start_time,
    store_path,
    write_json,
)
from .trust import check_store_dir, check_store_file, open_store_file


class SharedMemoryTier(Tier):
    """Arenas in files under /dev/shm, mapped by every process that opens the store.

    Make one with `create(name)` (a new store: `fresh`, its arrays need initialising) or `attach(name)` (an existing,
    sealed store: `manifest` says how to rebuild it; nothing is re-initialised). `ExperienceStore(..., tier="shm")`
    and `ExperienceStore.attach(name)` do this for you.
    """

    name = "shm"
    shared = True

    def __init__(self, store_name: str, path: str, *, fresh: bool, owner_fd: int = -1,
                 manifest: dict[str, Any] | None = None, populate: bool = True,
                 dir_stat: os.stat_result | None = None, allow_other_owner: bool = False) -> None:
        self.store_name = store_name
        self.path = path
        self.fresh = fresh
        self.manifest: dict[str, Any] = manifest or {}
        self.populate = populate
        self._owner_fd = owner_fd          # the creator holds the owner lock for its lifetime
        self._owner_ino = inode(os.path.join(path, OWNER_LOCK))
        self._layout: dict[str, dict[str, Any]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._locks: dict[str, RobustMutex | FlockLock] = {}
        info = self.manifest.get("locks", {})
        use_flock = config.get("ARROWBUF_SHM_LOCKS") == "flock" or pthread_lib() is None
        self._lock_kind = info.get("kind") if not fresh else ("flock" if use_flock else "pthread")
        self._lock_slots: dict[str, int] = dict(info.get("slots", {}))
        self._lock_mem: np.ndarray | None = None
        self._sealed = not fresh
        self._closed = False
        self._dir_stat = dir_stat          # attach: the checked directory; every file opened is checked against it
        self._allow_other_owner = allow_other_owner
        self._lease_fd, self._lease_path = take_lease(path)

    # ------------------------------------------------------------------ create / attach
    @classmethod
    def create(cls, name: str, *, root: str | os.PathLike[str] | None = None,
               populate: bool = True) -> SharedMemoryTier:
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
        tmp = tempfile.mkdtemp(prefix=NEW_PREFIX, dir=root)
        try:
            owner_fd = os.open(os.path.join(tmp, OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(owner_fd, fcntl.LOCK_EX)
            write_json(os.path.join(tmp, OWNER_FILE), {"pid": os.getpid(), "start_time": start_time(os.getpid()),
                                                    "name": name, "created": time.time()})
            for attempt in range(2):
                try:
                    os.rename(tmp, final)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    if attempt or not reclaim_if_stale(final):  # a dead owner's store is reclaimed, then retried
                        raise StoreExists(
                            f"a shared store named {name!r} already exists at {final} (owner {owner_desc(final)}): "
                            f"attach to it with ExperienceStore.attach({name!r}), or pick another name"
                        ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(name, final, fresh=True, owner_fd=owner_fd, populate=populate)

    @classmethod
    def attach(cls, name: str, *, root: str | os.PathLike[str] | None = None, timeout: float = 0.0,
               populate: bool = True, allow_other_owner: bool = False) -> SharedMemoryTier:
        """Open the sealed store `name`, waiting up to `timeout` seconds for it to be created and sealed.

        Only a store of this process's user is opened, unless `allow_other_owner` (see `arrowbuf.tiers.shm.trust`);
        its manifest is checked before anything is mapped.

        Raises:
            StoreNotFound: no live, sealed store of that name.
            StoreNotTrusted: the store belongs to another user (without `allow_other_owner`), or others can write it.
            StoreCorrupt: its manifest or files are malformed or were tampered with (the message names the file).
        """
        path = store_path(name, root)
        died = name in gc(root)  # reclaimed here and now: say so, not only that it does not exist
        deadline = time.monotonic() + max(0.0, timeout)
        pause = 1e-3
        while True:
            why = (f"the shared store {name!r} was reclaimed: the process that created it died (a shared store "
                   "lives as long as its creator)" if died
                   else f"no shared store named {name!r} ({path} does not exist)")
            if os.path.lexists(path):
                dir_stat = check_store_dir(path, name, allow_other_owner)
                if reclaim_if_stale(path):
                    died = True
                    why = (f"the shared store {name!r} was reclaimed: the process that created it died (a shared "
                           "store lives as long as its creator)")
                else:
                    try:
                        manifest = read_manifest(path, name, dir_stat, allow_other_owner)
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
        return cls(name, path, fresh=False, manifest=manifest, populate=populate, dir_stat=dir_stat,
                   allow_other_owner=allow_other_owner)

    # ------------------------------------------------------------------ Tier interface
    def reserve(self, nbytes: int) -> None:
        """Fail now, with OutOfSpace, if `nbytes` more will not fit in the file system (creation only)."""
        if not self.fresh or self._sealed:
            return
        vfs = os.statvfs(self.path)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        needed = int(nbytes) + 64 * PAGE
        if needed > free:
            self._abort()
            raise OutOfSpace(
                f"shared store {self.store_name!r} needs {fmt_bytes(needed)} in {os.path.dirname(self.path)} but "
                f"only {fmt_bytes(free)} is free (of {fmt_bytes(total)}): free space there (docker: --shm-size), or "
                "create the store with a smaller capacity"
            )

    def allocate(self, key: str, dtype: Any, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """A writable array [rows, *shape] over the file of `key`: created (and reserved) by the creator, mapped
        as it is by an attaching process, which checks it against the manifest."""
        self._check_open()
        dtype, rows, shape = np.dtype(dtype), int(rows), tuple(int(s) for s in shape)
        count = rows * int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
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
            manifest = os.path.join(self.path, MANIFEST)
            want = self.manifest.get("arenas", {}).get(key)
            if want is None:
                raise StoreCorrupt(f"shared store {self.store_name!r}: its manifest {manifest} has no arena {key!r} "
                                   f"(it has {sorted(self.manifest.get('arenas', {}))[:20]}): made by another "
                                   "version, or tampered with")
            if want != entry:
                raise StoreCorrupt(f"shared store {self.store_name!r}: its manifest {manifest} says arena {key!r} is "
                                   f"{want}, but the store's geometry needs {entry}: tampered with, or another version")
            try:
                fd = open_store_file(file, os.O_RDWR)
            except FileNotFoundError:
                raise StoreCorrupt(f"shared store {self.store_name!r}: arena file {file} is missing") from None
            except OSError as exc:
                raise StoreCorrupt(f"shared store {self.store_name!r}: arena file {file} cannot be opened "
                                   f"({exc.strerror}; a link?)") from None
            try:
                if self._dir_stat is not None:
                    check_store_file(fd, file, self.store_name, self._dir_stat, self._allow_other_owner)
                if os.fstat(fd).st_size != size:
                    raise StoreCorrupt(f"shared store {self.store_name!r}: arena file {file} has "
                                       f"{os.fstat(fd).st_size} bytes, its manifest says {size}")
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
                    f"shared store {self.store_name!r}: arena {key!r} needs {fmt_bytes(size)} in "
                    f"{os.path.dirname(self.path)} but only {fmt_bytes(free)} is free: free space there "
                    "(docker: --shm-size), or create the store with a smaller capacity"
                ) from None
            raise

    def nbytes(self) -> int:
        return sum(e["bytes"] for e in self._layout.values())

    def lock(self, key: str) -> RobustMutex | FlockLock:
        """The cross-process lock `key` of this store (one object per key and process): a robust pthread mutex in
        the store's memory where libc has them, else an flock on a file. Both are released when the holder dies."""
        self._check_open()
        if key in self._locks:
            return self._locks[key]
        if self._lock_kind == "flock":
            lk: RobustMutex | FlockLock = FlockLock(os.path.join(self.path, "lock." + quote(key, safe="")))
        else:
            if self._lock_mem is None:
                self._lock_mem = self.allocate("tier.locks", np.dtype(np.uint8), LOCK_SLOTS * LOCK_BYTES)
            fresh = key not in self._lock_slots
            if fresh:
                if not self.fresh or self._sealed or len(self._lock_slots) >= LOCK_SLOTS:
                    raise ArrowbufError(f"shared store {self.store_name!r} has no lock {key!r}; it has "
                                        f"{sorted(self._lock_slots)} (locks are made before the store is sealed)")
                self._lock_slots[key] = len(self._lock_slots)
            at = self._lock_slots[key] * LOCK_BYTES
            lk = RobustMutex(self._lock_mem[at:at + LOCK_BYTES], init=fresh,
                             where=f"lock {key!r} (slot {self._lock_slots[key]} of {self.path}/arena.tier.locks)",
                             store_dir=self.path, file_ino=inode(os.path.join(self.path, "arena.tier.locks")))
        self._locks[key] = lk
        return lk

    def seal(self, meta: dict[str, Any]) -> None:
        """Publish the manifest: `meta` (what the store needs to rebuild itself, as JSON values) plus the format
        version, owner and arenas. The store is attachable from here."""
        if not self.fresh or self._sealed:
            return
        try:
            owner = read_json(os.path.join(self.path, OWNER_FILE))
            manifest = {"format": FORMAT_VERSION, "name": self.store_name, **meta,
                        "owner": {"pid": owner["pid"], "start_time": owner["start_time"]},
                        "locks": {"kind": self._lock_kind, "slots": self._lock_slots},
                        "arenas": self._layout}
            manifest = json.loads(json.dumps(manifest))  # only JSON values: a copy, and a type check
            write_json(os.path.join(self.path, MANIFEST), manifest)
        except BaseException:
            self._abort()
            raise
        self.manifest = manifest
        self._sealed = True

    # ------------------------------------------------------------------ lifetime
    @property
    def sealed(self) -> bool:
        """Whether the manifest is published (attachable; no new arenas or locks from here)."""
        return self._sealed

    @property
    def manifest_file(self) -> str:
        """The path of this store's manifest (named in errors about what it records)."""
        return os.path.join(self.path, MANIFEST)

    @property
    def owner(self) -> bool:
        """True in the process that created the store (its close() removes the name)."""
        return self._owner_fd >= 0

    def info(self) -> dict[str, Any]:
        """Where the store lives, who owns it and which processes have it open."""
        return {"path": self.path, "owner_pid": self.manifest.get("owner", {}).get("pid", os.getpid()),
                "attached_pids": live_leases(self.path), "bytes": self.nbytes()}

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
        remove_dir(self.path, self._owner_ino)

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
        drop_lease(self._lease_fd, self._lease_path)
        self._lease_fd = -1
        if self._owner_fd >= 0:
            self.unlink()
            os.close(self._owner_fd)
            self._owner_fd = -1

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("owner" if self.owner else "attached")
        return f"SharedMemoryTier({self.store_name!r}, {self.path!r}, {state})"
