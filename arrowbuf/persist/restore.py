"""`ExperienceStore.restore(path)`: a store that behaves as the checkpointed one would have.

The store is rebuilt with the checkpoint's geometry (capacity, chunk rows, final-observation slots), so every row
returns to its ring position under its seq: ids sampled before the checkpoint still name their rows, and with the
recorded RNG state (the default) the restored store draws the same batches the original would have drawn next.
Every file is checked against the manifest (size, CRC-32) before it is used; rows are read one chunk file at a
time (the peak memory is the store plus one chunk).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..engine.core import StoreCore
from ..errors import InvalidArgument, SchemaError, StoreCorrupt
from ..observe.meter import ProgressSink
from ..options import StoreOptions
from ..ring.reservations import HOLE
from ..schema import ExperienceSchema, load_schema
from ..schema.convert import convert_later
from . import manifest as mf
from .checkpoint import known_files
from .snapshot import later_digest, numpy_column, restore_sampler_state


def schema_difference(expected: pa.Schema, got: pa.Schema) -> str:
    """A sentence naming the fields two Arrow schemas disagree on ('' when they agree)."""
    exp = {f.name: f.type for f in expected}
    have = {f.name: f.type for f in got}
    missing = [n for n in exp if n not in have]
    extra = [n for n in have if n not in exp]
    changed = [f"{n} ({have[n]} instead of {exp[n]})" for n in exp if n in have and not have[n].equals(exp[n])]
    parts = []
    if missing:
        parts.append(f"missing {missing}")
    if extra:
        parts.append(f"unexpected {extra}")
    if changed:
        parts.append(f"different types: {', '.join(changed)}")
    return "; ".join(parts)


@dataclass
class RestorePlan:
    """How to rebuild a checkpointed store: build it from `schema` and `options`, then `load` its internals.

    `ExperienceStore.restore` does both; persist never builds a store itself (it sits below the facade).
    """

    schema: ExperienceSchema
    options: StoreOptions
    root: str
    manifest: dict[str, Any]
    restore_rng: bool
    consume: tuple[dict[str, np.ndarray], dict[str, Any]] | None

    def load(self, core: StoreCore, progress: ProgressSink | None = None) -> None:
        """Fill the rebuilt store's internals with the checkpoint (files verified first, chunk by chunk);
        `progress` hears the row files' bytes read.

        Raises:
            StoreCorrupt: a file is missing, truncated or corrupt, or the manifest is inconsistent.
        """
        st = self.manifest["store"]
        if core.arena_rows != st["arena_rows"]:
            raise StoreCorrupt(f"{self.manifest['_path']}: arena_rows {st['arena_rows']} but the rebuilt store has "
                               f"{core.arena_rows}; the manifest is inconsistent")
        load_into(core, self.root, self.manifest, restore_rng=self.restore_rng, consume=self.consume,
                  progress=progress)


def plan_restore(path: str | os.PathLike, *, tier: Any = "host", tiers: dict[str, Any] | None = None,
                 seed: int | None = None, name: str | None = None, schema: Any = None,
                 generation: int | None = None) -> RestorePlan:
    """Read and check the manifest of the checkpoint at `path` (see `ExperienceStore.restore`); `generation` picks a
    kept checkpoint other than the latest.

    Raises:
        StoreCorrupt: the manifest is missing, malformed or names what this arrowbuf cannot rebuild.
        SchemaError: `schema` differs from the checkpoint's (the message names the fields).
    """
    root = os.fspath(path)
    m = mf.read_manifest(root, None if generation is None else f"{int(generation):08d}.json")
    where = m["_path"]
    st = m["store"]
    saved = load_schema(st["schema"])
    if schema is not None:
        want = load_schema(schema)
        diff = schema_difference(want.to_arrow(), saved.to_arrow())
        if diff:
            raise SchemaError(f"checkpoint {root} holds schema {saved.name!r} whose fields differ from the schema "
                              f"asked for ({want.name!r}): {diff}; restore without schema= or convert the data")
    _check_geometry(where, st)
    more: dict[str, Any] = {"seed": seed, "tier": "host" if tiers is not None else tier, "tiers": tiers}
    consume = _consume_state(root, m)
    if consume is not None:  # the tracker's store-level options: tasks come back declared, admission control on
        meta = consume[1]
        for key in ("tasks", "max_staleness", "token_field"):
            if meta.get(key):
                more[key] = meta[key]
    options = StoreOptions.from_dict(st, where, **more)
    if name:
        options = options.replace(name=name)
    return RestorePlan(saved, options, root, m, seed is None, consume)


def _check_geometry(where: str, st: dict[str, Any]) -> None:
    """The manifest's capacity, chunk rows and arena rows agree (checked before the store is allocated: a manifest
    that claims a huge capacity is refused, not allocated)."""
    cap, cr, arena = st.get("capacity"), st.get("chunk_rows"), st.get("arena_rows")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (cap, cr, arena)):
        raise StoreCorrupt(f"{where}: capacity {cap!r}, chunk_rows {cr!r} and arena_rows {arena!r} must be positive "
                           "integers")
    assert isinstance(cap, int) and isinstance(cr, int)
    if arena != (-(-cap // cr) + 1) * cr:
        raise StoreCorrupt(f"{where}: capacity {cap} with chunk_rows {cr} makes {(-(-cap // cr) + 1) * cr} arena "
                           f"rows, but the manifest says arena_rows {arena}; the manifest is inconsistent")


def _state(root: str, m: dict[str, Any], mech: str) -> Any:
    entry = next((e for e in m["files"] if e.get("kind") == f"state:{mech}"), None)
    if entry is None:
        raise StoreCorrupt(f"{m['_path']}: no {mech} state file listed")
    data = mf.read_verified(root, entry)
    if entry["name"].endswith(".json"):
        return json.loads(data)
    table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    meta = json.loads((table.schema.metadata or {}).get(b"arrowbuf", b"{}"))
    return {n: numpy_column(table.column(n)) for n in table.column_names}, meta


def _consume_state(root: str, m: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The consume state file (tasks, consumption per task, policy version), checked; None in a checkpoint made
    before it existed (a store restored from one starts with no tasks and policy version 0)."""
    if not any(e.get("kind") == "state:consume" for e in m["files"]):
        return None
    arrays, meta = _state(root, m, "consume")
    tasks = meta.get("tasks")
    ok = isinstance(tasks, list) and all(isinstance(t, str) and t in arrays for t in tasks) and \
        isinstance(meta.get("policy_version", 0), int) and isinstance(meta.get("counters", {}), dict) and \
        isinstance(meta.get("delivered", {}), dict) and isinstance(adm := meta.get("admission", {}), dict) and \
        all(isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) for v in adm.values()) and \
        (meta.get("max_staleness") is None or isinstance(meta["max_staleness"], int)) and \
        (meta.get("token_field") is None or isinstance(meta["token_field"], str))
    if not ok:
        raise StoreCorrupt(f"{m['_path']}: malformed consume state (tasks {str(tasks)[:200]}, columns "
                           f"{list(arrays)[:20]})")
    return arrays, meta


def _read_ahead(pool: ThreadPoolExecutor, root: str, entries: list[dict[str, Any]],
                depth: int = 3) -> Iterator[tuple[dict[str, Any], bytes]]:
    """Verified bytes of `entries` in order, read and checksummed `depth` files ahead in `pool` (file reads and
    zlib release the GIL): reading the disk overlaps copying rows into the arenas; at most `depth` files are held."""
    futures: deque = deque()
    for e in entries:
        futures.append((e, pool.submit(mf.read_verified, root, e)))
        if len(futures) > depth:
            first, fut = futures.popleft()
            yield first, fut.result()
    while futures:
        first, fut = futures.popleft()
        yield first, fut.result()


def load_into(core: StoreCore, root: str, m: dict[str, Any], restore_rng: bool = True,
              consume: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
              progress: ProgressSink | None = None) -> None:
    """Fill a fresh store's parts with checkpoint `m` of directory `root` (files verified first, chunk by chunk);
    `consume` is the checkpoint's consume state (`_consume_state`), for a store built with its tasks; `progress`
    hears the bytes of the row files read (phase "restore")."""
    where = m["_path"]
    rows = m["rows"]
    lo, hi = int(rows["first_seq"]), int(rows["next_seq"])
    arena_rows = core.arena_rows
    schema = core.schema.to_arrow()
    index, _ = _state(root, m, "index")
    sampler_arrays, sampler_meta = _state(root, m, "sampler")
    final, _ = _state(root, m, "final")
    episodes = _state(root, m, "episodes")
    rng = _state(root, m, "rng")
    header = _state(root, m, "header")
    if len(index["next_pos"]) != hi - lo:
        raise StoreCorrupt(f"{where}: the index state has {len(index['next_pos'])} rows for the range [{lo}, {hi})")
    idx = core.index
    cols = core.cols
    known = known_files(core, root)
    row_files = [e for e in m["files"] if e.get("kind") in ("chunk", "partial", "tail")]
    total_bytes = sum(int(e["bytes"]) for e in row_files)
    done_bytes = 0
    if progress is not None:
        progress("restore", 0, total_bytes, "B")
    with core.write_lock, core.lock, ThreadPoolExecutor(1, thread_name_prefix="arrowbuf-restore") as pool:
        expect = lo
        for e, data in _read_ahead(pool, root, row_files):
            try:
                table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
            except pa.ArrowInvalid as exc:
                raise StoreCorrupt(f"checkpoint {root}: file {e['name']} is not an Arrow IPC file: {exc}") from None
            diff = schema_difference(schema, table.schema)
            if diff:
                raise SchemaError(f"checkpoint {root}: file {e['name']} does not match the checkpoint's schema: "
                                  f"{diff}")
            n = table.num_rows
            seqs = numpy_column(table.column("seq")).astype(np.int64)
            if n == 0 or seqs[0] != expect or not (np.diff(seqs) == 1).all():
                raise StoreCorrupt(f"checkpoint {root}: file {e['name']} holds seqs from "
                                   f"{seqs[0] if n else None}, expected a contiguous run from {expect}")
            p0 = int(seqs[0] % arena_rows)
            pos = seqs % arena_rows
            later = {}
            for f in core.schema.fields.values():
                if f.ragged:
                    column = table.column(f.name).combine_chunks()
                    cols.write_ragged(f.name, column, p0)
                elif f.later:  # nulls are the rows still without a value: written as absent, not as zeros
                    column = table.column(f.name).combine_chunks()
                    cols.write(f.name, p0, convert_later(f, column))
                else:
                    cols.write(f.name, p0, numpy_column(table.column(f.name)))
                if f.later:
                    later[f.name] = column
            idx.seq[pos] = seqs
            idx.episode_id[pos] = numpy_column(table.column("episode_id"))
            idx.step[pos] = numpy_column(table.column("step"))
            if e.get("kind") == "chunk":
                known[(int(seqs[0]), n)] = {**{k: e[k] for k in ("name", "bytes", "crc32")},
                                            "later": later_digest(later)}
            expect += n
            done_bytes += int(e["bytes"])
            if progress is not None:
                progress("restore", done_bytes, total_bytes, "B")
        if expect != hi:
            raise StoreCorrupt(f"{where}: row files cover seqs [{lo}, {expect}), the manifest says [{lo}, {hi})")
        pos = np.arange(lo, hi, dtype=np.int64) % arena_rows
        idx.next_pos[pos] = index["next_pos"]
        idx.valid[pos] = index["valid"]
        if "times_sampled" in index and len(core.times_sampled):
            core.times_sampled[pos] = index["times_sampled"]
        from ..ring.index import HEADER

        for key, i in HEADER.items():
            if key in header:
                idx.header[i] = int(header[key])
        # no reservation is open in a restored store; holes (a dead writer's seqs, tiers/reservations.py) stay holes
        idx.header[HEADER["reserve_head"]] = hi
        idx.header[HEADER["commit_waiters"]] = 0
        hole = np.asarray(index["hole"], dtype=bool) if "hole" in index else np.zeros(len(pos), dtype=bool)
        idx.seq[pos[hole]] = HOLE
        idx.header[HEADER["holes"]] = int(hole.sum())
        slots = final["slot"].astype(np.int64) if "slot" in final else np.zeros(0, np.int64)
        if len(slots):
            core.final_owner[slots] = final["owner"]
            for src in core.cols.final_sources:
                cols.write_final(src, slots, final[src])
        restore_sampler_state(core.sampler, pos, sampler_meta["meta"], sampler_arrays,
                              int(sampler_meta.get("dropped_valid", 0)))
        try:
            core.episodes.load_state(episodes)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreCorrupt(f"{where}: malformed episode state ({str(exc)[:200]})") from None
        if consume is not None and core.consume is not None:
            try:
                core.consume.load_state(np.arange(lo, hi, dtype=np.int64), consume[1], consume[0])
            except InvalidArgument as exc:
                raise StoreCorrupt(f"{where}: consume state does not fit the checkpoint's rows: {exc}") from None
        if core.lineage is not None and any(e.get("kind") == "state:lineage" for e in m["files"]):
            lineage_arrays, lineage_meta = _state(root, m, "lineage")
            try:
                core.lineage.load_state(np.arange(lo, hi, dtype=np.int64), lineage_meta, lineage_arrays)
            except (KeyError, TypeError, ValueError) as exc:
                raise StoreCorrupt(f"{where}: malformed lineage state ({str(exc)[:200]})") from None
        if restore_rng:
            core.rng.bit_generator.state = rng
