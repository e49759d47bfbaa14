"""Checkpoints of a TransferQueue-compatible system (`state.TQState`) in arrowbuf's format.

A checkpoint is a directory:

    state.json        the bookkeeping as JSON (format `FORMAT`): per partition its samples, keys, custom metadata,
                      field schemas, storage forms and value locations, consumption per task, field groups; the
                      global index manager; the system sampler's cached picks
    stores/p<i>/g<j>/ one arrowbuf checkpoint per field-group store (Arrow IPC files that pyarrow, DuckDB and
                      Polars read without arrowbuf; docs/format.md)

`state.json` is written last (temp file, fsync, rename): a directory without it is no checkpoint. Custom metadata
and the sampler's state must be JSON values; nothing is pickled. `api.save_checkpoint` puts this directory under
`<dir>/arrowbuf/` beside TransferQueue's `metadata.json` and replaces `<dir>` atomically.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from ...errors import SchemaError
from ...store.facade import ExperienceStore
from .columns import FieldKind
from .partition import FieldGroup, FieldInfo, FieldState, IndexManager, Partition

FORMAT = "arrowbuf.tq.v1"


def write(path: str, partitions: dict[str, Partition], index: IndexManager, sampler_state: object,
          capacity: int) -> None:
    """Write a system's state (held still by the caller) to directory `path` (created; must not exist)."""
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=False)
    parts = []
    for i, p in enumerate(partitions.values()):
        stores = []
        for j, g in enumerate(p.stores):
            where = root / "stores" / f"p{i}" / f"g{j}"
            g.store.checkpoint(str(where))
            stores.append({**g.to_json(), "dir": str(where.relative_to(root))})
        parts.append({
            "partition_id": p.partition_id, "created_at": p.created_at, "indexes": sorted(p.indexes),
            "field_order": p.field_order, "info": {f: x.to_json() for f, x in p.info.items()},
            "fields": {f: {"kind": s.kind.to_json(), "mode": s.mode if s.mode == "ragged" else list(s.mode),
                           "group": s.group.tolist(), "seq": s.seq.tolist()} for f, s in p.fields.items()},
            "consumed": {t: np.flatnonzero(c).tolist() for t, c in p.consumed.items()},
            "custom_meta": [[g, m] for g, m in p.custom_meta.items()],
            "keys": list(p.keys.items()), "groups": [[list(map(list, k)), g] for k, g in p.groups.items()],
            "stores": stores})
    doc = {"format": FORMAT, "capacity": capacity, "index": index.to_json(),
           "sampler": _jsonable(sampler_state, "the sampler's state"), "partitions": parts}
    try:
        data = json.dumps(doc, allow_nan=True)
    except TypeError as e:
        raise SchemaError(f"checkpoint: custom metadata must be JSON values to be checkpointed ({e}); nothing is "
                          "pickled") from None
    tmp = root / "state.json.tmp"
    with open(tmp, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / "state.json")


def read(path: str, capacity: int) -> tuple[dict[str, Partition], IndexManager, Any]:
    """(partitions with their stores restored, the index manager, the sampler's state) of checkpoint `path`.

    Raises:
        FileNotFoundError: no state.json in `path`. SchemaError: another format.
    """
    root = pathlib.Path(path)
    state_file = root / "state.json"
    if not state_file.exists():
        raise FileNotFoundError(f"state.json not found in {root}")
    doc = json.loads(state_file.read_text())
    if doc.get("format") != FORMAT:
        raise SchemaError(f"{state_file}: format {doc.get('format')!r}, expected {FORMAT}")
    loaded: dict[str, Partition] = {}
    try:
        for obj in doc["partitions"]:
            p = Partition(obj["partition_id"])
            p.created_at = obj["created_at"]
            p.indexes = {int(i) for i in obj["indexes"]}
            p.field_order = {str(f): int(i) for f, i in obj["field_order"].items()}
            p.info = {f: FieldInfo.from_json(x) for f, x in obj["info"].items()}
            for f, s in obj["fields"].items():
                p.fields[f] = FieldState(FieldKind.from_json(s["kind"]),
                                         "ragged" if s["mode"] == "ragged" else tuple(s["mode"]),
                                         np.asarray(s["group"], dtype=np.int64), np.asarray(s["seq"], dtype=np.int64))
            for t, idx in obj["consumed"].items():
                p.consumed_of(t)
                p.mark_consumed(t, [int(i) for i in idx])
            p.custom_meta = {int(g): m for g, m in obj["custom_meta"]}
            p.keys = {str(k): int(g) for k, g in obj["keys"]}
            p.key_of = {g: k for k, g in p.keys.items()}
            p.groups = {tuple(tuple(x) for x in k): int(g) for k, g in obj["groups"]}
            for s in obj["stores"]:
                forms = FieldGroup.forms_of(s)
                store = ExperienceStore.restore(str(root / s["dir"]))
                p.stores.append(FieldGroup(s["name"], forms, capacity, store=store, base=int(s.get("base", 0))))
            loaded[p.partition_id] = p
    except BaseException:
        for p in loaded.values():
            p.close()
        raise
    return loaded, IndexManager.from_json(doc["index"]), _from_json(doc["sampler"])


def _jsonable(obj: object, what: str) -> object:
    """A sampler's state as JSON: dicts as [key, value] pairs (their keys may be ints or tuples), tuples marked."""
    if isinstance(obj, dict):
        return {"__pairs__": [[_jsonable(k, what), _jsonable(v, what)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_jsonable(v, what) for v in obj]}
    if isinstance(obj, list):
        return [_jsonable(v, what) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise SchemaError(f"{what}: a {type(obj).__name__} is not a JSON value; it cannot be checkpointed")


def _from_json(obj: Any) -> Any:
    if isinstance(obj, dict) and "__pairs__" in obj:
        return {_key(_from_json(k)): _from_json(v) for k, v in obj["__pairs__"]}
    if isinstance(obj, dict) and "__tuple__" in obj:
        return tuple(_from_json(v) for v in obj["__tuple__"])
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k
