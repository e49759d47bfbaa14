"""Offline-RL datasets in the same Arrow format: `store.export`, `ab.open_dataset`, `ExperienceStore.from_dataset`.

Usage::

    store.export("data/", format="parquet", partition_by=["episode_id"])   # or format="arrow" (IPC)
    ds = ab.open_dataset("data/")        # an arrowbuf export or checkpoint, Parquet with a matching schema,
                                         # or a Minari dataset stored with Minari's Arrow backend
    ds.schema, ds.num_rows, ds.to_table()
    offline = ab.ExperienceStore.from_dataset("data/", capacity=1_000_000)   # offline / offline-to-online RL

An export holds the live rows with their system columns and the derived columns materialised (`next_obs`: null on
the last row of an episode that is still open), plus a metadata folder `_arrowbuf/`: `dataset.json` (the schema, so
derived fields and episode ends survive a round trip through formats without Arrow metadata) and the lineage of the
rows (`lineage.parquet`). The metadata lies in a folder so that a glob of the data files (`DIR/*.parquet` in DuckDB
or Polars) never reaches it; exports written before (`_arrowbuf.json` beside the rows) open as before. `export`
holds the store's write lock while it copies (writers wait; sampling goes on); `checkpoint` is the non-blocking copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..engine.core import StoreCore
from ..errors import InvalidArgument, SchemaError
from ..observe.meter import ProgressSink
from ..schema import SYSTEM_COLUMNS, ExperienceSchema, load_schema
from . import manifest as mf
from .snapshot import arrow_column, numpy_column

#: The export's metadata folder (schema, lineage): out of reach of `DIR/*.parquet`; dataset readers skip `_` names.
META_DIR = mf.DATASET_META_DIR
#: The schema file inside `META_DIR`, and where exports of earlier versions kept it (still read).
SIDE_FILE = mf.DATASET_SIDE_FILE
#: With a `progress` sink, rows are written and loaded in pieces of about this many bytes, each one reported.
_PROGRESS_BYTES = 32 << 20
OLD_SIDE_FILE = mf.OLD_DATASET_SIDE_FILE
_FEED_ROWS = 65_536


def export(core: StoreCore, rows: Callable[[], pa.Table], path: str | os.PathLike, format: str = "parquet",
           partition_by: Any = None, compression: str | None = None,
           progress: ProgressSink | None = None) -> dict[str, Any]:
    """Write a store's live rows as a dataset (see the module docstring). Returns rows and files written.

    Args:
        core: the store's internals (its write lock is held while the rows are copied).
        rows: returns the live rows as a table (`ExperienceStore.to_table`).
        progress: hears the rows copied ("export: copy") and written ("export: write", in `_FEED_ROWS` batches).
    """
    import pyarrow.dataset as pads

    if format not in ("parquet", "arrow"):
        raise InvalidArgument(f"format must be 'parquet' or 'arrow', got {format!r}")
    core.check_open()
    if progress is not None:
        progress("export: copy", 0, None, "row")
    with core.write_lock:  # no row is overwritten or committed while it is copied
        table = _with_derived(rows(), core)
        table = table.combine_chunks()
    if progress is not None:
        progress("export: copy", table.num_rows, None, "row")
    cols = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
    unknown = [c for c in cols if c not in table.column_names]
    if unknown:
        raise InvalidArgument(f"partition_by names unknown columns {unknown}; expected some of {table.column_names}")
    root = os.fspath(path)
    os.makedirs(root, exist_ok=True)
    fmt: Any
    if format == "parquet":
        fmt = pads.ParquetFileFormat()
        opts = fmt.make_write_options(compression=compression or "zstd")
        ext = "parquet"
    else:
        fmt = pads.IpcFileFormat()
        opts = fmt.make_write_options(compression=compression)
        ext = "arrow"
    def counted() -> Iterator[pa.RecordBatch]:  # the rows as they are written, for `progress`
        done = 0
        for batch in table.to_batches(max_chunksize=_progress_rows(table)):
            yield batch
            done += batch.num_rows
            if progress is not None:
                progress("export: write", done, table.num_rows, "row")

    if progress is not None:
        progress("export: write", 0, table.num_rows, "row")
    source: Any = table if progress is None else pa.RecordBatchReader.from_batches(table.schema, counted())
    pads.write_dataset(source, root, format=fmt, file_options=opts, partitioning=cols or None,
                       partitioning_flavor="hive" if cols else None, existing_data_behavior="overwrite_or_ignore",
                       basename_template=f"part-{{i}}.{ext}")
    os.makedirs(os.path.join(root, META_DIR), exist_ok=True)
    mf.write_json_atomic(os.path.join(root, SIDE_FILE), {"format": "arrowbuf-dataset", "version": 1,
                                                         "schema": core.schema.to_dict(), "rows": table.num_rows})
    return {"path": root, "rows": table.num_rows, "format": format}


def lineage_path(root: str | os.PathLike, format: str = "parquet") -> str:
    """Where an export into `root` puts the lineage of its rows (inside the metadata folder)."""
    return os.path.join(os.fspath(root), META_DIR, "lineage.parquet" if format == "parquet" else "lineage.arrow")


def _progress_rows(data: pa.Table | pa.RecordBatch) -> int:
    """Rows per piece of `data` for progress reports: about `_PROGRESS_BYTES`, at most `_FEED_ROWS`."""
    per_row = max(1, data.nbytes // max(1, data.num_rows))
    return int(max(1, min(_FEED_ROWS, _PROGRESS_BYTES // per_row)))


def _with_derived(table: pa.Table, core: StoreCore) -> pa.Table:
    """`table` plus each derived column (`next_obs`), gathered through the index; null where still pending."""
    if not core.schema.derived or table.num_rows == 0:
        return table
    seqs = table["seq"].to_numpy()
    nxt = core.index.next_pos[seqs % core.arena_rows]
    known = nxt >= 0
    for d in core.schema.derived.values():
        rows = np.asarray(core.cols.take_next(d.next_of, np.where(known, nxt, 0)))
        col = arrow_column(rows, core.schema.to_arrow().field(d.next_of).type)
        col = _masked(col, ~known)
        table = table.append_column(pa.field(d.name, col.type, nullable=True), col)
    return table


class ExperienceDataset:
    """A dataset on disk in one of the formats `open_dataset` reads.

    Attributes:
        path: the directory.
        kind: "checkpoint", "arrow", "parquet" or "minari".
        schema: the `ExperienceSchema` of its rows.
    """

    def __init__(self, path: str, kind: str, schema: ExperienceSchema, files: list[str],
                 file_format: str) -> None:
        self.path, self.kind, self.schema = path, kind, schema
        self._files, self._format = files, file_format

    def __repr__(self) -> str:
        return f"ExperienceDataset({self.path!r}, kind={self.kind!r}, schema={self.schema.name!r})"

    @property
    def dataset(self) -> Any:
        """The rows as a `pyarrow.dataset.Dataset` (Minari: one fragment per episode, raw Minari columns)."""
        import pyarrow.dataset as pads

        return pads.dataset(self._files, format=self._format)

    @property
    def num_rows(self) -> int:
        if self.kind in ("parquet", "arrow"):  # from the files' metadata, without reading the rows
            return int(self.dataset.count_rows())
        return sum(b.num_rows for b in self.batches())

    def to_table(self) -> pa.Table:
        """Every row as one table in arrowbuf's layout (fields, derived fields where known, system columns)."""
        batches = list(self.batches())
        if not batches:
            return pa.table({})
        return pa.Table.from_batches(batches)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The rows in insert (seq) or episode order, a file at a time."""
        if self.kind == "minari":
            yield from _minari_batches(self)
            return
        if self.kind == "checkpoint":
            yield from _checkpoint_table(self).to_batches(max_chunksize=_FEED_ROWS)
            return
        import pyarrow.dataset as pads

        ds = pads.dataset(self._files, format=self._format)
        table = ds.to_table()
        if "seq" in table.column_names:
            table = table.sort_by("seq")
        yield from table.to_batches(max_chunksize=_FEED_ROWS)

    def to_store(self, capacity: int | None = None, *, store_cls: Any, progress: ProgressSink | None = None,
                 **kwargs: Any) -> Any:
        """A new store of class `store_cls` (`ab.ExperienceStore`) holding these rows (the newest `capacity` when
        there are more); `ab.ExperienceStore.from_dataset(path)` is the usual way in. `progress` hears the rows
        loaded (phase "load dataset")."""
        total = self.num_rows if capacity is None or progress is not None else None
        store = store_cls(self.schema, int(capacity or max(1, total or 0)), **kwargs)
        done = 0
        try:
            if progress is not None:
                progress("load dataset", 0, total, "row")
            for batch in self.batches():
                if progress is None:
                    _feed(store, batch, self.schema)
                    continue
                step = _progress_rows(batch)  # consecutive extends of a batch's rows store what one does
                for k in range(0, batch.num_rows, step):
                    part = batch.slice(k, step)
                    _feed(store, part, self.schema)
                    done += part.num_rows
                    progress("load dataset", done, total, "row")
        except BaseException:
            store.close()
            raise
        return store


def _checkpoint_table(ds: ExperienceDataset) -> pa.Table:
    """A checkpoint's rows with the derived columns rebuilt from its index and final-observation state."""
    from .restore import _state

    m = mf.read_manifest(ds.path)
    table = pa.Table.from_batches(
        [b for e in m["files"] if e.get("kind") in ("chunk", "partial", "tail")
         for b in pa.ipc.open_file(pa.py_buffer(mf.read_verified(ds.path, e))).read_all().to_batches()],
        schema=ds.schema.to_arrow())
    if not ds.schema.derived or table.num_rows == 0:
        return table
    arena = int(m["store"]["arena_rows"])
    lo = int(m["rows"]["first_seq"])
    index, _ = _state(ds.path, m, "index")
    final, _ = _state(ds.path, m, "final")
    nxt = index["next_pos"].astype(np.int64)
    ring = (nxt >= 0) & (nxt < arena)
    fin = nxt >= arena
    row_of = np.where(ring, (nxt - lo % arena) % arena, 0)  # the successor's row in this checkpoint
    slot_row = {int(s): i for i, s in enumerate(final.get("slot", []))}
    known = ring | fin
    for d in ds.schema.derived.values():
        src = numpy_column(table[d.next_of])
        out = src[np.minimum(row_of, len(src) - 1)].copy()
        if fin.any():
            rows = np.array([slot_row.get(int(s), -1) for s in nxt[fin] - arena])
            ok = rows >= 0
            out[np.flatnonzero(fin)[ok]] = final[d.next_of][rows[ok]]
            known[np.flatnonzero(fin)[~ok]] = False
        col = arrow_column(out, table.schema.field(d.next_of).type)
        table = table.append_column(pa.field(d.name, col.type), _masked(col, ~known))
    return table


def _masked(col: pa.Array, null: np.ndarray) -> pa.Array:
    """`col` with the rows where `null` is True set to null."""
    if not null.any():
        return col
    storage = col.storage if isinstance(col, pa.ExtensionArray) else col
    if pa.types.is_fixed_size_list(storage.type):
        storage = pa.FixedSizeListArray.from_arrays(storage.values, type=storage.type, mask=pa.array(null))
    else:
        storage = pa.array(storage.to_numpy(zero_copy_only=False), type=storage.type, mask=null)
    return pa.ExtensionArray.from_storage(col.type, storage) if isinstance(col, pa.ExtensionArray) else storage


def _feed(store: Any, batch: pa.RecordBatch, schema: ExperienceSchema) -> None:
    cols: dict[str, Any] = {}
    for name, spec in schema.fields.items():
        if name not in batch.schema.names:
            raise SchemaError(f"dataset rows have no field {name!r}; expected {list(schema.fields)}")
        col = batch.column(name)
        if spec.ragged or spec.later:  # as stored (a later field's nulls: rows without a value); validated by extend
            cols[name] = col
            continue
        if col.null_count:
            raise SchemaError(f"dataset column {name!r} has {col.null_count} null rows; a stored field has a value "
                              "in every row")
        cols[name] = numpy_column(col)
    for name in schema.derived:  # read on the steps that end an episode only; null on the others
        if name in batch.schema.names:
            col = batch.column(name)
            cols[name] = _dense_rows(col) if col.null_count else numpy_column(col)
    if "episode_id" in batch.schema.names:
        cols["episode_id"] = batch.column("episode_id").to_numpy()
    store.extend(cols)


def _dense_rows(col: pa.Array) -> np.ndarray:
    """A nullable tensor column as numpy (null rows hold whatever their slots hold)."""
    storage = col.storage if isinstance(col, pa.ExtensionArray) else col
    shape = tuple(col.type.shape) if isinstance(col.type, pa.FixedShapeTensorType) else (storage.type.list_size,)
    size = int(np.prod(shape))
    values = storage.values.slice(storage.offset * size, len(storage) * size)
    if values.null_count:  # Parquet writes a null row's values as nulls too: numpy would turn them into float NaN
        values = values.fill_null(0)
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(len(col), *shape)


def open_dataset(path: str | os.PathLike) -> ExperienceDataset:
    """Open a dataset directory: an arrowbuf checkpoint or export, Parquet with arrowbuf's schema metadata (or a
    `_arrowbuf.json`), or a Minari dataset stored with Minari's Arrow backend (`data_format="arrow"`).

    Raises:
        InvalidArgument: nothing arrowbuf can read is there (the message says what was looked for).
        SchemaError: the files' columns do not form an experience schema (names the fields).
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise InvalidArgument(f"{root} is not a directory; open_dataset takes a dataset directory")
    if os.path.exists(os.path.join(root, mf.MANIFEST)):
        m = mf.read_manifest(root)
        files = [mf.locate(root, e["name"]) for e in m["files"] if e.get("kind") in ("chunk", "partial", "tail")]
        return ExperienceDataset(root, "checkpoint", load_schema(m["store"]["schema"]), files, "ipc")
    minari = _minari_root(root)
    if minari is not None:
        return ExperienceDataset(root, "minari", _minari_schema(minari), _minari_files(minari), "ipc")
    files = sorted(_data_files(root))
    if not files:
        raise InvalidArgument(f"{root} holds no arrowbuf checkpoint (_manifest.json), no Minari dataset "
                              "(data/metadata.json with data_format 'arrow') and no .parquet/.arrow files")
    fmt = "parquet" if files[0].endswith(".parquet") else "ipc"
    side = next((p for p in (os.path.join(root, f) for f in (SIDE_FILE, OLD_SIDE_FILE)) if os.path.exists(p)), None)
    if side is not None:
        with open(side) as f:
            schema = load_schema(json.load(f)["schema"])
    else:
        import pyarrow.dataset as pads

        arrow = pads.dataset(files, format=fmt).schema
        derived = {d.split(":")[0] for d in (arrow.metadata or {}).get(b"arrowbuf.derived", b"").decode().split(",")
                   if d}
        schema = load_schema(pa.schema([f for f in arrow if f.name not in derived], metadata=arrow.metadata))
    return ExperienceDataset(root, "parquet" if fmt == "parquet" else "arrow", schema, files, fmt)


def _data_files(root: str) -> Iterator[str]:
    """The data files under `root`: neither the files nor the folders on the way may start with `_` or `.` (the
    metadata folder, hidden files), as pyarrow's dataset discovery skips them."""
    for d, dirs, fs in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(("_", "."))]
        for f in fs:
            if not f.startswith(("_", ".")) and f.endswith((".parquet", ".arrow", ".feather")):
                yield os.path.join(d, f)


def check_schema(ds: ExperienceDataset, expected: Any) -> None:
    """Raise SchemaError naming the fields when `expected` differs from the dataset's schema."""
    from .restore import schema_difference

    want = load_schema(expected)
    strip = lambda s: pa.schema([f for f in s if f.name not in SYSTEM_COLUMNS])  # noqa: E731
    diff = schema_difference(strip(want.to_arrow()), strip(ds.schema.to_arrow()))
    if diff:
        raise SchemaError(f"dataset {ds.path} ({ds.kind}) does not match the schema {want.name!r}: {diff}")


def from_dataset(path: str | os.PathLike, capacity: int | None = None, *, store_cls: Any, schema: Any = None,
                 progress: ProgressSink | None = None, **kwargs: Any) -> Any:
    """A new store of class `store_cls` filled from a dataset (`open_dataset` formats); `schema=` checks the dataset
    against one. `ExperienceStore.from_dataset` calls this with its own class."""
    ds = open_dataset(path)
    if schema is not None:
        check_schema(ds, schema)
    return ds.to_store(capacity, store_cls=store_cls, progress=progress, **kwargs)


# ------------------------------------------------------------------------------------------------ Minari
def _minari_root(root: str) -> str | None:
    """The `data/` directory of a Minari dataset with the Arrow backend (the dataset dir or its data dir)."""
    for d in (os.path.join(root, "data"), root):
        meta = os.path.join(d, "metadata.json")
        if os.path.exists(meta):
            try:
                with open(meta) as f:
                    m = json.load(f)
            except ValueError:
                continue
            if isinstance(m, dict) and "total_episodes" in m:
                if m.get("data_format") != "arrow":
                    raise InvalidArgument(f"{root} is a Minari dataset in the {m.get('data_format')!r} format; "
                                          "arrowbuf reads Minari's Arrow backend (data_format='arrow')")
                return d
    return None


def _minari_files(data: str) -> list[str]:
    eps = sorted((int(n), n) for n in os.listdir(data) if n.isdigit())
    out = []
    for _, n in eps:
        out += sorted(os.path.join(data, n, f) for f in os.listdir(os.path.join(data, n)) if f.endswith(".arrow"))
    return out


def _minari_schema(data: str) -> ExperienceSchema:
    with open(os.path.join(data, "metadata.json")) as f:
        m = json.load(f)
    obs_space = json.loads(m["observation_space"])
    act_space = json.loads(m["action_space"])
    if obs_space.get("type") != "Box":
        raise SchemaError(f"Minari dataset {data}: observation space {obs_space.get('type')} is not supported "
                          "(Box observations only)")
    fields: dict[str, Any] = {"obs": {"dtype": obs_space["dtype"], "shape": obs_space["shape"]}}
    if act_space.get("type") == "Discrete":
        fields["action"] = {"dtype": "int64"}
    elif act_space.get("type") == "Box":
        fields["action"] = {"dtype": act_space["dtype"], "shape": act_space["shape"]}
    else:
        raise SchemaError(f"Minari dataset {data}: action space {act_space.get('type')} is not supported "
                          "(Discrete or Box only)")
    fields.update(reward={"dtype": "float64"}, terminated={"dtype": "bool"}, truncated={"dtype": "bool"})
    name = str(m.get("dataset_id", "minari")).replace("/", "_")
    return load_schema({"name": name, "fields": fields, "derived": {"next_obs": {"next_of": "obs"}}})


def _minari_batches(ds: ExperienceDataset) -> Iterator[pa.RecordBatch]:
    """Minari episode files (observations: steps + 1 rows, the rest padded) as arrowbuf rows."""
    schema = ds.schema
    obs_spec, act_spec = schema.fields["obs"], schema.fields["action"]
    for file in ds._files:
        with pa.memory_map(file) as src:
            t = pa.ipc.open_file(src).read_all()
        missing = [c for c in ("observations", "actions", "rewards", "terminations", "truncations")
                   if c not in t.column_names]
        if missing:
            raise SchemaError(f"Minari episode file {file} has no {missing} columns")
        obs = _dense(t["observations"], obs_spec.dtype, obs_spec.shape)
        n = len(obs) - 1
        act = _dense(t["actions"].slice(0, n), act_spec.dtype, act_spec.shape)
        term = t["terminations"].slice(0, n).to_numpy(zero_copy_only=False).astype(bool)
        trunc = t["truncations"].slice(0, n).to_numpy(zero_copy_only=False).astype(bool)
        if n and not (term[-1] or trunc[-1]):
            trunc[-1] = True  # an episode cut short by the recording ends there
        cols = {"obs": arrow_column(obs[:n], schema.to_arrow().field("obs").type),
                "action": arrow_column(act, schema.to_arrow().field("action").type),
                "reward": pa.array(t["rewards"].slice(0, n).to_numpy(zero_copy_only=False).astype(np.float64)),
                "terminated": pa.array(term), "truncated": pa.array(trunc),
                "next_obs": arrow_column(obs[1:], schema.to_arrow().field("obs").type)}
        yield pa.RecordBatch.from_pydict(cols)


def _dense(col: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_fixed_size_list(col.type):
        return np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=dtype).reshape(len(col), *shape)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=dtype).reshape(len(col), *shape)
