"""The persistence half of `ExperienceStore`'s surface that writes: `checkpoint` (with the durable store's journal
wiring and the record `/metrics` reads) and `export`. Restoring (`ExperienceStore.restore`, `from_dataset`) builds a
store, so it stays on the facade.

`StorePersistence` is a mixin of `arrowbuf.store.facade.ExperienceStore`, split out of the facade for size (one
concept per module): not used on its own. Its methods read the store's own parts, which the facade builds; the
annotations below name what they read, nothing more. Every method and docstring is the facade's, unchanged:
`help(ab.ExperienceStore)` lists them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..engine.core import StoreCore
from ..observe.meter import ProgressSink
from .writes import Writes

if TYPE_CHECKING:
    class _Parts:
        """What these methods read of the facade (set by `ExperienceStore.__init__`): for the type checker only."""

        _core: StoreCore | None
        @property
        def _w(self) -> Writes: ...
        _checkpoints: dict[str, Any]

        def _check_open(self) -> None: ...

        def to_table(self, columns: Iterable[str] | None = None) -> pa.Table: ...

        def lineage_table(self) -> pa.Table: ...
else:
    _Parts = object


class StorePersistence(_Parts):
    """`ExperienceStore`'s checkpoint and export (a mixin of the facade)."""

    def checkpoint(self, path: Any = None, keep: int | None = None, background: bool = False,
                   compression: str | None = None) -> Any:
        """Write a consistent, incremental, atomic checkpoint into directory `path`; writers and samplers go on.

        The snapshot point is the call: the checkpoint holds the rows committed then (one contiguous seq range
        ending there, each row exactly as committed) and the sampler, rate-limiter, episode and RNG state of that
        instant. Sealed chunks already in `path` are reused; only new chunks, the open tail and the state files are
        written; `_manifest.json` is replaced atomically, so a crash leaves the previous checkpoint restorable. If
        the ring overwrites rows faster than they are copied, the oldest chunks that were overwritten meanwhile
        (and everything older) are left out: the checkpoint then starts at the oldest chunk still intact
        (`dropped_rows` says how many went). Never a torn row. Layout: docs/format.md.

        Args:
            path: the checkpoint directory (an Arrow IPC dataset; made if missing). A durable store's own
                directory (or None) also truncates the journal the checkpoint covers (default keep: 2).
            keep: keep the newest `keep` checkpoints (their files); None keeps all.
            background: return a `CheckpointHandle` (`.wait()`, `.progress`) at once and write in a thread,
                at a lower CPU priority than the process's other threads (`persist.checkpoint.BACKGROUND_NICE`).
            compression: None (uncompressed, memory-mappable: the default), or "zstd"/"lz4" for archives.

        Returns:
            A summary dict (generation, rows, files written and reused, bytes), or a handle with `background=True`.
        """
        self._check_open()
        assert self._core is not None
        out: Any = self._w.checkpoint(None if path is None else os.fspath(path), keep, background, compression)
        ck = self._checkpoints  # for /metrics (arrowbuf.observe.metrics)
        ck["count"] += 1
        if background:
            ck["handle"] = out
        else:
            ck["last"] = {**{k: out.get(k) for k in ("generation", "rows", "bytes_written", "seconds")},
                          "at": time.time()}
        return out

    def export(self, path: Any, format: str = "parquet", partition_by: Any = None,
               compression: str | None = None, progress: ProgressSink | None = None) -> dict[str, Any]:
        """Write the live rows as an offline-RL dataset (Parquet or Arrow IPC files, derived columns such as
        `next_obs` materialised, optional hive partitioning by `partition_by` columns); `ab.open_dataset` and
        `ExperienceStore.from_dataset` read it back. Writers wait while rows are copied (sampling goes on).
        The schema and the lineage of the live rows (taken right after the rows) go into the metadata folder
        `_arrowbuf/` (`dataset.json`, `lineage.parquet` or `.arrow`), where a glob of the data files such as DuckDB's
        or Polars' `read_parquet("DIR/*.parquet")` does not reach. Returns rows and path (and `lineage`: its
        file). `progress` hears the rows written (as `ExperienceStore.restore`'s). See
        `arrowbuf.persist.datasets`."""
        from ..persist import export
        from ..persist.datasets import lineage_path

        self._check_open()
        assert self._core is not None
        out = export(self._core, self.to_table, path, format=format, partition_by=partition_by,
                     compression=compression, progress=progress)
        if self._core.lineage is not None:  # in the metadata folder: out of reach of a glob of the data files
            from ..observe.lineage import write_table

            out["lineage"] = write_table(self.lineage_table(), lineage_path(path, format), format)
        return out
