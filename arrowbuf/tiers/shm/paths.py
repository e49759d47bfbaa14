"""Where shared stores live and what their files are called; small file helpers shared by the other modules."""

from __future__ import annotations

import json
import mmap
import os
import re
from typing import Any

from ... import config
from ...errors import InvalidArgument

#: Version of the on-disk layout (manifest, file names); attach refuses other versions.
FORMAT_VERSION = 3  # 2: sampler and rate-limiter specs are objects keyed on registered names; 3: every store has
#                    the consume arenas (consume.*: tasks, leases, policy_version in shared memory)
PREFIX = "arrowbuf."
NEW_PREFIX = ".arrowbuf-new."     # a store being created (renamed to PREFIX + name when its owner lock is held)
GONE_PREFIX = ".arrowbuf-gone."   # a store being removed (renamed away first, so the name is free at once)
OWNER_LOCK = "owner.lock"
OWNER_FILE = "owner.json"
MANIFEST = "manifest.json"
GRACE_S = 30.0                    # a directory without an owner lock is left alone this long (not ours, or racing)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
PAGE = mmap.PAGESIZE
LOCK_BYTES = 64   # one pthread_mutex_t (40 bytes on x86-64, 48 on arm64) per cache line
LOCK_SLOTS = 16


def shm_root(root: str | os.PathLike[str] | None = None) -> str:
    """The directory shared stores live in: `root`, else ``$ARROWBUF_SHM_DIR`` (`arrowbuf.config`), else /dev/shm."""
    return os.fspath(root) if root is not None else str(config.get("ARROWBUF_SHM_DIR"))


def store_path(name: str, root: str | os.PathLike[str] | None = None) -> str:
    """The directory of the shared store `name`."""
    check_name(name)
    return os.path.join(shm_root(root), PREFIX + name)


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(f"shared store name {name!r}: use letters, digits, '_', '.', '-' (1-201 characters)")


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (tells a pid from a later process with the same pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1


def owner_desc(path: str) -> str:
    try:
        return f"pid {read_json(os.path.join(path, OWNER_FILE))['pid']}"
    except (OSError, ValueError, KeyError):
        return "unknown"


def read_json(file: str) -> dict[str, Any]:
    with open(file) as f:
        return json.load(f)


def write_json(file: str, obj: dict[str, Any]) -> None:
    tmp = f"{file}.tmp{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
        json.dump(obj, f, indent=1)  # insertion order: a schema's field order is part of it
    os.rename(tmp, file)


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)
