"""The `tq.v1` wire format of `arrowbuf.compat.transfer_queue` over Arrow Flight: one process holds the system
(`tq.serve`, `server`), others join it with `tq.init({"arrowbuf": {"location": server.location}})` (`remote`).

Wire format, version `tq.v1` (everything a remote client sends is bounded and validated before bulk data is read):
- DoAction `tq.v1.<op>` with a JSON object body (at most `MAX_JSON` bytes) for the metadata calls (`get_meta`,
  `production_status`, `consumption_status`, `reset_consumption`, `clear_keys`, `clear_samples`,
  `clear_partition`, `kv_list`, `tags_of`, `key_indexes`, `keys_of`, `field_names`, `put_tags`); the result is one
  JSON object.
- DoPut with a JSON command descriptor `{"op": "put_keys"|"put_indexes", "partition_id", "keys"|"gidx"|"count",
  "kinds": {field: [kind, dtype, shape]}, "tags"}` and a stream of record batches whose columns are the fields
  (the Arrow types `columns` gives them; checked against `kinds` before any value is read into the state). The
  put result is one JSON object sent back as metadata.
- DoGet with a JSON ticket `{"op": "read", "partition_id", "gidx"|"keys", "fields"}`: one table of the fields, with
  the field kinds as JSON under the schema metadata key `tq.kinds`.
Errors cross as `FlightServerError("tq.v1 error <Type>: <message>")` and are raised again on the client as
`KeyError`, `SchemaError`, `InvalidArgument` or `ValueError`. Tags must be JSON values.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument, SchemaError
from .columns import FieldKind
from .samplers import SAMPLERS, BaseSampler

VERSION = "tq.v1"
MAX_JSON = 1 << 20
MAX_IDS = 1 << 22
MAX_PUT_BYTES = 16 << 30
MAX_FIELDS = 4096
ERROR_RE = re.compile(r"tq\.v1 error (KeyError|SchemaError|InvalidArgument|ValueError): (.*)", re.S)
ERRORS: dict[str, type[Exception]] = {"KeyError": KeyError, "SchemaError": SchemaError,
                                       "InvalidArgument": InvalidArgument, "ValueError": ValueError}



def arrow_type(kind: FieldKind) -> pa.DataType:
    """The Arrow type a field of `kind` travels and is stored as."""
    value = pa.from_numpy_dtype(np.dtype(kind.dtype))
    if kind.kind != "dense":
        return pa.list_(value)
    if kind.shape:
        return pa.fixed_shape_tensor(value, list(kind.shape))
    return value


def sampler_spec(sampler: BaseSampler | None) -> Any:
    """A JSON spec of one of the shipped samplers (None for the system's default)."""
    if sampler is None:
        return None
    name = type(sampler).__name__
    if SAMPLERS.get(name) is not type(sampler):
        raise InvalidArgument(f"over Flight, get_meta takes one of the shipped samplers {sorted(SAMPLERS)}, "
                              f"got {name}")
    args = {k: getattr(sampler, k) for k in ("n_samples_per_prompt", "dp_size") if hasattr(sampler, k)}
    return {"name": name, "args": args}

