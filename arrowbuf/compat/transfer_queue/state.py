"""The system behind `arrowbuf.compat.transfer_queue`: TransferQueue's controller (partitions, global indexes, keys,
custom metadata, per-field production and per-task consumption status, field schemas, the sampler) with the field
values in arrowbuf stores (its storage).

Bookkeeping follows TransferQueue 0.1.11's controller call for call (its public tests and the differential test
check it): global indexes are system-wide, handed out by one counter and reused first-in first-out once released
(`IndexManager`); a partition registers the fields put into it, in order, with TransferQueue's field-schema rules
(`FieldInfo`: a field whose shape differs between puts becomes nested); `get_meta` has the modes `insert`, `fetch`
(ready and unconsumed samples through the sampler, marked consumed) and `force_fetch` (every sample of the
partition); clears of unknown keys, samples or partitions do nothing.

Values: a partition keeps its field values in arrowbuf `ExperienceStore`s, one per *field group* (the fields written
together by one put, each in one storage form: a fixed shape, or ragged with a per-row shape column), and records
per (field, global index) which group and row hold the value. A field whose shape changes between puts is stored
ragged from then on (`FieldState.mode`); the values of earlier puts stay where they are. A group store is a ring of
`capacity` rows: a value overwritten or cleared more than `capacity` rows ago is evicted, and reading a sample whose
value was evicted raises `StorageKeyNotFoundError`.

Guarantees: a put is validated whole (kinds and dtypes against the partition's, batch sizes) before anything is
written, and a refused put changes nothing. Everything a remote caller passes and gets is JSON or `FieldValues`
(Arrow on the wire): this class is what `server.TQServer` serves. The parts it holds are in `partition`, its
checkpoints in `checkpoint`.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import ArrowbufError, InvalidArgument, SchemaError
from ...store.facade import ExperienceStore
from .checkpoint import read, write
from .columns import FieldKind, FieldValues, ValuesSpec, schema_entry
from .partition import (
    FieldGroup,
    FieldInfo,
    FieldState,
    IndexManager,
    Partition,
    PartitionView,
    SharedMemoryBudget,
    Status,
    grow,
)
from .samplers import BaseSampler, SamplerArg, SequentialSampler, make_sampler, sampler_spec

MODES = ("insert", "fetch", "force_fetch")


class StorageKeyNotFoundError(ArrowbufError, KeyError):
    """A sample has no value for a field that a read asked for (never written, cleared, or evicted from the ring):
    TransferQueue's error for a read that reaches a missing key (also a `KeyError`)."""


class GetMetaTimeout(ArrowbufError, TimeoutError, RuntimeError):
    """`get_meta(mode="fetch")` found too few ready samples within its wait (TransferQueue's controller without
    polling_mode; its client raises a RuntimeError, hence both builtins)."""



@dataclass
class PutPlan:
    """A put between `TQState.plan_put` and `commit_put` (see there)."""

    id: int
    partition_id: str
    partition: Partition
    group: int                                  # -1: no values (a KV put of keys and tags only)
    forms: dict[str, tuple[FieldKind, Any]]
    specs: dict[str, ValuesSpec]
    nested: list[str]
    n: int
    gidx: list[int] | None
    keys: list[str] | None
    tags: list[dict[str, Any] | None] | None
    new_partition: bool
    created_group: bool
    started: float


def _largest(specs: dict[str, ValuesSpec],
             forms: dict[str, tuple[FieldKind, Any]]) -> dict[str, tuple[int, int]] | None:
    """(elements, dimensions) of the largest sample of each ragged field of a put, or None where one is not known
    (text put over DoPut: its lengths arrive with its messages)."""
    out = {}
    for f, (_, mode) in forms.items():
        if mode == "ragged":
            largest = specs[f].longest()
            if largest is None:
                return None
            out[f] = largest
    return out


class TQState:
    """Every partition of one TransferQueue-compatible system, behind one lock (see the module docstring).

    `shared_memory`: field groups without JSON fields in /dev/shm (`server`: clients of the node write and read their
    rows themselves); their stores together reserve at most `shm_budget` bytes there (default: half of /dev/shm's
    size); past it a group's store is made in this process's memory and its rows go over Flight."""

    def __init__(self, capacity: int = 65_536, sampler: SamplerArg = None, polling_mode: bool = False,
                 wait: float = 5.0, shared_memory: bool = False, shm_budget: int | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(f"capacity must be a positive number of rows, got {capacity!r}")
        self.capacity = capacity
        # field groups in /dev/shm, so that clients of the node write and read their rows themselves (`server`)
        self.shared_memory = bool(shared_memory)
        if shm_budget is not None and (not isinstance(shm_budget, int) or isinstance(shm_budget, bool)
                                       or shm_budget < 0):
            raise InvalidArgument(f"shm_budget must be a number of bytes >= 0 or None, got {shm_budget!r}")
        self.shm_budget = SharedMemoryBudget(f"tq-{os.getpid()}-{secrets.token_hex(4)}",
                                             SharedMemoryBudget.default_limit() if shm_budget is None else shm_budget)
        self.sampler: BaseSampler = make_sampler(sampler) if sampler is not None else SequentialSampler()
        self.polling_mode = bool(polling_mode)
        self.wait = float(wait)
        self.partitions: dict[str, Partition] = {}
        self.index = IndexManager()
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._samplers: dict[str, BaseSampler] = {}
        self._plans: dict[int, PutPlan] = {}
        self._plan_ids = 0
        self.plan_ttl = 600.0   # seconds a plan stays open (a writer that died between plan and commit)

    # ------------------------------------------------------------------ partitions
    def _partition(self, partition_id: object, create: bool = False) -> Partition | None:
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidArgument(f"partition_id must be a non-empty str, got {partition_id!r}")
        p = self.partitions.get(partition_id)
        if p is None and create:
            p = self.partitions[partition_id] = Partition(partition_id)
        return p

    def list_partitions(self) -> list[str]:
        with self.lock:
            return list(self.partitions)

    # ------------------------------------------------------------------ metadata
    def _meta(self, p: Partition, gidx: list[int], fields: list[str], mode: str) -> dict[str, Any]:
        schema = {f: p.info[f].batch_schema(gidx) for f in fields if f in p.info}
        if mode == "insert":
            for f in fields:
                schema.setdefault(f, {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False})
        n = len(gidx)
        if mode == "fetch":
            status = np.ones(n, dtype=np.int8)
        elif mode == "insert":
            status = np.zeros(n, dtype=np.int8)
        else:
            known = [f for f in fields if f in p.field_order]
            status = np.zeros(n, dtype=np.int8)
            if known:
                status[:] = p.produced(known, np.asarray(gidx, dtype=np.int64)).all(axis=1)
        return {"global_indexes": list(gidx), "partition_id": p.partition_id, "field_schema": schema,
                "production_status": status.tolist(), "custom_meta": [p.custom_meta.get(g, {}) for g in gidx]}

    def _sampler(self, spec: SamplerArg) -> BaseSampler:
        if spec is None:
            return self.sampler
        if isinstance(spec, BaseSampler):
            return spec
        key = json.dumps(sampler_spec(spec), sort_keys=True)  # one instance per spec: cached picks persist
        if key not in self._samplers:
            self._samplers[key] = make_sampler(json.loads(key))
        return self._samplers[key]

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int | None, mode: str = "fetch",
                 task_name: str | None = None, sampler: SamplerArg = None,
                 sampling_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """TransferQueue's `get_metadata`: `insert` allocates `batch_size` new samples; `fetch` waits (without
        `polling_mode`) for `batch_size` samples with every field of `data_fields` produced and not consumed by
        `task_name`, lets the sampler pick and marks its consumed ones (empty when none are ready in polling mode);
        `force_fetch` returns every sample of the partition. Returns a meta record (`client` makes a BatchMeta)."""
        if mode not in MODES:
            raise InvalidArgument(f"Invalid mode: {mode}; expected one of {list(MODES)}")
        fields = list(data_fields or [])
        with self.lock:
            if mode == "insert":
                if batch_size is None:
                    raise ValueError("must provide batch_size for inserting new data")
                p = self._partition(partition_id, create=True)
                assert p is not None
                gidx = self.index.allocate(partition_id, int(batch_size))
                p.indexes.update(gidx)
                self.changed.notify_all()
                return self._meta(p, gidx, fields, mode)
            if mode == "force_fetch":
                p = self._partition(partition_id)
                if p is None:
                    raise ValueError(f"Partition {partition_id} not found")
                # the order TransferQueue's index manager hands them out in: a list of a copy of the set
                return self._meta(p, list(self.index.of.get(partition_id, set()).copy()), fields, mode)
            if task_name is None:
                raise InvalidArgument("get_meta(mode='fetch') needs a task_name: consumption is tracked per task")
            if batch_size is None:
                raise ValueError("must provide batch_size in fetch mode")
            s = self._sampler(sampler)
            config = dict(sampling_config or {})
            deadline = time.monotonic() + self.wait
            while True:
                p = self._partition(partition_id)
                ready = p.ready(fields, task_name) if p is not None else []
                if len(ready) >= batch_size:
                    break
                if self.polling_mode:
                    if s.has_cached_result(partition_id, task_name, config):
                        break
                    return _empty_meta()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GetMetaTimeout(f"Timeout while waiting for sufficient data for task {task_name}. "
                                         f"Required: {batch_size}, Available: {len(ready)} (fields {fields} in "
                                         f"partition {partition_id!r}); polling_mode=True returns an empty "
                                         "BatchMeta instead")
                self.changed.wait(left)
            part = p if p is not None else Partition(partition_id)
            sampled, consumed = s(ready, batch_size, partition=PartitionView(part), **config)
            sampled, consumed = [int(i) for i in sampled], [int(i) for i in consumed]
            if not sampled:
                if self.polling_mode:
                    return _empty_meta()
                raise RuntimeError(f"Sampler returned no samples. Please check the sampler logic. Expected: "
                                   f"{batch_size}, before sampling: {len(ready)}, after sampling: 0")
            if p is None:
                return _empty_meta()
            p.mark_consumed(task_name, consumed)
            return self._meta(p, sampled, fields, mode)

    def kv_retrieve_meta(self, partition_id: str, keys: list[str], create: bool = False) -> dict[str, Any]:
        """The samples of `keys` (unknown ones left out, or created as new samples when `create`), with the fields
        that every one of them has."""
        with self.lock:
            p = self._partition(partition_id, create=create)
            if p is None:
                return _empty_meta()
            gidx: list[int | None] = [p.keys.get(k) for k in keys]
            missing = [i for i, g in enumerate(gidx) if g is None]
            if missing and create:
                fresh = self.index.allocate(partition_id, len(missing))
                p.indexes.update(fresh)
                for i, g in zip(missing, fresh, strict=True):
                    gidx[i] = g
                    p.keys[keys[i]] = g
                    p.key_of[g] = keys[i]
            found = [g for g in gidx if g is not None]
            arr = np.asarray(found, dtype=np.int64)
            fields = [f for f in p.field_order if p.produced([f], arr).all()] if found else list(p.field_order)
            return self._meta(p, found, fields, "force_fetch")

    def kv_put(self, partition_id: str, keys: list[str], values: dict[str, FieldValues],
               nested: list[str], tags: list[dict[str, Any] | None] | None) -> dict[str, Any]:
        """TransferQueue's KV put (retrieve-or-create the keys, put the values, merge the tags) as one atomic step:
        refused input changes nothing, not even the keys. Returns {"fields": the fields every key has afterwards
        as TransferQueue's returned BatchMeta lists them, "tags": the keys' merged tags}."""
        with self.lock:
            plan = self.plan_put(partition_id, {f: v.spec() for f, v in values.items()}, nested, len(keys),
                                 keys=keys, tags=tags)
            try:
                rows = self.write_plan(plan, values)
            except BaseException:
                self.abort_put(plan)
                raise
            return self.commit_put(plan, rows)

    def kv_retrieve_keys(self, partition_id: str, gidx: list[int]) -> list[str | None]:
        with self.lock:
            p = self._partition(partition_id)
            return [] if p is None else [p.key_of.get(int(g)) for g in gidx]

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        with self.lock:
            pids = list(self.partitions) if partition_id is None else [partition_id]
            return {pid: {k: dict(self.partitions[pid].custom_meta.get(g, {}))
                          for k, g in self.partitions[pid].keys.items()}
                    for pid in pids if pid in self.partitions}

    def set_custom_meta(self, custom_meta: dict[str, dict[int, dict[str, Any]]]) -> None:
        """Replace the custom metadata of samples: {partition_id: {global index: dict}} (unknown partitions are
        ignored, as TransferQueue does)."""
        with self.lock:
            for pid, per in custom_meta.items():
                p = self.partitions.get(pid)
                if p is not None:
                    p.custom_meta.update({int(g): dict(m) for g, m in per.items()})

    # ------------------------------------------------------------------ writes
    def check_put(self, partition_id: str, values: dict[str, FieldValues] | dict[str, ValuesSpec]) -> Partition:
        """The partition of a put whose kinds and dtypes match the partition's (SchemaError otherwise)."""
        p = self._partition(partition_id)
        if p is None:
            raise ValueError(f"partition {partition_id!r} not found (cleared, or never created by get_meta "
                             "insert / a KV put); nothing was written")
        for f, v in values.items():
            st = p.fields.get(f)
            if st is not None and st.kind != v.kind and f in p.info:  # a field with no sample left may change
                raise SchemaError(f"field {f!r}: this put holds {v.kind.describe()}, but the partition's field "
                                  f"holds {st.kind.describe()}; a field keeps its kind and dtype; nothing was "
                                  "written")
        return p

    #: Calls need no serialization (the client holds this object in its own process).
    in_process = True

    def put(self, partition_id: str, gidx: list[int], values: dict[str, FieldValues],
            nested: list[str] | tuple[str, ...] = ()) -> None:
        """Store `values` (n samples each) for samples `gidx` of the partition and register them produced;
        atomic. `nested`: the fields the writer gave as nested tensors (their schema says nested)."""
        if not values:
            return
        with self.lock:
            plan = self.plan_put(partition_id, {f: v.spec() for f, v in values.items()}, nested, len(gidx),
                                 gidx=gidx)
            try:
                rows = self.write_plan(plan, values)
            except BaseException:
                self.abort_put(plan)
                raise
            self.commit_put(plan, rows)

    # A put in three steps (`put` and `kv_put` take them at once under the lock; `server` writes the values of a
    # Flight put as they arrive, and a process of the node its shared-memory store's rows itself, with the lock
    # released in between): `plan_put` checks it whole and picks the field group and the room for its rows,
    # `write_plan` (or the writer) appends the rows, `commit_put` registers them (or `abort_put` forgets them: rows
    # written for a plan never committed are dead rows, overwritten in place).
    def plan_put(self, partition_id: str, specs: dict[str, ValuesSpec], nested: list[str] | tuple[str, ...],
                 n: int, gidx: list[int] | None = None, keys: list[str] | None = None,
                 tags: list[dict[str, Any] | None] | None = None) -> PutPlan:
        """A put of `n` samples with values described by `specs`, for samples `gidx` or (a KV put) `keys` with
        `tags`, checked whole (nothing is written or registered if it raises)."""
        if keys is not None:
            if len(set(keys)) != len(keys):
                raise ValueError("Got duplicated keys.")
            if tags is not None and len(tags) != len(keys):
                raise ValueError(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
            if any(v.n != len(keys) for v in specs.values()):
                raise ValueError(f"`keys` with length {len(keys)} does not match the values of "
                                 f"{sorted({v.n for v in specs.values()})} samples")
        with self.lock:
            self._expire_plans()
            new_partition = keys is not None and partition_id not in self.partitions
            p = self._partition(partition_id, create=keys is not None)
            assert p is not None or keys is None
            try:
                p = self.check_put(partition_id, specs) if specs or keys is None else p
                assert p is not None
                if keys is None and any(v.n != n for v in specs.values()):
                    raise SchemaError(f"put: values for {sorted({v.n for v in specs.values()})} samples, "
                                      f"{n} global indexes; nothing was written")
                forms: dict[str, tuple[FieldKind, Any]] = {}
                for f, v in specs.items():
                    st = p.fields.get(f)
                    if st is not None and st.kind != v.kind:  # every sample of the old kind was cleared
                        st = None
                    shape = v.uniform_shape()
                    if st is None:
                        forms[f] = (v.kind, shape if shape is not None else "ragged")
                    elif st.mode == "ragged" or shape != st.mode:
                        forms[f] = (v.kind, "ragged" if v.kind.kind == "tensor" else st.mode)
                    else:
                        forms[f] = (v.kind, st.mode)
                g, created = self._target(p, forms, n, _largest(specs, forms)) if forms else (-1, False)
            except BaseException:
                if new_partition:
                    self.partitions.pop(partition_id, None)
                raise
            self._plan_ids += 1
            plan = PutPlan(self._plan_ids, partition_id, p, g, forms, specs, list(nested), n, gidx, keys, tags,
                           new_partition, created, time.monotonic())
            if g >= 0:
                p.stores[g].pending += n
            self._plans[plan.id] = plan
            return plan

    def _target(self, p: Partition, forms: dict[str, tuple[FieldKind, Any]], n: int,
                need: dict[str, tuple[int, int]] | None) -> tuple[int, bool]:
        """The field group the rows of `forms` go to, with room made for `n` more (a new group when there is none,
        when its store must grow while writes into it are in flight, or when its shared arenas were made for smaller
        samples than `need`'s); and whether it is new."""
        key = tuple(sorted((f, k.to_json()[0], k.dtype, str(m)) for f, (k, m) in forms.items()))
        g = p.groups.get(key)
        rows = n
        if g is not None:
            group = p.stores[g]
            if group.fits(need) and group.make_room(n, p.oldest_live_row(g)):
                return g, False
            rows = max(n, 2 * group.store.capacity)
            if need is not None and group.need:  # the next arenas hold the largest samples of both
                need = {f: (max(e, group.need.get(f, (0, 0))[0]), max(d, group.need.get(f, (0, 0))[1]))
                        for f, (e, d) in need.items()}
        group = FieldGroup(f"{p.partition_id}.g{len(p.stores)}", forms, self.capacity, rows=rows,
                           shm=self.shm_budget if self.shared_memory else None, need=need)
        p.stores.append(group)
        p.groups[key] = len(p.stores) - 1
        return len(p.stores) - 1, True

    def write_batch(self, plan: PutPlan, batch: pa.RecordBatch) -> np.ndarray | None:
        """`write_plan` of a put's record batch (a column per field) its group takes as it is; None: it does not
        (then `write_plan` of its values)."""
        if plan.group < 0:
            return None
        group = plan.partition.stores[plan.group]
        return group.write_batch(batch) if group.takes_as_is(batch.schema) else None

    def write_plan(self, plan: PutPlan, values: dict[str, FieldValues]) -> np.ndarray:
        """Append the rows of `values` (some or all of a plan's samples) to its group; their row ids."""
        if plan.group < 0:
            return np.empty(0, dtype=np.int64)
        return plan.partition.stores[plan.group].write(values)

    def plan_of(self, plan_id: int) -> PutPlan:
        with self.lock:
            plan = self._plans.get(plan_id)
        if plan is None:
            raise InvalidArgument(f"put plan {plan_id} is not open (committed, aborted, or expired after "
                                  f"{self.plan_ttl:g} s); nothing was registered")
        return plan

    def is_open(self, plan: PutPlan) -> bool:
        """Whether `plan` is still open (neither committed, aborted nor expired)."""
        with self.lock:
            self._expire_plans()
            return plan.id in self._plans

    def _close_plan(self, plan: PutPlan) -> None:
        if self._plans.pop(plan.id, None) is None:
            raise InvalidArgument(f"put plan {plan.id} is not open (committed, aborted, or expired after "
                                  f"{self.plan_ttl:g} s); nothing was registered")
        if 0 <= plan.group < len(plan.partition.stores):  # (a partition cleared meanwhile closed its groups)
            plan.partition.stores[plan.group].pending -= plan.n

    def _expire_plans(self) -> None:
        old = time.monotonic() - self.plan_ttl
        for plan in [pl for pl in self._plans.values() if pl.started < old]:
            self.abort_put(plan)

    def abort_put(self, plan: PutPlan) -> None:
        """Forget a plan (its rows, if any were written, are dead); a partition it created and left empty goes."""
        with self.lock:
            if plan.id not in self._plans:
                return
            self._close_plan(plan)
            p = plan.partition
            if plan.created_group and plan.group == len(p.stores) - 1 and not p.stores[-1].pending and not any(
                    (st.group == plan.group).any() for st in p.fields.values()):
                for key in [k for k, g in p.groups.items() if g == plan.group]:
                    p.groups.pop(key)
                p.stores.pop().close()
            if plan.new_partition and self.partitions.get(plan.partition_id) is p and not p.indexes and not p.stores:
                self.partitions.pop(plan.partition_id)

    def commit_put(self, plan: PutPlan, rows: np.ndarray) -> dict[str, Any]:
        """Register a plan's samples with their values at row ids `rows` of its group (KV puts: the keys, created
        as new samples where unknown, and the tags). Returns the KV put's result ({} for a put)."""
        with self.lock:
            self._close_plan(plan)
            p = plan.partition
            if self.partitions.get(plan.partition_id) is not p:
                raise ValueError(f"partition {plan.partition_id!r} was cleared while the put was written; nothing "
                                 "was registered")
            if len(rows) != (plan.n if plan.group >= 0 else 0):
                raise SchemaError(f"put: {len(rows)} rows written for {plan.n} samples; nothing was registered")
            if plan.specs:
                self.check_put(plan.partition_id, plan.specs)
            if plan.keys is None:
                assert plan.gidx is not None
                self._register(plan, plan.gidx, rows)
                return {}
            keys, tags = plan.keys, plan.tags
            gidx: list[int | None] = [p.keys.get(k) for k in keys]
            missing = [i for i, g in enumerate(gidx) if g is None]
            fresh = self.index.allocate(plan.partition_id, len(missing)) if missing else []
            for i, g in zip(missing, fresh, strict=True):
                gidx[i] = g
            ids = [int(g) for g in gidx]  # type: ignore[arg-type]
            arr = np.asarray(ids, dtype=np.int64)
            before = [f for f in p.field_order if f in p.info and p.produced([f], arr).all()] if not missing else []
            p.indexes.update(fresh)
            self._register(plan, ids, rows)
            for i, g in zip(missing, fresh, strict=True):
                p.keys[keys[i]] = g
                p.key_of[g] = keys[i]
            merged = []
            for i, g in enumerate(ids):
                m = dict(p.custom_meta.get(g, {}))
                if tags is not None:
                    m.update(tags[i] or {})
                    p.custom_meta[g] = m
                merged.append(m)
            return {"fields": sorted(set(before) | set(plan.specs)), "tags": merged}

    def _register(self, plan: PutPlan, gidx: list[int], rows: np.ndarray) -> None:
        p, g = plan.partition, plan.group
        arr = np.asarray(gidx, dtype=np.int64)
        need = int(arr.max()) + 1 if len(arr) else 0
        for f, (kind, mode) in plan.forms.items():
            st = p.fields.get(f)
            if st is None or st.kind != kind:
                st = p.fields[f] = FieldState(kind, mode)
                p.field_order.setdefault(f, len(p.field_order))
            elif mode == "ragged":
                st.mode = "ragged"
            st.group = grow(st.group, need, -1)
            st.seq = grow(st.seq, need, -1)
            st.group[arr] = g
            st.seq[arr] = rows
            entry = schema_entry(plan.specs[f], f in plan.nested)
            if f in p.info:
                p.info[f].update(entry, list(gidx))
            else:
                p.info[f] = FieldInfo.first(entry, list(gidx))
        p.indexes.update(gidx)
        self.changed.notify_all()

    # ------------------------------------------------------------------ reads
    def read(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues]:
        """The values of `fields` for samples `gidx`, in that order.

        Raises:
            StorageKeyNotFoundError: a sample without a value for a field (never written, cleared or evicted).
        """
        with self.lock:  # a group's store is replaced when it grows: read it before it can be
            located = self.locate(partition_id, gidx, fields)
            return read_located(located, len(gidx), lambda g: self.partitions[partition_id].stores[g])

    def locate(self, partition_id: str, gidx: list[int], fields: list[str]) -> Located:
        """Where the values of `fields` for samples `gidx` are: per field, (field group index, the positions in
        `gidx` it holds, their row ids) for each group holding some (`read_located` reads them).

        Raises:
            StorageKeyNotFoundError: a sample without a value for a field (never written or cleared).
        """
        arr = np.asarray(gidx, dtype=np.int64)
        with self.lock:
            p = self._partition(partition_id)
            out: Located = {}
            for f in fields:
                st = p.fields.get(f) if p is not None else None
                has = st.has(arr) if st is not None else np.zeros(len(arr), dtype=bool)
                if not has.all():
                    missing = arr[~has][:8].tolist()
                    raise StorageKeyNotFoundError(f"field {f!r} has no value for global index(es) {missing} in "
                                                  f"partition {partition_id!r} (not produced, cleared or evicted)")
                if st is None or p is None:
                    raise StorageKeyNotFoundError(f"field {f!r} has no values in partition {partition_id!r}")
                if not len(arr):  # no samples: the field's values of none, from the group it was last put into
                    g = max(i for i, s in enumerate(p.stores) if f in s.forms)
                    out[f] = [(g, arr, arr)]
                    continue
                groups = st.group[arr]
                out[f] = [(g, pos, st.seq[arr[pos]]) for g in np.unique(groups).tolist()
                          for pos in [np.flatnonzero(groups == g)]]
            return out

    def groups_of(self, partition_id: str, located: Located) -> dict[int, FieldGroup]:
        """The field groups `located` names (of partition `partition_id`)."""
        with self.lock:
            p = self._partition(partition_id)
            if p is None:
                raise StorageKeyNotFoundError(f"partition {partition_id!r} not found")
            return {g: p.stores[g] for g in {g for pieces in located.values() for g, _, _ in pieces}}

    # ------------------------------------------------------------------ status
    def production_status(self, partition_id: str, data_fields: list[str]) -> Status:
        """(sorted global indexes, [n, fields] 0/1, the fields in the partition's registration order) of the
        partition, or None (unknown partition or field, no fields)."""
        with self.lock:
            p = self._partition(partition_id)
            if p is None or not data_fields or any(f not in p.field_order for f in data_fields):
                return None
            idx = np.asarray(sorted(p.indexes), dtype=np.int64)
            columns = [f for f in p.field_order if f in data_fields]  # TransferQueue's order: the partition's
            return idx.tolist(), p.produced(columns, idx).tolist()

    def consumption_status(self, partition_id: str, task_name: str) -> Status:
        """(sorted global indexes, 0/1 consumed by `task_name`), or None for an unknown partition."""
        with self.lock:
            p = self._partition(partition_id)
            if p is None:
                return None
            idx = np.asarray(sorted(p.indexes), dtype=np.int64)
            return idx.tolist(), p.is_consumed(task_name, idx).astype(np.int8).tolist()

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let `task_name` (every task when None) consume the partition's samples again."""
        with self.lock:
            p = self.partitions.get(partition_id)
            if p is not None:
                for t, arr in p.consumed.items():
                    if task_name is None or t == task_name:
                        arr[:] = False
                self.changed.notify_all()
            return True

    # ------------------------------------------------------------------ clears
    def clear_samples(self, partition_ids: list[str], gidx: list[int]) -> None:
        """Drop samples (ones not in their partition are ignored); their indexes are released for reuse."""
        if len(partition_ids) != len(gidx):
            raise ValueError(f"global_indexes and partition_ids must have the same length, got {len(gidx)} and "
                             f"{len(partition_ids)}")
        with self.lock:
            by: dict[str, list[int]] = {}
            for pid, g in sorted(zip(partition_ids, gidx, strict=True), key=lambda t: t[0]):
                by.setdefault(pid, []).append(int(g))
            for pid, gs in by.items():
                p = self.partitions.get(pid)
                if p is None:
                    continue
                mine = list(set(gs) & p.indexes)
                if mine:
                    p.clear(mine)
                    self.index.release(pid, mine)

    def clear_partition(self, partition_id: str) -> None:
        """Drop a partition: its samples, keys, statuses and stores (an unknown one: nothing)."""
        with self.lock:
            p = self.partitions.get(partition_id)
            if p is None:
                return
            p.clear(list(self.index.of.get(partition_id, set())))
            self.index.release_partition(partition_id)
            self.partitions.pop(partition_id)
            self.sampler.clear_cache(partition_id)
            for s in self._samplers.values():
                s.clear_cache(partition_id)
        p.close()

    # ------------------------------------------------------------------ inspection
    def snapshot(self, partition_id: str) -> dict[str, Any] | None:
        """A copy of a partition's bookkeeping (TransferQueue's partition snapshot), or None."""
        with self.lock:
            p = self.partitions.get(partition_id)
            if p is None:
                return None
            valued = [int(g) for s in p.fields.values() for g in np.flatnonzero(s.group >= 0).tolist()]
            rows = max([*p.indexes, *valued], default=-1)
            order = list(p.field_order)
            matrix = p.produced(order, np.arange(rows + 1, dtype=np.int64)) if order else np.zeros((rows + 1, 0))
            return {"partition_id": p.partition_id, "created_at": p.created_at, "global_indexes": sorted(p.indexes),
                    "keys_mapping": dict(p.keys), "custom_meta": {g: dict(m) for g, m in p.custom_meta.items()},
                    "field_name_mapping": dict(p.field_order), "production_status": matrix.tolist(),
                    "consumption_status": {t: np.flatnonzero(c).tolist() for t, c in p.consumed.items()},
                    "field_schema": {f: i.to_json() for f, i in p.info.items()}}

    def field_kinds(self, partition_id: str) -> dict[str, list[str]]:
        """The kind (`FieldKind.to_json`) of each field of the partition that holds values ({} when none)."""
        with self.lock:
            p = self.partitions.get(partition_id)
            return {} if p is None else {f: st.kind.to_json() for f, st in p.fields.items() if f in p.info}

    def stores(self, partition_id: str) -> dict[str, ExperienceStore]:
        """The arrowbuf stores of a partition's field groups, by name (for SQL, checkpoints, inspection)."""
        with self.lock:
            p = self._partition(partition_id)
            if p is None:
                raise KeyError(f"partition {partition_id!r} not found")
            return {s.store.name: s.store for s in p.stores}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Write the system to directory `path` (see `checkpoint.write`)."""
        with self.lock:
            write(path, self.partitions, self.index, self.sampler.save_checkpoint(), self.capacity)

    def load_checkpoint(self, path: str) -> None:
        """Replace the system's state with `save_checkpoint`'s (see `checkpoint.read`)."""
        partitions, index, sampler_state = read(path, self.capacity)
        with self.lock:
            old, self.partitions = self.partitions, partitions
            self.index = index
            self.sampler.load_checkpoint(sampler_state)
            self.changed.notify_all()
        for p in old.values():
            p.close()

    def close(self) -> None:
        with self.lock:
            parts, self.partitions = list(self.partitions.values()), {}
        for p in parts:
            p.close()


#: Where values are (`TQState.locate`): per field, (field group index, positions in the request, row ids).
Located = dict[str, list[tuple[int, np.ndarray, np.ndarray]]]


def read_located(located: Located, n: int, group: Callable[[int], FieldGroup]) -> dict[str, FieldValues]:
    """The values `located` names, `n` samples per field in request order, read from the groups `group` gives (the
    system's own, or a client's attached ones).

    Raises:
        StorageKeyNotFoundError: some rows were evicted (or overwritten after a clear) meanwhile."""
    out: dict[str, FieldValues] = {}
    for f, where in located.items():
        pieces: list[tuple[np.ndarray, FieldValues]] = []
        for g, pos, rows in where:
            got = group(g).read([f], rows)
            if got is None:
                raise StorageKeyNotFoundError(f"field {f!r} of some of the samples at positions {pos[:8].tolist()} "
                                              "was evicted from the ring or overwritten after a clear (raise "
                                              "arrowbuf.capacity in init's conf)")
            if not n:
                out[f] = got[f]
                break
            pieces.append((pos, got[f]))
        else:
            out[f] = FieldValues.join(pieces, n)
    return out


def _empty_meta() -> dict[str, Any]:
    return {"global_indexes": [], "partition_id": None, "field_schema": {}, "production_status": [],
            "custom_meta": []}

