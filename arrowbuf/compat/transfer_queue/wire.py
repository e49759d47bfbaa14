"""The `tq.v2` wire format of `arrowbuf.compat.transfer_queue` over Arrow Flight: one process holds the system
(`tq.serve`, `server`), others join it with `tq.init({"arrowbuf": {"location": server.location}})` (`remote`).

Wire format, version `tq.v2` (everything a remote client sends is bounded and validated before bulk data is read):
- DoAction `tq.v2.<op>` with a JSON object body (at most `MAX_JSON` bytes) for the calls of `state.TQState` that
  carry no field values (`ACTIONS`: `get_meta`, `kv_retrieve_meta`, `kv_retrieve_keys`, `kv_list`,
  `set_custom_meta`, `production_status`, `consumption_status`, `reset_consumption`, `clear_samples`,
  `clear_partition`, `list_partitions`, `snapshot`, `field_kinds`); the result is one JSON value (`{"result": ...}`).
- DoPut with a JSON command descriptor `{"op": "put", "partition_id", "gidx", "kinds": {field: [kind, dtype]},
  "shapes": {field: per-sample shapes} (ragged tensor fields), "schema": {field: field-schema entry}}` and a stream
  of record batches whose columns are the fields (the Arrow types `columns.FieldValues.to_arrow` gives them;
  checked against `kinds` before any value is read into the state).
- DoGet with a JSON ticket `{"op": "read", "partition_id", "gidx", "fields"}`: one table of the fields, with the
  field kinds and the shapes of ragged tensor fields as JSON under the schema metadata keys `tq.kinds`, `tq.shapes`.
- Shared memory, for clients on the system's node (`remote`, a system whose field groups live in /dev/shm): DoAction
  `shm_plan` (a put's command, with `dense` sample shapes instead of the values, and `max_len`: {text field: bytes of
  its longest sample}, by which the group's arenas are sized) answers the field group's shared
  store (`FieldGroup.describe`) and a plan handle; the client writes the rows into that store itself, then
  `shm_commit` (the handle and the row ids written) registers them or `shm_abort` forgets them. `shm_locate` (a read's
  ticket) answers the groups and, per field, `[group, positions, row ids]`; the client reads them itself. Either
  answers `{"shm": None}` where a group has no shared store (`"off": true` too where the system has no shared memory at
  all): then DoPut / DoGet.
Errors cross as `FlightServerError("tq.v2 error <Type>: <message>")` and are raised again on the client as the
types in `ERRORS`. Custom metadata (tags) and sampling configs must be JSON values.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument, SchemaError
from ...schema import dtypes as _logical
from .columns import FieldKind
from .state import GetMetaTimeout, StorageKeyNotFoundError

VERSION = "tq.v2"
MAX_JSON = 1 << 24
MAX_IDS = 1 << 22
MAX_PUT_BYTES = 16 << 30
MAX_FIELDS = 4096
ACTIONS = ("get_meta", "kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "set_custom_meta", "production_status",
           "consumption_status", "reset_consumption", "clear_samples", "clear_partition", "list_partitions",
           "snapshot", "field_kinds", "shm_plan", "shm_commit", "shm_abort", "shm_locate")
ERRORS: dict[str, type[Exception]] = {
    "KeyError": KeyError, "SchemaError": SchemaError, "InvalidArgument": InvalidArgument, "ValueError": ValueError,
    "TypeError": TypeError, "AssertionError": AssertionError, "RuntimeError": RuntimeError,
    "StorageKeyNotFoundError": StorageKeyNotFoundError, "GetMetaTimeout": GetMetaTimeout}
ERROR_RE = re.compile(r"tq\.v2 error (" + "|".join(ERRORS) + r"): (.*)", re.S)


def arrow_type(kind: FieldKind, ragged: bool, shape: tuple[int, ...] = ()) -> pa.DataType:
    """The Arrow type values of `kind` travel as: dense tensors of one shape as scalars or `fixed_shape_tensor`
    (arrowbuf's extension type for a dtype numpy lacks, and complex), ragged tensors as `list<dtype>` (or
    `large_list`), text and JSON values as `list<uint8>`."""
    if kind.kind != "tensor":
        return pa.list_(pa.uint8())
    if kind.dtype in _logical.NAMES:
        return pa.list_(_logical.arrow_type(kind.dtype, ())) if ragged else _logical.arrow_type(kind.dtype, shape)
    value = pa.from_numpy_dtype(np.dtype(kind.dtype))
    if ragged:
        return pa.list_(value)
    if shape:
        return pa.fixed_shape_tensor(value, list(shape))
    return value


#: Bytes of values per record batch of a put or a read reply: several messages per call, so that the receiver
#: copies one into place while the next is on the wire (a whole reply in one message is all received before any of
#: it is used; measured on one host: a 320 MiB put in 16 messages took 0.23-0.35 s, in one 0.6-0.77 s).
CHUNK_BYTES = 16 << 20


def chunk_rows(table: pa.Table) -> int:
    """Rows per record batch of `table` for about `CHUNK_BYTES` each."""
    if table.num_rows == 0:
        return 1
    return max(1, CHUNK_BYTES // max(1, table.nbytes // table.num_rows))
