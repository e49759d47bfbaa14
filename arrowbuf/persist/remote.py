"""Checkpoints requested by remote callers (the Flight `checkpoint` action): only under a root the server owns.

A client names a checkpoint by a relative name (`"run-7"`, `"shard-0/latest"`); `resolve_under_root` refuses anything
that could leave the root: absolute paths, `..`, empty or hidden components, characters outside `[A-Za-z0-9._-]`,
and any existing component that is a symbolic link (a link planted inside the root could point anywhere). The server
then checkpoints into the resolved directory with the local `checkpoint`.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidArgument


@runtime_checkable
class Checkpointable(Protocol):
    """A store that checkpoints itself into a directory (`ExperienceStore`, a Ray shard's store): a capability a
    served store may lack (a proxy over a store, a store of the user's own)."""

    def checkpoint(self, path: str, keep: int | None = None) -> Mapping[str, Any]: ...


_COMPONENT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
MAX_DEPTH = 8


def resolve_under_root(root: str, name: str) -> str:
    """The directory for checkpoint `name` under `root`.

    Raises:
        InvalidArgument: `name` is not a plain relative name under the root (see the module docstring).
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgument("a checkpoint name is a non-empty relative path such as 'run-7' or 'shard-0/latest'")
    if name.startswith(("/", "\\")) or os.path.isabs(name):
        raise InvalidArgument(f"checkpoint name {name[:80]!r} is absolute; the server writes only under its "
                              "checkpoint root: pass a relative name")
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        raise InvalidArgument(f"checkpoint name {name[:80]!r} is deeper than {MAX_DEPTH} components")
    for p in parts:
        if p in ("", ".", "..") or not _COMPONENT.match(p):
            raise InvalidArgument(f"checkpoint name {name[:80]!r}: component {p[:40]!r} is not allowed (use letters, "
                                  "digits, '.', '_' and '-'; no '..', no empty or hidden components)")
    real_root = os.path.realpath(root)
    path = real_root
    for p in parts:
        path = os.path.join(path, p)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise InvalidArgument(f"checkpoint name {name[:80]!r}: {p!r} is a symbolic link; the server does not "
                                  "follow links out of its checkpoint root")
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidArgument(f"checkpoint name {name[:80]!r}: {p!r} exists and is not a directory")
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:  # belt and braces
        raise InvalidArgument(f"checkpoint name {name[:80]!r} leaves the checkpoint root")
    return path


def checkpoint_under_root(store: object, root: str | None, name: str,
                          keep: int | None = None) -> dict[str, Any]:
    """Checkpoint `store` into `root/name` for a remote caller; JSON-able summary (paths relative to the root).

    Raises:
        InvalidArgument: the server has no checkpoint root, the store takes no checkpoints, or `name` would leave
            it.
    """
    if root is None:
        raise InvalidArgument("this server takes no checkpoints: start it with ab.serve(..., checkpoint_root=DIR)")
    if not isinstance(store, Checkpointable):
        raise InvalidArgument(f"this store ({type(store).__name__}) takes no checkpoints: it has no checkpoint()")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= 1000):
        raise InvalidArgument(f"keep must be an integer in [1, 1000], got {keep!r}")
    path = resolve_under_root(root, name)
    os.makedirs(path, exist_ok=True)
    info = dict(store.checkpoint(path, keep=keep))
    info["path"] = name
    return info
