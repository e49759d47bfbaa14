"""The janitor: reclaims shared stores whose owner died, lists stores, removes names, tracks leases."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from typing import Any

from .paths import (
    GONE_PREFIX,
    GRACE_S,
    MANIFEST,
    NEW_PREFIX,
    OWNER_FILE,
    OWNER_LOCK,
    PREFIX,
    inode,
    read_json,
    shm_root,
    start_time,
    store_path,
)


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
                if reclaim_if_stale(e.path):
                    out.append(e.name[len(PREFIX):])
                else:
                    live_leases(e.path, prune=True)
            elif e.name.startswith(GONE_PREFIX):
                shutil.rmtree(e.path, ignore_errors=True)
            elif e.name.startswith(NEW_PREFIX) and owner_dead(e.path):
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
            owner = read_json(os.path.join(e.path, OWNER_FILE))
        except (OSError, ValueError):
            owner = {}
        size = 0
        for f in os.scandir(e.path):
            if f.name.startswith("arena."):
                size += f.stat().st_blocks * 512
        out.append({"name": e.name[len(PREFIX):], "path": e.path, "owner_pid": owner.get("pid"),
                    "alive": not owner_dead(e.path), "sealed": os.path.exists(os.path.join(e.path, MANIFEST)),
                    "bytes": size, "attached_pids": live_leases(e.path)})
    return out


def remove(name: str, root: str | os.PathLike[str] | None = None) -> bool:
    """Remove the shared store `name` whatever its state (for cleanup; live users keep their mappings)."""
    path = store_path(name, root)
    existed = os.path.isdir(path)
    remove_dir(path, None)
    return existed


def owner_dead(path: str) -> bool:
    """True when nobody holds the owner lock of the store directory `path` (probe with a non-blocking flock; about
    5 us): its creator died or closed it. A directory that is gone has no live owner either; one without an owner
    lock counts as dead once it is older than `GRACE_S` (before that it may be racing its own creation)."""
    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return time.time() - os.stat(path).st_mtime > GRACE_S
        except FileNotFoundError:
            return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def reclaim_if_stale(path: str) -> bool:
    """Remove the store at `path` if its owner is dead; True when it did."""
    lock = os.path.join(path, OWNER_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if owner_dead(path):
            remove_dir(path, None)
            return True
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        # we hold the dead owner's lock: nobody else can be reclaiming this very directory
        return remove_dir(path, os.fstat(fd).st_ino)
    finally:
        os.close(fd)


def remove_dir(path: str, expected_ino: int | None) -> bool:
    """Rename the store directory away (freeing the name at once), then delete it. With `expected_ino`, only if its
    owner lock is still that file (a newer store of the same name is put back)."""
    root, base = os.path.split(path)
    gone = os.path.join(root, f"{GONE_PREFIX}{base[len(PREFIX):]}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return False
    if expected_ino is not None and inode(os.path.join(gone, OWNER_LOCK)) != expected_ino:
        try:
            os.rename(gone, path)
            return False
        except OSError:
            pass
    shutil.rmtree(gone, ignore_errors=True)
    return True


def take_lease(path: str) -> tuple[int, str]:
    lease = os.path.join(path, f"lease.{os.getpid()}-{start_time(os.getpid())}-{os.urandom(4).hex()}")
    fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, lease


def drop_lease(fd: int, lease: str) -> None:
    if fd < 0:
        return
    try:
        os.unlink(lease)
    except FileNotFoundError:
        pass
    os.close(fd)


def lease_holders(path: str) -> list[tuple[int, int]]:
    """(pid, start time) of each process with the store open (a lease file it holds locked)."""
    live = set(live_leases(path))
    out = []
    try:
        names = [n for n in os.listdir(path) if n.startswith("lease.")]
    except FileNotFoundError:
        return []
    for n in names:
        try:
            pid, start, _ = n[len("lease."):].split("-", 2)
            if int(pid) in live:
                out.append((int(pid), int(start)))
        except ValueError:
            continue
    return out


def live_leases(path: str, prune: bool = False) -> list[int]:
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
