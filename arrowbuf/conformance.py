"""Typed conformance: every store-like class against `StoreSurface`, every writer against `WriterSurface`.

Nothing imports this module at run time; `mypy arrowbuf` (CI) type-checks it, so a signature that drifts from the
surface (a renamed argument, a different return type, a missing method) fails the build, not a user. The runtime
check of the same surfaces is `arrowbuf.surface.check_surface` and tests/test_surface.py.

Each function below takes an instance of one implementation and returns it as the surface it implements: mypy
accepts the return only if every member of the Protocol is there with a compatible signature.
"""

from __future__ import annotations

from .flight.client import RemoteStore, RemoteWriter
from .ray.handle import ShardedStore
from .ray.shard import ShardBackend
from .ray.writer import ShardWriter
from .store.facade import ExperienceStore
from .surface import StoreSurface, WriterSurface


def _experience_store(s: ExperienceStore) -> StoreSurface:
    return s


def _remote_store(s: RemoteStore) -> StoreSurface:
    return s


def _sharded_store(s: ShardedStore) -> StoreSurface:
    return s


def _shard_backend(s: ShardBackend) -> StoreSurface:
    return s


def _remote_writer(w: RemoteWriter) -> WriterSurface:
    return w


def _shard_writer(w: ShardWriter) -> WriterSurface:
    return w
