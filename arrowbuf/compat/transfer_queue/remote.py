"""The client side of `tq.v2` (`wire`): the calls `TransferQueueClient` makes (`client.Backend`), over Arrow Flight.

Inside a Ray job the system's actor is known too (`actor`): checkpoints go to it as Ray calls (the actor writes and
reads the files; the Flight server takes no paths)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import ArrowbufError, InvalidArgument, OutOfSpace, SchemaError
from ...ring.outpool import OutputPool
from ...tiers.shm import store_path
from .columns import FieldKind, FieldValues
from .partition import FieldGroup, Status
from .samplers import SamplerArg, sampler_spec
from .state import read_located
from .wire import ERROR_RE, ERRORS, VERSION, chunk_rows

log = logging.getLogger("arrowbuf.compat")
#: Shared stores a client keeps open at once (the oldest closes first).
_MAX_ATTACHED = 64


class RemoteBackend:
    """`client.Backend` over Flight (see the module docstring)."""

    in_process = False

    def __init__(self, location: str, token: str | None = None, actor: Any = None,
                 shared_memory: bool = True) -> None:
        self.location = location
        self.actor = actor
        # a system whose field groups are in /dev/shm, on this node: puts and reads go through shared memory
        # (`shm_*` actions; None: not known yet, False: off, or the system's stores cannot be opened here)
        self._shm_ok: bool | None = None if shared_memory else False
        self._groups: OrderedDict[str, FieldGroup] = OrderedDict()  # attached shared stores, least recent first
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = flight.FlightClient(location)
        self._options = flight.FlightCallOptions(headers=headers)
        self._pool = OutputPool()  # read replies' dense fields (an array is reused only once nothing holds it)

    def _raise(self, e: Exception) -> None:
        m = ERROR_RE.search(str(e))
        if m is None:
            raise e
        msg = m.group(2).split("\n")[0].split(". Detail:")[0]
        raise ERRORS[m.group(1)](msg) from None

    def _act(self, op: str, /, **body: Any) -> Any:
        try:
            payload = json.dumps(body).encode()
        except TypeError as e:
            raise InvalidArgument(f"{op}: arguments must be JSON values over Flight ({e})") from None
        try:
            out = list(self._client.do_action(flight.Action(f"{VERSION}.{op}", payload), self._options))
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(out[0].body.to_pybytes())["result"]

    # ------------------------------------------------------------------ metadata
    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int | None, mode: str = "fetch",
                 task_name: str | None = None, sampler: SamplerArg = None,
                 sampling_config: dict[str, Any] | None = None) -> dict[str, Any]:
        spec = sampler_spec(sampler)  # a sampler travels as its class and parameters, never only its name
        return dict(self._act("get_meta", partition_id=partition_id, data_fields=data_fields, batch_size=batch_size,
                              mode=mode, task_name=task_name, sampler=spec, sampling_config=sampling_config or {}))

    def kv_retrieve_meta(self, partition_id: str, keys: list[str], create: bool = False) -> dict[str, Any]:
        return dict(self._act("kv_retrieve_meta", partition_id=partition_id, keys=keys, create=create))

    def kv_retrieve_keys(self, partition_id: str, gidx: list[int]) -> list[str | None]:
        return list(self._act("kv_retrieve_keys", partition_id=partition_id, gidx=list(gidx)))

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return dict(self._act("kv_list", partition_id=partition_id))

    def set_custom_meta(self, custom_meta: dict[str, dict[int, dict[str, Any]]]) -> None:
        self._act("set_custom_meta", custom_meta={p: [[int(g), m] for g, m in per.items()]
                                                  for p, per in custom_meta.items()})

    def production_status(self, partition_id: str, data_fields: list[str]) -> Status:
        return self._act("production_status", partition_id=partition_id, data_fields=data_fields)

    def consumption_status(self, partition_id: str, task_name: str) -> Status:
        return self._act("consumption_status", partition_id=partition_id, task_name=task_name)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return bool(self._act("reset_consumption", partition_id=partition_id, task_name=task_name))

    def clear_samples(self, partition_ids: list[str], gidx: list[int]) -> None:
        self._act("clear_samples", partition_ids=list(partition_ids), gidx=[int(g) for g in gidx])

    def clear_partition(self, partition_id: str) -> None:
        self._act("clear_partition", partition_id=partition_id)

    def list_partitions(self) -> list[str]:
        return list(self._act("list_partitions"))

    def snapshot(self, partition_id: str) -> dict[str, Any] | None:
        return self._act("snapshot", partition_id=partition_id)

    def field_kinds(self, partition_id: str) -> dict[str, list[str]]:
        return dict(self._act("field_kinds", partition_id=partition_id))

    # ------------------------------------------------------------------ values
    def _put(self, command: dict[str, Any], values: dict[str, FieldValues]) -> Any:
        names = list(values)
        command["kinds"] = {f: values[f].kind.to_json() for f in names}
        command["shapes"] = {f: [list(s) for s in v.sample_shapes()] for f, v in values.items() if v.ragged}
        table = pa.table([values[f].to_arrow() for f in names], names=names) if names else pa.table({})
        try:
            writer, reader = self._client.do_put(flight.FlightDescriptor.for_command(json.dumps(command).encode()),
                                                 table.schema, self._options)
            with writer:
                if table.num_columns:
                    writer.write_table(table, max_chunksize=chunk_rows(table))
                writer.done_writing()
                buf = reader.read()
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(buf.to_pybytes())["result"]

    @property
    def through_shared_memory(self) -> bool | None:
        """True once a put or read went through shared memory; False when it is off or the system's stores cannot
        be opened here (puts and reads go over Flight); None before the first put or read through it (groups of
        ragged, string or JSON values go over Flight either way)."""
        return self._shm_ok

    def _group(self, described: dict[str, Any]) -> FieldGroup | None:
        """The field group a `shm_*` reply describes, attached in this process (cached); None where its store cannot
        be opened here (another node, another user's /dev/shm): then this client goes over Flight from now on."""
        name = str(described["shm"])
        group = self._groups.get(name)
        if group is None:
            try:
                group = FieldGroup.attached(name, FieldGroup.forms_of(described), int(described["base"]))
            except (ArrowbufError, OSError) as e:
                log.info("%s: the system's shared store %s cannot be opened here (%s); puts and reads go over "
                         "Flight", self.location, name, e)
                self._shm_ok = False
                return None
            # the stores the system removed since (a grown group's old store, a cleared partition's): their memory
            # stays allocated while a process maps them, and a closed store's arrays (its mappings) go with the
            # store object, which reference cycles keep until a collection
            removed = [n for n in self._groups if not os.path.isdir(store_path(n))]
            for old in removed:
                self._groups.pop(old).close()
            if removed:
                gc.collect()
            self._groups[name] = group
            while len(self._groups) > _MAX_ATTACHED:
                self._groups.popitem(last=False)[1].close()
        self._groups.move_to_end(name)
        return group

    def _put_shm(self, command: dict[str, Any], values: dict[str, FieldValues]) -> tuple[bool, Any]:
        """A put through shared memory: plan, write the rows into the group's store here, commit. (False, None)
        where the system answers no shared store (then DoPut)."""
        body = {**command, "kinds": {f: v.kind.to_json() for f, v in values.items()},
                "shapes": {f: [list(s) for s in v.sample_shapes()] for f, v in values.items() if v.ragged},
                "dense": {f: list(v.dense.shape[1:]) for f, v in values.items() if v.dense is not None},
                "max_len": {f: m for f, v in values.items() if (m := v.spec().max_len) is not None}}
        reply = self._act("shm_plan", **body)
        if reply["shm"] is None:  # the system has none (then never again), or this group has none
            self._shm_ok = False if reply.get("off") else self._shm_ok
            return False, None
        handle = reply["plan"]
        try:
            group = self._group(reply["shm"])
            if group is None:
                self._act("shm_abort", plan=handle)
                return False, None
            rows = group.write(values)
        except OutOfSpace:  # its shared arenas are smaller than the system planned (checked before any write)
            with contextlib.suppress(Exception):
                self._act("shm_abort", plan=handle)
            return False, None
        except BaseException:
            with contextlib.suppress(Exception):
                self._act("shm_abort", plan=handle)
            raise
        self._shm_ok = True
        return True, self._act("shm_commit", plan=handle, rows=rows.tolist())

    def _read_shm(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues] | None:
        """A read through shared memory: locate, then read the rows from the groups' stores here; None where the
        system answers no shared store (then DoGet)."""
        reply = self._act("shm_locate", partition_id=partition_id, gidx=[int(g) for g in gidx], fields=fields)
        if reply["shm"] is None:
            self._shm_ok = False if reply.get("off") else self._shm_ok
            return None
        groups: dict[int, FieldGroup] = {}
        for k, described in reply["shm"].items():
            group = self._group(described)
            if group is None:
                return None
            groups[int(k)] = group
        located = {f: [(int(k), np.asarray(pos, dtype=np.int64), np.asarray(rows, dtype=np.int64))
                       for k, pos, rows in where] for f, where in reply["fields"].items()}
        got = read_located(located, len(gidx), groups.__getitem__)
        self._shm_ok = True
        return got

    def put(self, partition_id: str, gidx: list[int], values: dict[str, FieldValues],
            nested: list[str]) -> None:
        command = {"op": "put", "partition_id": partition_id, "gidx": [int(g) for g in gidx], "nested": list(nested)}
        if values and self._shm_ok is not False and self._put_shm(command, values)[0]:
            return
        self._put(command, values)

    def kv_put(self, partition_id: str, keys: list[str], values: dict[str, FieldValues],
               nested: list[str], tags: list[dict[str, Any] | None] | None) -> dict[str, Any]:
        try:
            tags_json = json.loads(json.dumps(tags))
        except TypeError as e:
            raise InvalidArgument(f"tags must be JSON values over Flight ({e})") from None
        command = {"op": "kv_put", "partition_id": partition_id, "keys": list(keys), "tags": tags_json,
                   "nested": list(nested)}
        if values and self._shm_ok is not False:
            done, result = self._put_shm(command, values)
            if done:
                return dict(result)
        return dict(self._put(command, values))

    def read(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues]:
        if fields and self._shm_ok is not False:
            got = self._read_shm(partition_id, gidx, fields)
            if got is not None:
                return got
        return self._read_flight(partition_id, gidx, fields)

    def _read_flight(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues]:
        ticket = {"op": "read", "partition_id": partition_id, "gidx": [int(g) for g in gidx], "fields": fields}
        n = len(gidx)
        dense: dict[str, np.ndarray] = {}
        pieces: dict[str, list[FieldValues]] = {f: [] for f in fields}
        try:
            stream = self._client.do_get(flight.Ticket(json.dumps(ticket).encode()), self._options)
            meta = stream.schema.metadata or {}
            kinds = {f: FieldKind.from_json(k) for f, k in json.loads(meta.get(b"tq.kinds", b"{}")).items()}
            shapes = json.loads(meta.get(b"tq.shapes", b"{}"))
            if set(kinds) != set(fields):
                raise SchemaError(f"read: the server sent fields {sorted(kinds)} for {sorted(fields)}")
            at = 0
            # each message copied into place (arrays of the pool, their pages mapped) while the next arrives: the
            # message's own memory is never handed out, so it need not be made writable or aligned first
            for chunk in stream:
                batch = chunk.data
                if batch is None or batch.num_rows == 0:
                    continue
                end = at + batch.num_rows
                if end > n:
                    raise SchemaError(f"read: the server sent more than {n} rows")
                for f in fields:
                    v = FieldValues.from_arrow(kinds[f], batch.column(f), None if f not in shapes else
                                               [tuple(s) for s in shapes[f][at:end]])
                    if v.dense is None:
                        pieces[f].append(v)
                        continue
                    if f not in dense:  # a dense field: into an array of the whole reply (reused once dropped)
                        dense[f] = self._pool.empty((n, *v.dense.shape[1:]), v.dense.dtype, tag=f)
                    dense[f][at:end] = v.dense
                at = end
        except flight.FlightError as e:
            self._raise(e)
        if at != n:
            raise SchemaError(f"read: the server sent {at} rows for {n} samples")
        out: dict[str, FieldValues] = {}
        for f in fields:
            if f in dense:
                out[f] = FieldValues(kinds[f], n, dense=dense[f])
            elif pieces[f]:  # ragged: the values of every message into an array of the pool (its pages mapped)
                out[f] = FieldValues.concat(pieces[f], flat_out=functools.partial(self._pool.at_least, tag=f))
            else:  # no samples
                empty = pa.table({f: pa.array([], type=stream.schema.field(f).type)})
                out[f] = FieldValues.from_arrow(kinds[f], empty.column(f), [] if f in shapes else None)
        return out

    # ------------------------------------------------------------------ checkpoints (Ray actor only)
    def _actor(self, what: str) -> Any:
        if self.actor is None:
            raise InvalidArgument(f"{what} of a system joined over Flight is not offered (the server takes no "
                                  "paths); checkpoint it in the process that serves it, or inside Ray")
        import ray

        return ray

    def save_checkpoint(self, path: str) -> None:
        ray = self._actor("save_checkpoint")
        ray.get(self.actor.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> None:
        ray = self._actor("load_checkpoint")
        ray.get(self.actor.load_checkpoint.remote(path))

    def close_client(self) -> None:
        while self._groups:
            self._groups.popitem()[1].close()
        self._client.close()
