"""Consumption per task on a `ShardedStore`: groups kept on one shard, consume over every shard.

`ShardedStore` delegates `consume`, `add_task`, `tasks` and `policy_version` here, and, with an
`ab.samplers.Group` sampler, `extend`: each row goes to the shard its group key hashes to (`group_shards`), so a
group's rows are on one shard and each shard delivers whole groups. Each shard tracks its own rows' consumption
(`arrowbuf.engine.consume`), so each row reaches each task once however many learners consume.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..delivery.batch import SampleBatch
from ..errors import InvalidArgument, LeaseError, StoreClosed, Unavailable
from ..samplers.group import GroupSampler
from .writer import ShardWriter

if TYPE_CHECKING:
    from ..schema import ExperienceSchema
    from .membership import ShardMembership


def group_shards(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each group key: a 64-bit multiplicative hash of the key modulo the shard count (the same in
    every process, unlike Python's `hash`)."""
    keys = np.asarray(keys)
    bits = keys.astype(np.int64) if keys.dtype.kind in "iub" else keys.astype(np.float64).view(np.int64)
    mixed = bits.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return ((mixed >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


class ShardedConsumer:
    """Consumption per task over a `ShardedStore`'s shards, through its public surface (shard clients, writers).

    Args:
        members: the shards (`ShardMembership`, shared with the handle).
        schema: the shards' schema; sampler: their sampler (a `Group` sampler keeps each group on one shard).
        token_field: the ragged field `max_tokens` counts (None: `response_tokens`, or the only ragged field).
    """

    def __init__(self, members: ShardMembership, schema: ExperienceSchema, sampler: Any,
                 token_field: str | None = None) -> None:
        self.members = members
        self.schema = schema
        self.sampler = sampler
        self._turn = -1
        self._writers: dict[tuple[int, float | None], ShardWriter] = {}  # by (shard, insert timeout)
        ragged = [f for f, spec in schema.fields.items() if spec.ragged and not spec.is_json]
        self.token_field = token_field or ("response_tokens" if "response_tokens" in ragged else
                                           (ragged[0] if len(ragged) == 1 else None))

    def _live(self) -> list[tuple[int, Any]]:
        out = []
        for k in range(self.members.num_shards):
            client = self.members.shard_client(k)
            if client is not None:
                out.append((k, client))
        return out

    # ------------------------------------------------------------------ writing whole groups to one shard
    def extend_by_group(self, batch: Any, timeout: float | None = None) -> np.ndarray:
        """Write `batch`, each row to the shard of its group key (one writer per shard); the rows' global ids."""
        from ..flight.messages import record_batch

        group = cast(GroupSampler, self.sampler)
        schema = self.schema
        cols, n = schema.validate_batch(batch)
        rb = record_batch(schema, cols)
        home = group_shards(np.asarray(cols[group.key]), self.members.num_shards)
        ids = np.empty(n, dtype=np.int64)
        for k in np.unique(home):
            rows = np.flatnonzero(home == k)
            w = self._writers.get((int(k), timeout))
            if w is None:
                if self.members.closed:
                    raise StoreClosed("this ShardedStore handle is closed; unpickle or create another")
                w = self._writers[(int(k), timeout)] = ShardWriter(self.members, self.schema, self.sampler,
                                                                   shard=int(k), timeout=timeout)
            ids[rows] = w.extend(rb.take(pa.array(rows)))
        return ids

    def close(self) -> None:
        """Close the writers that wrote whole groups to their shards. Idempotent."""
        for w in self._writers.values():
            with contextlib.suppress(Exception):
                w.close()
        self._writers.clear()

    # ------------------------------------------------------------------ consume
    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None,
                max_tokens: int | None = None, lease: float | None = None,
                admission: str | None = None) -> SampleBatch:
        """Up to `n` rows `task` has not consumed, from any shard (each row once per task).

        With `admission="oldest"` each shard delivers its oldest eligible rows first (the order is per shard, not
        across shards; `arrowbuf.samplers.admission`).

        With `lease=` each shard asked leases its part; the batch's lease id names every part with its shard
        (`"<shard>/<shard's lease>+..."`), and `ack`/`nack` end each part on its shard. A part whose shard dies
        before it is acked is lost with the shard's unacknowledged state (a restored shard delivers it again).

        First every live shard in turn (rotating the first) is asked, without waiting, for what is still missing,
        so no more than `n` rows are ever consumed. When that leaves the batch short and `timeout` > 0, the rest is
        asked of every live shard at once (split in whole groups), each waiting up to `timeout`. With `max_tokens`
        the budget is split the same way; each shard call delivers at least one row (group), so the total may pass
        the budget by one row (group) per shard asked.

        Raises:
            InvalidArgument: as `ExperienceStore.consume` (the first shard asked checks it; nothing consumed).
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"consume: n must be a positive number of rows, got {n!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not 0 <= timeout < float("inf")):
            raise InvalidArgument(f"consume: timeout must be a finite number of seconds >= 0, got {timeout!r}")
        sampler = self.sampler
        size = cast(GroupSampler, sampler).size if sampler.whole_groups else 1
        opts: dict[str, Any] = {"require": None if require is None else list(require), "max_staleness": max_staleness,
                "where": where}
        if lease is not None:
            opts["lease"] = lease
        if admission is not None:
            opts["admission"] = admission
        live = self._live()
        if not live:
            return SampleBatch({}, np.zeros(0, dtype=np.int64))
        self._turn = turn = (self._turn + 1) % len(live)
        parts: list[SampleBatch] = []
        left, budget = int(n), max_tokens
        for k, client in live[turn:] + live[:turn]:  # without waiting, shard by shard: never more than n in all
            if left < size or (budget is not None and budget <= 0):
                break
            part = self._one(k, client, task, left, 0.0, budget, opts)
            if part is None:
                continue
            parts.append(part)
            left -= len(part)
            if budget is not None:
                budget -= self._tokens(part)
        if timeout and left >= size and (budget is None or budget > 0):
            groups = left // size
            share = [groups // len(live) + (i < groups % len(live)) for i in range(len(live))]
            with cf.ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="arrowbuf-consume") as pool:
                futs = [pool.submit(self._one, k, client, task, g * size, float(timeout),
                                    None if budget is None else max(1, budget * g // groups), opts)
                        for (k, client), g in zip(live, share) if g]
                parts += [p for p in (f.result() for f in futs) if p is not None]
        full = [p for p in parts if len(p)]
        if not full:
            return parts[0] if parts else SampleBatch({}, np.zeros(0, dtype=np.int64))
        out = full[0] if len(full) == 1 else SampleBatch.concat(full, {"task": task})
        leases = [p.lease for p in full if p.lease is not None]
        out.lease, out.owner = ("+".join(leases), None) if leases else (None, None)
        return out

    def _one(self, k: int, client: Any, task: str, n: int, timeout: float, max_tokens: int | None,
             opts: dict[str, Any]) -> SampleBatch | None:
        """Shard `k`'s consume; None when the shard is unreachable (reported down)."""
        try:
            part = cast(SampleBatch, client.consume(task, n, timeout=timeout, max_tokens=max_tokens, **opts))
        except (StoreClosed, OSError, pa.ArrowException, ConnectionError) as exc:
            self.members.report_down(k, exc)
            return None
        if part.lease is not None:
            part.lease = f"{k}/{part.lease}"  # the lease names its shard
        return part

    def end_lease(self, lease: Any, verb: str) -> int:
        """`ack` or `nack` (`verb`) a lease of `consume`: each shard's part on its shard; returns the rows.

        Raises:
            LeaseError: not a lease of this store, a part no longer open on its shard, or its shard is down.
        """
        if not isinstance(lease, str) or not 0 < len(lease) <= 1 << 16:
            raise LeaseError(f"{verb}: {lease!r:.80} is not a lease id; pass batch.lease of a consumed batch")
        parts = []
        for piece in lease.split("+"):
            shard, _, inner = piece.partition("/")
            if not shard.isdigit() or not inner or int(shard) >= self.members.num_shards:
                raise LeaseError(f"{verb}: {piece!r:.80} does not name a shard of this store's lease; pass "
                                 "batch.lease of a batch this ShardedStore delivered")
            parts.append((int(shard), inner))
        rows = 0
        for k, inner in parts:
            client = self.members.shard_client(k)
            if client is None:
                raise LeaseError(f"{verb}: shard {k} of lease {lease!r:.80} is down; its part of the lease ends "
                                 "with the shard (a restored shard delivers those rows again)")
            rows += int(getattr(client, verb)(inner))
        return rows

    def _tokens(self, batch: SampleBatch) -> int:
        if self.token_field is None or self.token_field not in batch.columns or not len(batch):
            return 0
        return int(pc.sum(pc.list_value_length(batch[self.token_field])).as_py() or 0)

    # ------------------------------------------------------------------ tasks and versions
    def _every_shard(self, what: str, call: Any) -> None:
        """`call(client)` on every live shard; then, if a shard is down, `Unavailable` naming it: the change must not
        be acknowledged while a shard that comes back would not have it (the call is idempotent: repeat it once
        the shard is back)."""
        done, down = [], []
        for k in range(self.members.num_shards):
            client = self.members.shard_client(k)
            if client is None:
                down.append(k)
                continue
            call(client)
            done.append(k)
        if down:
            raise Unavailable(f"{what}: done on shards {done} but shards {down} are down (restarting or lost), so "
                              "they do not have it; repeat the call once they are back (wait_for_shards)")

    def add_task(self, name: str) -> None:
        """Declare a consuming task on every shard.

        Raises:
            Unavailable: a shard is down (the task is declared on the others; repeat the call once it is back).
        """
        self._every_shard(f"add_task({name!r})", lambda c: c.add_task(name))

    def tasks(self) -> list[str]:
        """The consuming tasks, as the first live shard has them ([] when none is live)."""
        live = self._live()
        return list(live[0][1].tasks) if live else []

    def policy_version(self) -> int:
        """The policy version, as the first live shard has it (0 when none is live)."""
        live = self._live()
        return int(live[0][1].policy_version) if live else 0

    def set_policy_version(self, value: int) -> None:
        """Set every shard's policy version.

        Raises:
            Unavailable: a shard is down (the others have the new version; set it again once it is back).
        """
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"policy_version must be a non-negative integer, got {value!r}")

        def set_on(client: Any) -> None:
            client.policy_version = int(value)

        self._every_shard(f"policy_version = {int(value)}", set_on)


__all__ = ["ShardedConsumer", "group_shards"]
