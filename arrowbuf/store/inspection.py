"""The inspection half of `ExperienceStore`'s surface: snapshots (to_table, iter_table, snapshot), dataframes and SQL,
stats, placement, chunks, and the observability wiring (lineage_table, observability, serve_metrics).

`StoreInspection` is a mixin of `arrowbuf.store.facade.ExperienceStore`, split out of the facade for size (one
concept per module): not used on its own. Its methods read the store's own parts, which the facade builds; the
annotations below name what they read, nothing more. Every method and docstring is the facade's, unchanged:
`help(ab.ExperienceStore)` lists them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..engine.consume import ConsumeTracker
from ..engine.core import StoreCore
from ..engine.episodes import EpisodeTracker
from ..engine.reader import RowSnapshot, StoreReader
from ..engine.sizes import ragged_placement, store_sizes
from ..engine.writer import StoreWriter
from ..errors import SchemaError
from ..observe.timings import Timings
from ..placement import placement_table
from ..ring.chunks import ChunkDirectory
from ..ring.columns import ColumnArenas
from ..ring.index import RingIndex
from ..samplers import Sampler
from ..schema import ExperienceSchema
from ..tiers.base import Tier
from .writes import Writes

if TYPE_CHECKING:
    class _Parts:
        """What these methods read of the facade (set by `ExperienceStore.__init__`): for the type checker only."""

        name: str
        schema: ExperienceSchema
        capacity: int
        chunk_rows: int
        final_capacity: int
        directory: ChunkDirectory
        index: RingIndex
        sampler: Sampler
        placement_policy: Any
        timings: Timings | None
        _core: StoreCore | None
        _reader: StoreReader
        _writer: StoreWriter
        _consume: ConsumeTracker
        _cols: ColumnArenas
        _episodes: EpisodeTracker
        _tier: Tier
        _data_tiers: list[Tier]
        _lock: Any
        @property
        def _w(self) -> Writes: ...
        _checkpoints: dict[str, Any]

        def _check_open(self) -> None: ...
else:
    _Parts = object


class StoreInspection(_Parts):
    """`ExperienceStore`'s read-only views of its rows, counters, memory and lineage (a mixin of the facade)."""

    # ------------------------------------------------------------------ inspection
    def to_table(self, columns: Iterable[str] | None = None) -> pa.Table:
        """The live rows, oldest first, as a `pa.Table` of the stored columns: a consistent snapshot.

        Each row is exactly as committed (no row half-replaced, no part of a batch), the rows are one contiguous
        seq range ending at the newest row committed at the call, and the table is a copy: writers go on without
        changing it. If writers replace rows faster than they are copied, the table starts at the oldest row still
        intact (see `arrowbuf.engine.reader`).
        """
        return self._reader.snapshot(columns).table

    def iter_table(self, columns: Iterable[str] | None = None, *, max_rows: int | None = None
                   ) -> Iterator[pa.RecordBatch]:
        """The live rows as a stream of consistent, copied record batches, about one chunk in memory at a time.

        The rows are those committed at the call (nothing newer), oldest first, each exactly as committed (no torn
        or half-replaced row, even while writers run). Rows that writers evict before the stream reaches them are
        skipped (a gap in `seq`), never yielded torn. See `StoreReader.iter_snapshot`.

        Args:
            columns: stored columns (default: all of them).
            max_rows: at most this many rows per batch (default: one chunk's rows).

        Raises:
            SchemaError: an unknown column (at the call). InvalidArgument: a bad `max_rows`.
        """
        return self._reader.iter_snapshot(columns, max_rows)

    def snapshot(self, columns: Iterable[str] | None = None) -> RowSnapshot:
        """`to_table` with the seq range it covers: a `RowSnapshot` (lo, hi, live_lo, table). See
        `arrowbuf.engine.reader`."""
        return self._reader.snapshot(columns)

    def to_pandas(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a pandas DataFrame (tensor columns as arrays per row). Needs `arrowbuf[query]`."""
        from ..query.frames import table_to_pandas

        return table_to_pandas(self.to_table(columns))

    def to_polars(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a Polars DataFrame (tensors as Array columns). Needs `arrowbuf[query]`."""
        from ..query.frames import table_to_polars

        return table_to_polars(self.to_table(columns))

    def sql(self, query: str) -> pa.Table:
        """Run DuckDB SQL over the live rows; the store is the table `experience`, its lineage the table `lineage`
        (docs/observability.md). Needs `arrowbuf[query]`."""
        from ..query.frames import run_sql

        return run_sql(self, query)

    # ------------------------------------------------------------------ observability (arrowbuf.observe)
    def lineage_table(self) -> pa.Table:
        """The lineage of the live rows (the SQL table `lineage`): seq, writer, written_at, policy_version, task,
        consumed_at, consumer, staleness, outcome; one row per (live row, declared task). See
        `arrowbuf.observe.lineage`.

        Raises:
            InvalidArgument: the store records no lineage (`observe=False`, or a shared-memory store).
        """
        from ..observe.lineage import live_table

        self._check_open()
        return live_table(self._core, self._consume.tasks)

    def observability(self) -> dict[str, Any]:
        """What `/metrics` and the inspector read besides `stats()`: `timings` (latency histograms per operation),
        `lineage` (per task: delivered, dropped as stale, staleness counts), `lineage_bytes`, `progress` (per task
        ready / waiting / consumed / in flight: `arrowbuf.observe.progress`) and `checkpoints`."""
        from ..observe.progress import observed

        self._check_open()
        return observed(self._core, self.timings, self._checkpoints)

    def serve_metrics(self, address: str = "127.0.0.1:0") -> Any:
        """Serve this store's Prometheus metrics at `http://address/metrics` (a thread; needs `arrowbuf[metrics]`).
        Returns a `MetricsEndpoint` (`.url`, `.close()`, a context manager). See docs/observability.md."""
        from ..observe.metrics import MetricsEndpoint

        return MetricsEndpoint.start(address, stores={self.name: self})

    def episodes(self) -> pa.Table:
        """One row per episode with live rows: episode_id, length, return, first_seq, last_seq, complete."""
        from ..query.frames import episode_table

        return episode_table(self)

    def stats(self) -> dict[str, Any]:
        """Size, counters and memory of the store.

        Memory in two labelled numbers (`arrowbuf.engine.sizes`, the one definition `arrowbuf inspect`, the inspector
        and `/metrics` show too): `rows_bytes`, what the live rows' values take, and `reserved_bytes`, what the
        store's tiers hold for it (the ring of `capacity` rows and the rest; `bytes` splits it per tier);
        `columns` gives both per column.
        """
        with self._lock:
            idx = self.index
            out = {
                "name": self.name,
                "schema": self.schema.name,
                "size": len(idx),
                "capacity": self.capacity,
                "first_seq": idx.lo,
                "next_seq": idx.hi,
                "inserts": idx.counter("inserts"),
                "samples": idx.counter("samples"),
                "chunk_rows": self.chunk_rows,
                "chunks": self.directory.num_slots,
                "sealed_chunks": self.directory.sealed_chunks(idx.lo, idx.hi),
                "open_episodes": self._episodes.open_episodes(),
                "final_obs_capacity": self.final_capacity,
                "bytes": {t.name: t.nbytes() for t in {id(t): t for t in [self._tier, *self._data_tiers]}.values()},
                "final_obs_dropped": idx.counter("final_obs_dropped"),
                "torn_retries": idx.counter("torn_retries"),
                "priority_updates_ignored": idx.counter("priority_updates_ignored"),
                "removed": idx.counter("removed"),
                # steps `append` stored through the general path (this process; `arrowbuf.engine.stepcheck`), by reason
                "append_slow_path": sum(self._writer.slow_counts.values()),
                "append_slow_reasons": dict(self._writer.slow_counts),
                "update_skipped": idx.counter("update_skipped"),
                # pages of the ring prepared ahead of the write head (tiers/prefault.py); None: not prepared
                "prefault": None if self._cols.pages is None else self._cols.pages.describe(),
                **self.sampler.describe(),
                **self._consume.stats(),
                "output_pool": self._reader.outputs.stats(),  # reused gather outputs (arrowbuf.ring.outpool)
            }
            counters = self._cols.placement_counters()
            if counters is not None:
                out["placement"] = counters
            assert self._core is not None
            out.update(store_sizes(self._core, self._placement_table(False), out["bytes"]))
        journal = self._w.stats()
        if journal is not None:
            out["journal"] = journal
        return out

    def placement(self, explain: bool = False) -> pa.Table:
        """Where the columns live: one row per (column, tier) with the chunk slots and bytes there. A ragged
        column has one row: the tier of its arena, every chunk slot, the bytes the arena holds (placement does not
        move it).

        With `explain=True`, also why (from the placement policy's last step): the column's share of sampled rows
        (`access_share`, `rows_per_s`), the share of the sampling mass in those chunks (`mass`), their value per
        byte, the tier's read bandwidth (`read_gbps`) and a sentence (`why`). See `arrowbuf.placement`.
        """
        self._check_open()
        with self._lock:
            return self._placement_table(explain)

    def _placement_table(self, explain: bool) -> pa.Table:
        """`placement()` under the state lock: the placed columns, then the ragged ones (in their arena's tier)."""
        assert self._core is not None
        table = placement_table(self._core, self.placement_policy, explain)
        ragged = ragged_placement(self._core)
        if not ragged:
            return table
        extra = pa.Table.from_pylist([{c: r.get(c) for c in table.column_names} for r in ragged])
        return pa.concat_tables([table, extra], promote_options="permissive")

    def to_cudf(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows' scalar and metadata columns as a cuDF DataFrame (on the GPU). cuDF has no fixed-shape
        tensor type: sample tensor columns with `sample(...).to_torch("cuda")` (or a GPU tier). Needs
        `pip install 'arrowbuf[gpu]'` and a GPU."""
        from ..tiers.gpu import to_cudf

        scalar = [n for n, f in self.schema.fields.items() if not f.shape and not f.ragged and f.plain]
        names = list(columns) if columns is not None else [*scalar, "episode_id", "step", "seq"]
        tensors = [n for n in names if n in self.schema.fields and (self.schema.fields[n].shape
                                                                     or self.schema.fields[n].ragged
                                                                     or not self.schema.fields[n].plain)]
        if tensors:
            raise SchemaError(f"to_cudf() takes scalar and metadata columns; {tensors} are tensor or list columns "
                              "(cuDF has no fixed-shape tensor type): read them with sample(...).to_torch('cuda')")
        return to_cudf(self.to_table(names))

    def chunks(self) -> pa.Table:
        """The chunk directory of the live rows: slot, first_seq, rows, sealed, tier per column."""
        with self._lock:
            return self.directory.table(self.index.lo, self.index.hi)
