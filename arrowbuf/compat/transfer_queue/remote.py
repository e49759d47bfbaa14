"""The client side of `tq.v1` (`wire`): the calls `TransferQueueClient` makes, over Arrow Flight."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import SchemaError
from .columns import FieldKind
from .samplers import BaseSampler
from .wire import ERROR_RE, ERRORS, VERSION, arrow_type, sampler_spec


class RemoteBackend:
    """The client side: the calls `TransferQueueClient` makes, over Flight."""

    def __init__(self, location: str, token: str | None = None) -> None:
        self.location = location
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = flight.FlightClient(location)
        self._options = flight.FlightCallOptions(headers=self._headers)

    def _raise(self, e: Exception) -> None:
        m = ERROR_RE.search(str(e))
        if m is None:
            raise e
        msg = m.group(2).split("\n")[0].split(". Detail:")[0]
        raise ERRORS[m.group(1)](msg) from None

    def _act(self, op: str, **body: Any) -> Any:
        try:
            out = list(self._client.do_action(flight.Action(f"{VERSION}.{op}", json.dumps(body).encode()),
                                              self._options))
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(out[0].body.to_pybytes())

    def _put(self, command: dict[str, Any], kinds: dict[str, FieldKind], cols: dict[str, Any], n: int) -> Any:
        command["kinds"] = {f: k.to_json() for f, k in kinds.items()}
        schema = pa.schema([pa.field(f, arrow_type(k)) for f, k in kinds.items()])
        table = pa.table({f: cols[f] for f in kinds}, schema=schema) if kinds else pa.table({})
        try:
            writer, reader = self._client.do_put(flight.FlightDescriptor.for_command(json.dumps(command).encode()),
                                                 table.schema, self._options)
            with writer:
                if table.num_columns:
                    writer.write_table(table)
                writer.done_writing()
                buf = reader.read()
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(buf.to_pybytes())

    def put_keys(self, partition_id: str, keys: list[str], kinds: dict[str, FieldKind], cols: dict[str, Any],
                 tags: list[dict[str, Any]] | None) -> tuple[np.ndarray, list[str]]:
        out = self._put({"op": "put_keys", "partition_id": partition_id, "keys": keys, "tags": tags}, kinds, cols,
                        len(keys))
        return np.asarray(out["gidx"], dtype=np.int64), list(out["fields"])

    def put_indexes(self, partition_id: str, gidx: np.ndarray | None, count: int, kinds: dict[str, FieldKind],
                    cols: dict[str, Any], tags: list[dict[str, Any]] | None = None) -> np.ndarray:
        if not kinds and gidx is not None:
            return np.asarray(self._act("put_tags", partition_id=partition_id, gidx=gidx.tolist(), tags=tags))
        out = self._put({"op": "put_indexes", "partition_id": partition_id,
                         "gidx": None if gidx is None else gidx.tolist(), "tags": tags}, kinds, cols, count)
        return np.asarray(out["gidx"], dtype=np.int64)

    def read(self, partition_id: str, gidx: np.ndarray, fields: list[str] | None
             ) -> tuple[dict[str, Any], dict[str, FieldKind]]:
        ticket = {"op": "read", "partition_id": partition_id, "gidx": gidx.tolist(), "fields": fields}
        try:
            table = self._client.do_get(flight.Ticket(json.dumps(ticket).encode()), self._options).read_all()
        except flight.FlightError as e:
            self._raise(e)
        raw = json.loads((table.schema.metadata or {}).get(b"tq.kinds", b"{}"))
        kinds = {f: FieldKind.from_json(k) for f, k in raw.items()}
        return {f: table.column(f) for f in kinds}, kinds

    def key_indexes(self, partition_id: str, keys: list[str]) -> np.ndarray:
        return np.asarray(self._act("key_indexes", partition_id=partition_id, keys=keys), dtype=np.int64)

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int, mode: str,
                 task_name: str | None, sampler: BaseSampler | None, sampling_config: dict[str, Any]) -> np.ndarray:
        cfg = {k: v for k, v in sampling_config.items() if k in ("dp_rank", "batch_index")}
        return np.asarray(self._act("get_meta", partition_id=partition_id, data_fields=data_fields,
                                    batch_size=batch_size, mode=mode, task_name=task_name,
                                    sampler=sampler_spec(sampler), sampling_config=cfg), dtype=np.int64)

    def production_status(self, partition_id: str, data_fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
        idx, st = self._act("production_status", partition_id=partition_id, data_fields=data_fields)
        return np.asarray(idx, dtype=np.int64), np.asarray(st, dtype=np.int8)

    def consumption_status(self, partition_id: str, task_name: str) -> tuple[np.ndarray, np.ndarray]:
        idx, st = self._act("consumption_status", partition_id=partition_id, task_name=task_name)
        return np.asarray(idx, dtype=np.int64), np.asarray(st, dtype=np.int8)

    def reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        return bool(self._act("reset_consumption", partition_id=partition_id, task_name=task_name))

    def clear_keys(self, partition_id: str, keys: list[str]) -> None:
        self._act("clear_keys", partition_id=partition_id, keys=keys)

    def clear_samples(self, partition_id: str, gidx: np.ndarray) -> None:
        self._act("clear_samples", partition_id=partition_id, gidx=gidx.tolist())

    def clear_partition(self, partition_id: str) -> None:
        self._act("clear_partition", partition_id=partition_id)

    def kv_list(self, partition_id: str | None) -> dict[str, dict[str, Any]]:
        return dict(self._act("kv_list", partition_id=partition_id))

    def tags_of(self, partition_id: str, gidx: np.ndarray) -> list[dict[str, Any]]:
        return list(self._act("tags_of", partition_id=partition_id, gidx=np.asarray(gidx).tolist()))

    def field_names(self, partition_id: str) -> list[str]:
        return list(self._act("field_names", partition_id=partition_id))

    def field_kinds(self, partition_id: str) -> dict[str, FieldKind]:
        raw = self._act("field_kinds", partition_id=partition_id)
        if not isinstance(raw, dict):
            raise SchemaError("field_kinds: the server sent no mapping")
        return {str(f): FieldKind.from_json(k) for f, k in raw.items()}

    def keys_of(self, partition_id: str, gidx: np.ndarray) -> list[str | None]:
        return list(self._act("keys_of", partition_id=partition_id, gidx=np.asarray(gidx).tolist()))

    def close_client(self) -> None:
        self._client.close()
