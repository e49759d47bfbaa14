"""What a store shows of itself: consistent tables of its rows, dataframes and SQL over them, its lineage, counters,
memory, placement and chunk directory, and the record of its checkpoints. `ExperienceStore`'s read-only methods
delegate here (their docstrings are the facade's).

`StoreViews` is built by the facade once the store's parts exist, from those parts alone (typed, named below); it
reads them through their own methods and changes nothing.

Usage (what `ExperienceStore` does)::

    views = StoreViews(ViewParts(name, schema, core, reader, writer, consume, episodes, tiers, timings))
    views.to_table(["obs"]); views.stats(); views.placement(explain=True)
    views.checkpoints.started(summary)      # the record `/metrics` and the inspector read
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..engine.consume import ConsumeTracker
from ..engine.core import StoreCore
from ..engine.episodes import EpisodeTracker
from ..engine.reader import RowSnapshot, StoreReader
from ..engine.sizes import ragged_placement, store_sizes
from ..engine.writer import StoreWriter
from ..errors import InvalidArgument, SchemaError
from ..observe.meter import ProgressSink
from ..observe.timings import Timings
from ..placement import placement_table
from ..schema import ExperienceSchema
from ..tiers.base import Tier

if TYPE_CHECKING:
    from ..persist.checkpoint import CheckpointHandle


@dataclass
class CheckpointRecord:
    """The checkpoints a store started (`/metrics` and the inspector read it): how many, the last one's summary,
    the latest background handle."""

    count: int = 0
    last: dict[str, Any] | None = None
    handle: CheckpointHandle | None = None

    def started(self, out: dict[str, Any] | CheckpointHandle) -> None:
        """A checkpoint returned `out`: a summary, or a handle of one running in the background."""
        self.count += 1
        if isinstance(out, dict):
            self.last = {**{k: out.get(k) for k in ("generation", "rows", "bytes_written", "seconds")},
                         "at": time.time()}
        else:
            self.handle = out

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "last": self.last, "handle": self.handle}


@dataclass(frozen=True)
class ViewParts:
    """The parts of one store its views read."""

    name: str
    schema: ExperienceSchema
    core: StoreCore
    reader: StoreReader
    writer: StoreWriter
    consume: ConsumeTracker
    episodes: EpisodeTracker
    tiers: list[Tier]  # the index's tier first, then the data tiers (each once)
    timings: Timings | None
    placement_policy: Any = None
    checkpoints: CheckpointRecord = field(default_factory=CheckpointRecord)


class StoreViews:
    """A store's read-only views (module docstring)."""

    def __init__(self, parts: ViewParts) -> None:
        self.parts = parts
        self.schema = parts.schema
        self.checkpoints = parts.checkpoints

    # ------------------------------------------------------------------ rows
    def to_table(self, columns: Iterable[str] | None = None) -> pa.Table:
        return self.parts.reader.snapshot(columns).table

    def iter_table(self, columns: Iterable[str] | None = None, max_rows: int | None = None
                   ) -> Iterator[pa.RecordBatch]:
        return self.parts.reader.iter_snapshot(columns, max_rows)

    def snapshot(self, columns: Iterable[str] | None = None) -> RowSnapshot:
        return self.parts.reader.snapshot(columns)

    def to_cudf(self, columns: Iterable[str] | None = None, device: bool = False) -> Any:
        fields = self.schema.fields
        scalar = [n for n, f in fields.items() if not f.shape and not f.ragged and f.plain]
        names = list(columns) if columns is not None else [*scalar, "episode_id", "step", "seq"]
        tensors = [n for n in names if n in fields and (fields[n].shape or fields[n].ragged or not fields[n].plain)]
        if tensors:
            raise SchemaError(f"to_cudf() takes scalar and metadata columns; {tensors} are tensor or list columns "
                              "(cuDF has no fixed-shape tensor type): read them with sample(...).to_torch('cuda')")
        if device:
            self.parts.core.check_open()
            ring = self.parts.reader.device
            if ring is None:
                raise InvalidArgument("to_cudf(device=True) views the store's device ring, and this store has none: "
                                      "make it with tiers={'gpu': GpuTier(budget, ring=True), 'host': ...} (a "
                                      "uniform or prioritized sampler), or call to_cudf() for a copy of the rows")
            from ..tiers.gpu import cudf_views

            return cudf_views(ring.views(names))
        from ..tiers.gpu import to_cudf

        return to_cudf(self.to_table(names))

    # ------------------------------------------------------------------ observability (arrowbuf.observe)
    def lineage_table(self) -> pa.Table:
        from ..observe.lineage import live_table

        self.parts.core.check_open()
        return live_table(self.parts.core, self.parts.consume.tasks)

    def observability(self) -> dict[str, Any]:
        from ..observe.progress import observed

        self.parts.core.check_open()
        return observed(self.parts.core, self.parts.timings, self.checkpoints.as_dict())

    # ------------------------------------------------------------------ counters, memory, placement
    def stats(self, capacity: int, journal: dict[str, Any] | None) -> dict[str, Any]:
        """The store's counters; `journal`: its write path's (`Writes.stats`), or None."""
        p = self.parts
        core = p.core
        with core.lock:
            idx = core.index
            directory = core.directory
            out = {
                "name": p.name,
                "schema": self.schema.name,
                "size": len(idx),
                "capacity": capacity,
                "first_seq": idx.lo,
                "next_seq": idx.hi,
                "inserts": idx.counter("inserts"),
                "samples": idx.counter("samples"),
                "chunk_rows": core.chunk_rows,
                "chunks": directory.num_slots,
                "sealed_chunks": directory.sealed_chunks(idx.lo, idx.hi),
                "open_episodes": p.episodes.open_episodes(),
                "final_obs_capacity": core.final_capacity,
                "bytes": {t.name: t.nbytes() for t in p.tiers},
                "final_obs_dropped": idx.counter("final_obs_dropped"),
                "torn_retries": idx.counter("torn_retries"),
                "priority_updates_ignored": idx.counter("priority_updates_ignored"),
                "removed": idx.counter("removed"),
                # steps `append` stored through the general path (this process; `arrowbuf.engine.stepcheck`)
                "append_slow_path": sum(p.writer.slow_counts.values()),
                "append_slow_reasons": dict(p.writer.slow_counts),
                "update_skipped": idx.counter("update_skipped"),
                # pages of the ring prepared ahead of the write head (tiers/prefault.py); None: not prepared
                "prefault": None if core.cols.pages is None else core.cols.pages.describe(),
                **core.sampler.describe(),
                **p.consume.stats(),
                "output_pool": p.reader.outputs.stats(),  # reused gather outputs (arrowbuf.ring.outpool)
            }
            counters = core.cols.placement_counters()
            if counters is not None:
                out["placement"] = counters
            if p.reader.device is not None:  # the device ring's sample path (arrowbuf.engine.device_sample)
                out["device"] = p.reader.device.describe()
            out.update(store_sizes(core, self._placement_table(False), out["bytes"]))
        if journal is not None:
            out["journal"] = journal
        return out

    def placement(self, explain: bool = False) -> pa.Table:
        core = self.parts.core
        core.check_open()
        with core.lock:
            return self._placement_table(explain)

    def _placement_table(self, explain: bool) -> pa.Table:
        """`placement()` under the state lock: the placed columns, then the ragged ones (in their arena's tier)."""
        core = self.parts.core
        table = placement_table(core, self.parts.placement_policy, explain)
        ragged = ragged_placement(core)
        if not ragged:
            return table
        extra = pa.Table.from_pylist([{c: r.get(c) for c in table.column_names} for r in ragged])
        return pa.concat_tables([table, extra], promote_options="permissive")

    def chunks(self) -> pa.Table:
        core = self.parts.core
        with core.lock:
            return core.directory.table(core.index.lo, core.index.hi)

    # ------------------------------------------------------------------ persistence
    def export(self, path: Any, format: str, partition_by: Any, compression: str | None,
               progress: ProgressSink | None = None) -> dict[str, Any]:
        from ..persist import export
        from ..persist.datasets import lineage_path

        core = self.parts.core
        core.check_open()
        out = export(core, self.to_table, path, format=format, partition_by=partition_by, compression=compression,
                     progress=progress)
        if core.lineage is not None:  # in the metadata folder: out of reach of a glob of the data files
            from ..observe.lineage import write_table

            out["lineage"] = write_table(self.lineage_table(), lineage_path(path, format), format)
        return out

