"""Typed conformance: every store-like class against `StoreSurface`, every writer against `WriterSurface`.

Nothing imports this module at run time; `mypy arrowbuf` (CI) type-checks it, so a signature that drifts from the
surface (a renamed argument, a different return type, a missing method) fails the build, not a user. The runtime
check of the same surfaces is `arrowbuf.surface.check_surface` and tests/test_surface.py.
"""

from __future__ import annotations

from .flight.client import RemoteStore, RemoteWriter
from .ray.handle import ShardedStore
from .ray.shard import ShardBackend
from .ray.writer import ShardWriter
from .store.facade import ExperienceStore
from .surface import StoreSurface, WriterSurface


def experience_store(s: ExperienceStore) -> StoreSurface:
    return s


def remote_store(s: RemoteStore) -> StoreSurface:
    return s


def sharded_store(s: ShardedStore) -> StoreSurface:
    return s


def shard_backend(s: ShardBackend) -> StoreSurface:
    return s


def remote_writer(w: RemoteWriter) -> WriterSurface:
    return w


def shard_writer(w: ShardWriter) -> WriterSurface:
    return w
