"""The store surface: what every store-like class offers, written down as one `typing.Protocol`.

`ExperienceStore` (host, shared memory, tiered, attached), `RemoteStore` (`ab.connect`), `arrowbuf.ray.ShardedStore`
and the shard adapter a shard's Flight server wraps (`arrowbuf.ray.ShardBackend`) all implement `StoreSurface`, and
tests/test_surface.py runs one contract suite over each of them. Code that only needs "a store" (the Loader,
`ab.serve`, your training loop) should take a `StoreSurface` and nothing narrower.

Writers (`RemoteStore.writer()`, `ShardedStore.writer()`) implement `WriterSurface`: `extend` waits and returns
ids, `send` pipelines, `flush` waits for what was sent.

Ids: `extend` returns the new rows' ids as a 1-D `np.ndarray[int64]` and `append` the new row's id as an `int`.
They are the ids `sample(...).indices` carries and `update_priorities` accepts: a local store's ids are its rows'
`seq`; a sharded store's are its encoded global ids (shard, generation, seq). An id names one row for as long as it
is stored: `update_priorities` ignores (and counts) ids whose row was evicted or recycled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from .delivery.batch import SampleBatch
from .schema import ExperienceSchema


@runtime_checkable
class StoreSurface(Protocol):
    """The surface a learner, an actor or a server uses, whatever the store behind it.

    Usage loop (as Acme's `Adder` and `ReplayBuffer`: actors add, learners sample and feed back)::

        def actor(store: ab.StoreSurface, env, policy) -> None:
            step = env.reset()
            while True:
                store.append(step)                        # -> int id; or store.extend(batch) -> ids
                step = env.step(policy(step))

        def learner(store: ab.StoreSurface, model) -> None:
            with store:                                   # close() on exit, idempotent
                while True:
                    batch = store.sample(256, timeout=5.0)           # ab.SampleBatch: data, indices, weights
                    td = model.update(batch.to_torch(), batch.weights)
                    store.update_priorities(batch.indices, td.abs())  # ids of evicted rows are ignored
                    if model.step % 1000 == 0:
                        print(len(store), store.stats()["inserts"])
                        print(store.sql("SELECT count(*) FROM experience"), store.episodes())

    Implementations may take more keyword arguments (`timeout=` on writes, `n_step=` on `sample`, ...); the
    signatures below are what every one of them accepts.

    Attributes:
        schema: the `ExperienceSchema` of the stored rows.
    """

    schema: ExperienceSchema

    def append(self, step: dict[str, Any]) -> int:
        """Add one step (a dict of scalars and arrays); returns the new row's id."""
        ...

    def extend(self, batch: Any) -> np.ndarray:
        """Add many steps (dict of arrays with a leading dim, `pa.RecordBatch`, `pa.Table`) atomically; returns the
        new rows' ids, a 1-D `np.ndarray[int64]` in row order.

        Raises:
            SchemaError: the batch does not match the schema; nothing is stored.
        """
        ...

    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None) -> SampleBatch:
        """`n` items as an `ab.SampleBatch` (`indices`: their ids; `weights`: IS weights or None).

        Raises:
            SampleTimeout: nothing could be served within `timeout` seconds (an empty store, a rate limiter).
        """
        ...

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set the priorities of sampled ids; returns how many ids still named a stored row."""
        ...

    def update(self, ids: Any, values: dict[str, Any]) -> int:
        """Write fields declared `later: true` of stored rows (`{"reward": r, ...}`, one value per id), atomically
        and validated like `extend`; returns how many ids still named a stored row (the others are skipped).

        Raises:
            SchemaError: an unknown field, a field not filled later, or values that do not convert; nothing written.
            InvalidArgument: an id this store never issued; nothing written.
        """
        ...

    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None,
                max_tokens: int | None = None, lease: float | None = None,
                admission: str | None = None) -> SampleBatch:
        """Up to `n` rows (whole groups with a `Group` sampler) that `task` has not consumed yet, marked consumed
        (with `lease=`: in flight until acked; with `admission="oldest"`: oldest policy version first, rows outside
        the version window held back, not dropped); see `ExperienceStore.consume`."""
        ...

    def ack(self, lease: str) -> int:
        """Make a lease's rows consumed for good by its task (`batch.ack()`); returns the rows.

        Raises:
            LeaseError: the lease is not open (acked or nacked already, expired, unknown).
        """
        ...

    def nack(self, lease: str) -> int:
        """Give a lease's rows back to its task's queue now; returns the rows.

        Raises:
            LeaseError: the lease is not open.
        """
        ...

    def add_task(self, name: str) -> None:
        """Declare a consuming task: it sees every live row once."""
        ...

    @property
    def tasks(self) -> list[str]:
        """The declared consuming tasks."""
        ...

    @property
    def policy_version(self) -> int:
        """The current policy version, the reference of `max_staleness` (settable)."""
        ...

    @policy_version.setter
    def policy_version(self, value: int) -> None: ...

    def __len__(self) -> int:
        """Rows stored now."""
        ...

    def stats(self) -> dict[str, Any]:
        """Size and counters; every implementation has at least `size`, `inserts` and `samples`."""
        ...

    def to_table(self, columns: list[str] | None = None) -> pa.Table:
        """The stored rows, oldest first, as a `pa.Table` (with `seq`; a sharded store adds `shard`)."""
        ...

    def sql(self, query: str) -> pa.Table:
        """DuckDB SQL over the stored rows; the store is the table `experience`. Needs `arrowbuf[query]`."""
        ...

    def episodes(self) -> pa.Table:
        """One row per episode: episode_id, length, return, first_seq, last_seq, complete."""
        ...

    def close(self) -> None:
        """Release what this object holds; idempotent. Calls after `close()` raise `StoreClosed`."""
        ...

    def __enter__(self) -> Any:
        ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        ...


# ---------------------------------------------------------------------------------------------------- capabilities
# What some store-like classes offer beyond `StoreSurface`, declared (runtime-checkable): code that uses one asks
# `isinstance(store, TableStream)`, never `getattr(store, "iter_table", None)`.


@runtime_checkable
class TableStream(Protocol):
    """A store that streams its rows chunk by chunk (`ExperienceStore`): a server sends a large table a chunk at a
    time instead of copying it whole."""

    def iter_table(self, columns: Iterable[str] | None = None, *,
                   max_rows: int | None = None) -> Iterator[pa.RecordBatch]: ...


@runtime_checkable
class ExtendSink(Protocol):
    """One extend whose rows arrive in pieces (`PieceSink.begin_extend`): `write` each, then `commit` (the ids) or
    `abort` (nothing stored)."""

    def write(self, piece: Any) -> None: ...

    def commit(self) -> np.ndarray: ...

    def abort(self) -> None: ...


@runtime_checkable
class PieceSink(Protocol):
    """A store that takes an extend in pieces copied straight into its ring (`ExperienceStore`). `takes_pieces` says
    whether it does at all (a durable, tiered, rate-limited store ... takes batches whole), decided once per store;
    `begin_extend` may still return None for a batch it takes only whole (longer than the ring, with actor ids)."""

    @property
    def takes_pieces(self) -> bool: ...

    def begin_extend(self, rows: int, names: Any) -> ExtendSink | None: ...


@runtime_checkable
class Bounded(Protocol):
    """A store of a fixed number of rows (`ExperienceStore`, a Ray shard's `ShardBackend`)."""

    capacity: int


@runtime_checkable
class Observable(Protocol):
    """A store in this process whose internals `/metrics` and the inspector read (`ExperienceStore`): what it
    records besides `stats()`, where its columns live and its chunk directory."""

    def observability(self) -> dict[str, Any]: ...

    def placement(self, explain: bool = False) -> pa.Table: ...

    def chunks(self) -> pa.Table: ...


@runtime_checkable
class LineageSource(Protocol):
    """A store that records the lineage of its rows: the SQL table `lineage` (`ExperienceStore`)."""

    def lineage_table(self) -> pa.Table: ...


#: Keys every implementation's `stats()` carries.
STATS_KEYS = ("size", "inserts", "samples")


def check_surface(obj: Any, what: str = "store") -> StoreSurface:
    """`obj` if it implements `StoreSurface`, else `TypeError` naming what is missing."""
    if isinstance(obj, StoreSurface):
        return obj
    missing = [m for m in _MEMBERS if not hasattr(obj, m)]
    raise TypeError(f"{what}: expected a store (ab.StoreSurface: ExperienceStore, RemoteStore, ShardedStore, ...), "
                    f"got {type(obj).__name__}, which lacks {missing}")


_MEMBERS = ("schema", "append", "extend", "sample", "update_priorities", "update", "consume", "ack", "nack", "add_task",
            "tasks", "policy_version", "__len__", "stats", "to_table", "sql", "episodes", "close", "__enter__",
            "__exit__")


@runtime_checkable
class WriterSurface(Protocol):
    """A writer of one store: `RemoteStore.writer()` (Flight) and `ShardedStore.writer()` (Ray) return one.

    Usage::

        with store.writer() as w:
            ids = w.extend(batch)    # waits until the rows are committed; their ids (np.ndarray[int64])
            w.send(batch)            # pipelined: returns once the batch is on its way
            w.flush()                # waits for everything sent; the rows this writer committed so far

    Attributes:
        rows: rows committed through this writer so far.
    """

    rows: int

    def append(self, step: dict[str, Any]) -> int:
        """Write one step and wait for it; returns its id."""
        ...

    def extend(self, batch: Any) -> np.ndarray:
        """Write a batch and wait until it is committed; returns its rows' ids, in row order."""
        ...

    def send(self, batch: Any) -> None:
        """Write a batch without waiting for it (bounded: a writer keeps a few batches in flight at most)."""
        ...

    def flush(self) -> int:
        """Wait until every batch sent is committed; returns `rows`."""
        ...

    def close(self) -> None:
        """Flush and release the writer; idempotent."""
        ...

    def __enter__(self) -> Any:
        ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        ...


__all__ = ["STATS_KEYS", "StoreSurface", "WriterSurface", "check_surface"]
