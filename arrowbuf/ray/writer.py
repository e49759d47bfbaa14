"""Writers to a sharded store: one shard at a time, shared memory on the shard's node, else Flight."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..errors import (
    ArrowbufError,
    InvalidArgument,
    OutcomeUnknown,
    SchemaError,
    ShardsLost,
    StoreClosed,
    Unavailable,
)
from ..tiers.shm.janitor import owner_dead
from ._common import _ray, step_batch
from .ids import encode_ids
from .shard import shm_safe

if TYPE_CHECKING:
    from ..schema import ExperienceSchema
    from .membership import ShardMembership

log = logging.getLogger("arrowbuf.ray")


_writer_ids = itertools.count()


class ShardWriter:
    """Writes experience to one shard, re-routing to another when it dies.

    Its home is the shard given, else a shard on this process's Ray node (writers on a node spread over that
    node's shards), else one chosen by the writer's id. Transport: shared memory when the home shard is on this node,
    keeps its store in shared memory and its sampler keeps no per-process row state (`shm_safe`), else Flight: a
    pipelined DoPut stream with at most `max_in_flight` unacknowledged batches.

    Every batch carries this writer's `actor` id (unless the batch names its own), so an episode's steps stay one
    episode on one shard, whatever other writers do. When the shard dies the writer moves to the next live shard
    and re-sends the batches that shard had not acknowledged; the open episode continues there as a new episode
    (an episode never spans shards; the part on the dead shard is gone with it). At each write it looks (without
    waiting) whether its home came back (a new, empty incarnation) and returns to it.

    Usage::

        with sharded.writer() as w:
            ids = w.extend(batch)   # dict of arrays, RecordBatch or Table -> the rows' global ids, once committed
            w.send(batch)           # or without waiting for the acknowledgement (pipelined over Flight)
        w.rows                      # rows acknowledged (Flight) or committed (shared memory)
    """

    def __init__(self, members: ShardMembership, schema: ExperienceSchema, sampler: Any, shard: int | None = None,
                 *, transport: str = "auto", max_in_flight: int = 8, actor: Any = None,
                 reroute_timeout: float | None = None, timeout: float | None = None) -> None:
        if transport not in ("auto", "shm", "flight"):
            raise InvalidArgument(f"transport must be 'auto', 'shm' or 'flight', got {transport!r}")
        self.members = members
        self.schema = schema
        self.sampler = sampler
        self.transport = transport
        self.max_in_flight = int(max_in_flight)
        self.actor_id = actor if actor is not None else (os.getpid() << 20) + next(_writer_ids) + (
            secrets.randbelow(1 << 20) << 42)
        self.reroute_timeout = members.failure_timeout if reroute_timeout is None else float(reroute_timeout)
        #: seconds a shard's rate limiter may hold each write back (`InsertTimeout` after); None: no wait
        self.timeout = timeout
        self.home = self._pick_home(shard)
        self.rows = 0
        self.reroutes = 0
        self.shard: int = -1
        self.via: str = ""
        self._target: Any = None        # RemoteWriter or attached ExperienceStore
        self._shm_dir: str | None = None  # the shard store's directory while writing through shared memory
        self._generation = 0              # of the shard written to (global ids of shared-memory writes)
        self._last_ids = np.empty(0, dtype=np.int64)  # global ids of the last batch committed
        self._unacked: list[pa.RecordBatch] = []
        self._acked = 0
        self._closed = False
        self._connect(self.home)

    # ------------------------------------------------------------------ routing
    def _node_id(self) -> str | None:
        ray = _ray()
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def _pick_home(self, shard: int | None) -> int:
        n = self.members.num_shards
        if shard is not None:
            if not 0 <= shard < n:
                raise InvalidArgument(f"shard must be in [0, {n}), got {shard}")
            return int(shard)
        node = self._node_id()
        local = [int(i["shard"]) for i in self.members.infos if i is not None and i.get("node_id") == node]
        pool = local or list(range(n))
        return int(pool[hash(self.actor_id) % len(pool)])

    def _connect(self, k: int) -> None:
        """Open the transport to shard `k`, or to the next live shard after it; waits up to reroute_timeout."""
        end = time.monotonic() + self.reroute_timeout
        n = self.members.num_shards
        while True:
            for j in [k, *[(k + i) % n for i in range(1, n)]]:
                if self._open(j):
                    if j != self.home:
                        self.reroutes += 1
                    return
            left = end - time.monotonic()
            # until a down shard's actor answers again (or the time is up, or none can come back)
            if left <= 0 or not self.members.wait_for_revival(left):
                raise ShardsLost(f"writer: no shard of {self.members!r} accepted writes within {self.reroute_timeout}s")

    def _open(self, k: int) -> bool:
        client = self.members.shard_client(k)
        if client is None:
            return False
        info = self.members.infos[k]
        assert info is not None  # the shard is up: it has an info
        use_shm = (self.transport != "flight" and info.get("shm") and info.get("node_id") == self._node_id()
                   and shm_safe(self.sampler))
        if self.transport == "shm" and not use_shm:
            raise ArrowbufError(f"shard {k} cannot take shared-memory writes from here (node, tier or sampler): "
                                "use transport='auto' or 'flight'")
        try:
            if use_shm:
                from ..store.facade import ExperienceStore
                from ..tiers.shm import store_path

                self._target = ExperienceStore.attach(info["shm"])
                self._shm_dir = store_path(info["shm"])
                self.via = "shm"
            else:
                self._target = client.writer(max_in_flight=self.max_in_flight, timeout=self.timeout)
                self._shm_dir = None
                self.via = "flight"
        except (StoreClosed, ArrowbufError, OSError, pa.ArrowException) as exc:
            self.members.report_down(k, exc)
            return False
        self.shard = k
        self._generation = int(info["generation"])
        self._acked = 0  # batches the new stream acknowledged (`_trim_acked` counts from its first_seqs)
        return True

    def _drop_target(self) -> None:
        target, self._target = self._target, None
        if target is None:
            return
        with contextlib.suppress(Exception):
            if self.via == "shm":
                target.close()
            else:
                target.abort()

    def _reroute(self, exc: BaseException) -> None:
        log.info("writer: shard %d failed (%s); re-routing", self.shard, exc)
        self.members.report_down(self.shard, exc)
        self._drop_target()
        self._connect((self.shard + 1) % self.members.num_shards)
        pending, self._unacked, self._acked = self._unacked, [], 0
        for rb in pending:
            try:
                self._send(rb)
            except ArrowbufError as refused:  # the dead shard may have stored it: not "nothing written"
                raise OutcomeUnknown(f"writer: shard {self.shard} refused a batch of {rb.num_rows} rows re-sent "
                                     f"after its first shard failed ({exc}); that shard may have stored it before "
                                     f"it died, or not: {refused}") from refused

    def _maybe_go_home(self) -> None:
        """While away from home: if the home shard is back (a non-blocking look), flush here and move home."""
        if self.shard == self.home:
            return
        if self.members.shard_client(self.home) is not None:  # up again (a look, no wait)
            self.flush()
            self._drop_target()
            if not self._open(self.home):
                self._connect(self.shard)

    # ------------------------------------------------------------------ writing
    def _with_actor(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            if "actor" in batch or "episode_id" in batch:
                return batch
            n = len(next(iter(batch.values()))) if batch else 0
            return {**batch, "actor": np.full(n, self.actor_id, dtype=np.int64)}
        if isinstance(batch, (pa.RecordBatch, pa.Table)):
            if "actor" in batch.schema.names or "episode_id" in batch.schema.names:
                return batch
            return batch.append_column("actor", pa.array(np.full(batch.num_rows, self.actor_id, dtype=np.int64)))
        raise SchemaError(f"expected a dict of arrays, a pa.RecordBatch or a pa.Table; got {type(batch).__name__}")

    def extend(self, batch: Any) -> np.ndarray:
        """Write a batch (dict of arrays, RecordBatch or Table) and return its rows' global ids once the shard has
        committed it (over Flight this waits for the batch's acknowledgement; `send` does not wait).

        The batch is validated here, so bad input raises `SchemaError` before anything is sent.

        Returns:
            The rows' global ids (`np.ndarray[int64]`, in row order): `batch.indices` of later samples use them and
            `update_priorities` takes them. A batch re-sent to another shard after a failure has that shard's ids.
        """
        rb = self._prepare(batch)
        if rb.num_rows == 0:
            return np.empty(0, dtype=np.int64)
        self._send(rb)
        self.flush()  # over Flight: this batch is the last acknowledged one (shared memory: committed already)
        return self._last_ids

    def send(self, batch: Any) -> None:
        """Write a batch without waiting for it: over Flight at most `max_in_flight` batches are unacknowledged
        (`flush` waits for them); through shared memory it is committed before `send` returns. Validated here."""
        rb = self._prepare(batch)
        if rb.num_rows:
            self._send(rb)

    def append(self, step: dict[str, Any]) -> int:
        """Write one step (a dict of scalars and arrays); returns its global id."""
        return int(self.extend(step_batch(step))[0])

    def _prepare(self, batch: Any) -> pa.RecordBatch:
        if self._closed:
            raise StoreClosed("this writer is closed")
        self._maybe_go_home()
        from ..flight.messages import record_batch

        cols, _ = self.schema.validate_batch(self._with_actor(batch))
        return record_batch(self.schema, cols)

    def _send(self, rb: pa.RecordBatch) -> None:
        while True:
            try:
                if self.via == "shm":
                    local = self._target.extend(rb, timeout=self.timeout)
                    if self._shm_dir is not None and owner_dead(self._shm_dir):  # a dead shard's memory: send again
                        raise StoreClosed(f"shard {self.shard} died")
                    self._last_ids = encode_ids(self.shard, self._generation, _row_ids(local, rb.num_rows))
                    self.rows += rb.num_rows
                else:
                    self._unacked.append(rb)
                    self._target.send(rb)
                    self._trim_acked()
                return
            except Exception as exc:
                if not _shard_failed(exc):  # the shard answered (InsertTimeout, SchemaError, ...): not a failover
                    if self.via != "shm":
                        self._refused()
                    raise
                if self.via != "shm":
                    self._unacked.pop()  # _reroute re-sends what is unacknowledged; this one goes after them
                self._reroute(exc)
                if self.via != "shm":
                    continue

    def _trim_acked(self) -> None:
        acked = len(self._target.first_seqs)
        newly = acked - self._acked
        if newly > 0:
            self.rows += sum(rb.num_rows for rb in self._unacked[:newly])
            last = self._unacked[newly - 1].num_rows
            self._last_ids = self._target.first_seqs[-1] + np.arange(last, dtype=np.int64)  # a batch's ids are a range
            del self._unacked[:newly]
            self._acked = acked

    def flush(self) -> int:
        """Wait until every batch sent is acknowledged (re-routing if its shard died); returns `rows`."""
        while self.via == "flight" and self._target is not None:
            try:
                self._target.flush()
                self._trim_acked()
                return self.rows
            except Exception as exc:
                if not _shard_failed(exc):
                    self._refused()
                    raise
                self._reroute(exc)
        return self.rows

    def _refused(self) -> None:
        """The shard refused a batch (its error ended the stream): batches acknowledged before it stay counted, it
        and any sent after it on that stream are not stored and are not re-sent."""
        if self._target is not None:
            self._trim_acked()
        self._unacked.clear()

    def close(self) -> None:
        """Flush and close; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            if self.via == "flight" and self._target is not None:
                with contextlib.suppress(Exception):
                    self._target.close()
                    self._trim_acked()
            elif self._target is not None:
                self._target.close()
            self._target = None
        finally:
            self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self._drop_target()

    def __repr__(self) -> str:
        return f"ShardWriter(home={self.home}, shard={self.shard}, via={self.via!r}, rows={self.rows})"


def _row_ids(local: Any, n: int) -> np.ndarray:
    """A local store's ids of the `n` rows `extend` committed: its array of ids, or (stores that return the first
    seq) the range from it."""
    ids = np.asarray(local, dtype=np.int64)
    return ids.reshape(-1) if ids.ndim else int(ids) + np.arange(n, dtype=np.int64)


def _shard_failed(exc: BaseException) -> bool:
    """Whether an error means the shard is gone (re-route the writes) rather than that it answered with a refusal
    (`InsertTimeout`, `SchemaError`, ...: raised to the caller). `InsertTimeout` is a `TimeoutError` and so an
    `OSError`: arrowbuf's own errors are decided by their type first."""
    if isinstance(exc, (StoreClosed, Unavailable)):
        return True
    if isinstance(exc, ArrowbufError):
        return False
    return isinstance(exc, (OSError, pa.ArrowException))
