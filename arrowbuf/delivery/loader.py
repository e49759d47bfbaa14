"""Loader: latency-aware delivery of sampled batches to a learner.

A background thread samples, gathers and collates the next batches (and, on CUDA, pins them and copies them to the
device on a side stream) while the learner computes, so the learner waits only for what could not be hidden. Usage::

    with ab.Loader(store, batch_size=256, prefetch=4, format="torch") as loader:   # store, attached store or client
        for step, batch in zip(range(10_000), loader):
            loss, td = train_step(batch)                        # batch: dict of tensors; batch.indices, batch.weights
            loader.update_priorities(batch, td.abs())           # applied in the background, before the next sample
        print(loader.metrics.summary())                         # exposed wait vs path time per iteration

Semantics and the bounds this achieves (`P` = `prefetch`, `B` = `batch_size`):

* Order: one thread issues every `source.sample` call, in order, so a seeded source yields the same sequence of
  batches through a Loader as when sampled synchronously. With a Fifo (queue) source each item is delivered once.
* Rate limiting: the store counts a sample when the background thread draws it, not when the learner takes it. The
  Loader keeps at most `P` batches drawn but not yet taken (the one being prepared included), so the store's sample
  count runs ahead of what the learner has taken by at most `P * B` items (plus rows dropped by the staleness filter,
  and batches discarded by `close()`). A limiter therefore sees a learner at most `P` batches early; use `prefetch=1`
  where that window matters.
* Priority updates: `update_priorities` returns at once; the background thread applies pending updates before each
  `source.sample` call it starts (and while idle). An update is applied before every sample that starts after
  `update_priorities` returns. Batches drawn earlier, at most `P` of them (already prefetched or in flight), can still
  be delivered after the update with ids whose priorities it changed.
* Staleness (`max_staleness`, `min_policy_version`, on the `policy_version` field): rows older than the floor
  `max(min_policy_version, policy_version - max_staleness)` are dropped, never delivered. The background thread
  draws replacements so batches keep `B` rows; for a Fifo source the dropped rows are consumed (an on-policy queue
  discards stale experience). Rows that become stale while their batch waits in the prefetch window (the learner
  raised its policy version meanwhile) are dropped when the batch is taken, so such a batch can be shorter than `B`,
  and one with no fresh row left is skipped.
* Shutdown: `close()` (or leaving the `with` block) stops the thread within one wait slice (about 50 ms) plus the
  sample call in progress, discards prefetched batches (for a Fifo source their items are consumed), and applies
  pending priority updates. An error in the background thread is raised in the learner's thread by `__next__`
  (after the batches prepared before it), with its original type.

* A remote source (`ab.connect(...)`): batches come from one DoExchange learner session (`RemoteStore.session`):
  the server keeps `P` batches sampled ahead and waits for data itself, so nothing polls; `close()` cancels the
  session's read at once. Priority updates go up in-band. The windows above widen by what the server holds: at most
  `P` batches prefetched there and 3 requested ones in flight, so an update can miss up to `2 * P + 3` batches drawn
  before it, and the limiter sees the learner up to that many batches early. With a staleness filter (batches of
  varying size) a remote source is sampled with one DoGet per draw instead. If the server goes away, one DoGet
  (which reconnects for `reconnect_timeout`) serves the next batch and a new session follows.

The exposed-latency metric (DESIGN.md, "Latency-aware scheduling") is in `loader.metrics`; see `LoaderMetrics`.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeGuard, runtime_checkable

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..errors import InvalidArgument, SampleTimeout, SchemaError, StoreClosed, Unavailable, require
from ..samplers import validate_priorities
from ..schema.convert import numpy_to_arrow
from ..schema.inputs import DeviceLike, Gathered, IdsLike, ValuesLike
from .batch import SampleBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor
    from typing_extensions import TypeIs


class SampleSource(Protocol):
    """What a Loader draws from: any `ab.StoreSurface` (a store, an attached store, `ab.connect(...)`'s client, a
    `ShardedStore`), or a narrower source such as arrowbuf.rllib's `QueuedSource`. `extend` is used by
    `Loader.extend` only; a source may also offer `maintain()` (called between batches) and learner sessions
    (`SessionSource`)."""

    def sample(self, n: int, /, columns: Iterable[str] | None = None, timeout: float | None = None) -> SampleBatch: ...

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike, /) -> object: ...

    def extend(self, batch: Any, /) -> object: ...  # what the source takes (a batch; RLlib episodes)


class BatchSession(Protocol):
    """A learner session of a remote source: batches of a fixed size, prefetched by the server
    (`arrowbuf.flight.session.LearnerSession`)."""

    def __next__(self) -> SampleBatch: ...

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> None: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class _Indexed(Protocol):
    """A batch that names its rows (`SampleBatch`, `TorchBatch`): `update_priorities` takes it for its ids."""

    @property
    def indices(self) -> IdsLike: ...


class SessionSource(Protocol):
    """A source that serves a fixed batch size through a learner session: its class declares
    `learner_sessions = True` (`ab.flight.RemoteStore`)."""

    def session(self, n: int, columns: list[str] | None = None, *, prefetch: int, timeout: float,
                **options: object) -> BatchSession: ...

#: Longest single wait the background thread makes on a local source before it checks for `close()`.
_WAIT_SLICE_S = 0.05
#: How long the server may wait for data per request of a remote Loader's session (close() cancels the wait).
_REMOTE_WAIT_S = 1.0
#: The column the staleness filter reads (schemas/cartpole.yaml and schemas/tokens.yaml carry it).
POLICY_VERSION = "policy_version"

_FORMATS = ("batch", "torch")


class TorchBatch(dict):
    """A batch as a dict of torch tensors keyed by field (what `Loader(format="torch")` yields).

    Attributes:
        indices: int64 numpy ids of the rows (pass the batch to `loader.update_priorities`).
        weights: float32 importance weights as a tensor on the loader's device, or None.
        info: sampler extras.
    """

    __slots__ = ("indices", "info", "weights")

    def __init__(self, tensors: dict[str, Any], indices: np.ndarray, weights: torch.Tensor | None,
                 info: dict[str, Any]) -> None:
        super().__init__(tensors)
        self.indices = indices
        self.weights = weights
        self.info = info


# ---------------------------------------------------------------------------------------------------------- metrics
_METRIC_COLUMNS = ("iteration", "wait_s", "insert_s", "exposed_s", "path_s", "sample_s", "collate_s", "copy_s",
                   "exposed_path_s", "hidden_fraction", "rows", "stale_rows_dropped")


class LoaderMetrics:
    """Per-iteration experience-path timings, measured where they happen (seconds, `time.perf_counter`).

    Per iteration (one batch taken):
        wait_s: time the learner blocked in `next(loader)`.
        insert_s: blocking insert time the learner spent in `loader.extend` since the previous batch.
        exposed_s: `wait_s + insert_s`, the exposed experience-path latency of this iteration.
        path_s: background time that prepared this batch: `sample_s + collate_s + copy_s` (sample includes the
            store's gather, its own waiting for data or the rate limiter, and staleness redraws).
        exposed_path_s: the part of `path_s` the learner waited through (the overlap of the two intervals), so
            `exposed_path_s <= min(path_s, wait_s)`; `wait_s - exposed_path_s` is hand-off (thread wake-up).
        hidden_fraction: `1 - exposed_path_s / path_s`, in [0, 1].

    The newest `history` iterations are kept row by row (`to_arrow`); totals cover every iteration.
    """

    def __init__(self, history: int = 100_000) -> None:
        self._rows: collections.deque[tuple] = collections.deque(maxlen=max(1, int(history)))
        self.iterations = 0
        self.totals = {k: 0.0 for k in ("wait_s", "insert_s", "exposed_s", "path_s", "exposed_path_s")}
        self.stale_rows_dropped = 0
        self.stale_batches_skipped = 0
        self._pending_insert_s = 0.0

    def _record(self, wait_s: float, item: _Prepared, exposed_path_s: float, stale_rows: int) -> None:
        insert_s, self._pending_insert_s = self._pending_insert_s, 0.0
        path_s = item.path_s
        exposed_path_s = min(max(0.0, exposed_path_s), path_s, wait_s)
        hidden = 1.0 - exposed_path_s / path_s if path_s > 0 else 1.0
        row = (self.iterations, wait_s, insert_s, wait_s + insert_s, path_s, item.sample_s, item.collate_s,
               item.copy_s, exposed_path_s, min(1.0, max(0.0, hidden)), item.rows, stale_rows + item.stale_rows)
        self._rows.append(row)
        self.iterations += 1
        for k, v in (("wait_s", wait_s), ("insert_s", insert_s), ("exposed_s", wait_s + insert_s),
                     ("path_s", path_s), ("exposed_path_s", exposed_path_s)):
            self.totals[k] += v
        self.stale_rows_dropped += stale_rows + item.stale_rows

    def _add_insert(self, seconds: float) -> None:
        self._pending_insert_s += seconds

    @property
    def hidden_fraction(self) -> float:
        """Share of all path time the learner did not wait for, in [0, 1] (1.0 before any iteration)."""
        path = self.totals["path_s"]
        return 1.0 if path <= 0 else min(1.0, max(0.0, 1.0 - self.totals["exposed_path_s"] / path))

    def to_arrow(self) -> pa.Table:
        """The kept iterations as a `pa.Table`, one row per batch taken (columns as in the class docstring)."""
        cols: list[Any] = list(zip(*self._rows)) if self._rows else [[] for _ in _METRIC_COLUMNS]
        types = [pa.int64()] + [pa.float64()] * 9 + [pa.int64(), pa.int64()]
        return pa.table([numpy_to_arrow(c, t) for c, t in zip(cols, types)], names=list(_METRIC_COLUMNS))

    def summary(self) -> str:
        """One line: iterations, mean exposed latency vs mean path time, hidden fraction, p50/p99 wait."""
        n = self.iterations
        if n == 0:
            return "Loader: no iterations yet"
        waits = np.array([r[1] for r in self._rows])
        ms = 1e3
        line = (f"Loader: {n} iterations; exposed {self.totals['exposed_s'] / n * ms:.3f} ms/it "
                f"(wait p50 {np.percentile(waits, 50) * ms:.3f} ms, p99 {np.percentile(waits, 99) * ms:.3f} ms"
                f"{', insert %.3f ms/it' % (self.totals['insert_s'] / n * ms) if self.totals['insert_s'] else ''}); "
                f"path {self.totals['path_s'] / n * ms:.3f} ms/it; hidden {self.hidden_fraction:.1%}")
        if self.stale_rows_dropped or self.stale_batches_skipped:
            line += f"; stale rows dropped {self.stale_rows_dropped}, batches skipped {self.stale_batches_skipped}"
        return line

    def __repr__(self) -> str:
        return f"<LoaderMetrics {self.summary()}>"


# ---------------------------------------------------------------------------------------------------------- pipeline
@dataclass
class _Prepared:
    """A batch the background thread finished, with its timings."""

    payload: Any
    versions: np.ndarray | None
    rows: int
    t_start: float
    t_ready: float
    sample_s: float
    collate_s: float
    copy_s: float
    stale_rows: int = 0

    @property
    def path_s(self) -> float:
        return self.t_ready - self.t_start


class _Stopped(Exception):
    """The pipeline was told to stop while preparing a batch."""


@dataclass
class _Config:
    batch_size: int
    prefetch: int
    columns: list[str] | None
    drop_version: bool
    format: str
    device: DeviceLike
    cuda: bool
    sample_options: dict[str, Any]
    filtered: bool
    floor: Callable[[], float]
    collate: Callable[[SampleBatch], Any] | None = None


@dataclass
class _Shared:
    """State shared between the learner's thread and the background thread, guarded by `cond`."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    ready: collections.deque = field(default_factory=collections.deque)
    outstanding: int = 0            # batches drawn from the source and not yet taken (being prepared included)
    stop: bool = False
    error: BaseException | None = None
    pending: list[_Pending] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    cancel: Callable[[], None] | None = None  # wakes the background thread from a blocking remote read


class _Pipeline:
    """The background thread's side. Holds no reference to the Loader, so a forgotten Loader can be collected."""

    def __init__(self, source: SampleSource, cfg: _Config, shared: _Shared) -> None:
        self.source = source
        self.cfg = cfg
        self.s = shared
        self._maintain = getattr(source, "maintain", None)
        self._session: BatchSession | None = None
        self._sessions = source if _is_remote(source) else None
        self._remote = self._sessions is not None and not cfg.filtered  # a fixed batch size: a DoExchange session
        self._stream = None
        if cfg.cuda:  # pragma: no cover - needs a GPU
            torch = require("torch", "torch")
            self._stream = torch.cuda.Stream(device=cfg.device)

    # ---------------------------------------------------------------- thread body
    def run(self) -> None:
        s = self.s
        try:
            while True:
                with s.cond:
                    while not s.stop and not s.pending and s.outstanding >= self.cfg.prefetch:
                        s.cond.wait()
                    if s.stop:
                        return
                    if s.outstanding >= self.cfg.prefetch:  # woken by priority updates only
                        work = False
                    else:
                        s.outstanding += 1
                        work = True
                self.apply_pending()
                if not work:
                    continue
                item = self.prepare()
                with s.cond:
                    if s.stop:
                        return
                    s.ready.append(item)
                    s.cond.notify_all()
                if self._maintain is not None:  # store work that must happen anyway: do it while the learner computes
                    self._maintain()
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - every failure is handed to the learner's thread
            if s.stop:  # close() cancelled a remote read: not an error
                return
            exc.add_note("(raised in the arrowbuf Loader's background thread)")
            with s.cond:
                s.error = exc
                s.cond.notify_all()
        finally:
            self._end_session()

    def apply_pending(self) -> None:
        """Apply queued priority updates (the background's copy of the learner's calls, in call order); over a
        session they go up in-band, ahead of the next requests."""
        with self.s.cond:
            updates, self.s.pending = self.s.pending, []
        for update in updates:
            ids, pri = _ready(*update)
            if self._session is not None:
                self._session.update_priorities(ids, pri)
            else:
                self.source.update_priorities(ids, pri)

    # ---------------------------------------------------------------- a remote source: one DoExchange session
    def _open_session(self) -> BatchSession:
        """The learner session batches come from (server-side prefetch; no polling): `close()` cancels its read."""
        cfg = self.cfg
        assert self._sessions is not None, "only a remote source opens sessions"
        with self.s.cond:
            if self.s.stop:
                raise _Stopped
            self._session = self._sessions.session(cfg.batch_size, cfg.columns, prefetch=cfg.prefetch,
                                                timeout=_REMOTE_WAIT_S, **cfg.sample_options)
            self.s.cancel = self._session.cancel
        return self._session

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with self.s.cond:
                self.s.cancel = None
            session.close()

    def _next_remote(self) -> SampleBatch:
        session = self._session if self._session is not None else self._open_session()
        while True:
            if self.s.stop:
                raise _Stopped
            self.apply_pending()
            try:
                return next(session)
            except SampleTimeout:
                continue  # the server waited _REMOTE_WAIT_S for data in vain: ask again
            except Unavailable:
                if self.s.stop:
                    raise _Stopped from None
                self._end_session()  # the server went away: one sample (which reconnects), then a new session
                return self._sample_polling(self.cfg.batch_size)

    # ---------------------------------------------------------------- one batch
    def prepare(self) -> _Prepared:
        t0 = time.perf_counter()
        batch, versions, stale = self._draw(self.cfg.batch_size)
        t1 = time.perf_counter()
        payload = self._collate(batch)
        t2 = time.perf_counter()
        if self.cfg.cuda:  # pragma: no cover - needs a GPU
            payload = self._copy(payload)
        t3 = time.perf_counter()
        return _Prepared(payload, versions, len(batch), t0, t3, t1 - t0, t2 - t1, t3 - t2, stale)

    def _sample(self, n: int) -> SampleBatch:
        """One `source.sample(n)`, waiting in slices so `close()` is seen; pending priority updates go first. A
        remote source serves from its DoExchange session instead (the server waits for data: no polling)."""
        if self._remote:
            return self._next_remote()
        return self._sample_polling(n)

    def _sample_polling(self, n: int) -> SampleBatch:
        while True:
            if self.s.stop:
                raise _Stopped
            self.apply_pending()
            try:
                return self.source.sample(n, columns=self.cfg.columns, timeout=_WAIT_SLICE_S,
                                          **self.cfg.sample_options)
            except SampleTimeout:
                continue  # no data or the rate limiter says wait: look at the stop flag, then wait again

    def _draw(self, n: int) -> tuple[SampleBatch, np.ndarray | None, int]:
        """A batch of `n` rows that pass the staleness floor (drawing replacements for stale ones)."""
        cfg = self.cfg
        if not cfg.filtered:
            return self._sample(n), None, 0
        parts: list[tuple[SampleBatch, np.ndarray]] = []
        have = stale = 0
        backoff = 0.001
        while have < n:
            b = self._sample(n - have)
            versions = np.asarray(b[POLICY_VERSION]).astype(np.int64, copy=False)
            keep = versions >= cfg.floor()
            k = int(keep.sum())
            stale += len(keep) - k
            if k == len(keep):
                parts.append((b, versions))
            elif k:
                parts.append((_select_rows(b, keep), versions[keep]))
            have += k
            if k == 0:  # the store holds only stale rows for now: back off instead of spinning on the sampler
                if self.s.stop_event.wait(backoff):
                    raise _Stopped
                backoff = min(backoff * 2, _WAIT_SLICE_S)
        batch = parts[0][0] if len(parts) == 1 else SampleBatch.concat([p[0] for p in parts])
        versions = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
        if cfg.drop_version:
            batch = SampleBatch({c: batch[c] for c in batch.columns if c != POLICY_VERSION}, batch.indices,
                                batch.weights, batch.info)
        return batch, versions, stale

    def _collate(self, batch: SampleBatch) -> Any:
        if self.cfg.format == "batch":
            return batch if self.cfg.collate is None else self.cfg.collate(batch)
        torch = require("torch", "torch")
        # columns a GPU tier gathered on the device stay there (no round trip through the host)
        on_device = {k: batch[k] for k in batch.columns if getattr(getattr(batch[k], "device", None), "type", "cpu")
                     != "cpu"}
        host = SampleBatch({k: batch[k] for k in batch.columns if k not in on_device}, batch.indices, batch.weights)
        tensors = {**host.to_torch("cpu"), **on_device}
        tensors = {k: tensors[k] for k in batch.columns}
        w: np.ndarray | Tensor | None = batch.weights
        weights: Tensor | None = w if w is None or _is_tensor(w) else torch.from_numpy(np.asarray(w))
        if self.cfg.cuda:  # pragma: no cover - needs a GPU
            tensors = {k: _map_tensors(v, lambda t: t if t.is_cuda else t.pin_memory()) for k, v in tensors.items()}
            weights = weights if weights is None or weights.is_cuda else weights.pin_memory()
        return TorchBatch(tensors, batch.indices, weights, batch.info)

    def _copy(self, tb: TorchBatch) -> TorchBatch:  # pragma: no cover - needs a GPU
        """Host-to-device copy on the side stream; waits for it here, in the background, not in the learner."""
        torch = require("torch", "torch")
        dev = self.cfg.device
        with torch.cuda.stream(self._stream):
            out = {k: _map_tensors(v, lambda t: t.to(dev, non_blocking=True)) for k, v in tb.items()}
            weights = tb.weights.to(dev, non_blocking=True) if tb.weights is not None else None
        self._stream.synchronize()  # type: ignore[union-attr]
        return TorchBatch(out, tb.indices, weights, tb.info)


# ---------------------------------------------------------------------------------------------------------- Loader
class Loader:
    """An iterator of prefetched batches from a store, an attached store or a remote client.

    Args:
        source: a store (`ab.StoreSurface`: `ExperienceStore`, an attached shared-memory store, `ab.connect(...)`'s
            client, a `ShardedStore`); only `sample` and `update_priorities` are used (and `session` of a client).
        batch_size: rows per batch.
        prefetch: batches prepared ahead (>= 1); also the rate-limiter and priority-update window (module docstring).
        columns: columns to sample (default: all).
        device: torch device for `format="torch"` ("cpu", "cuda", "cuda:1", ...).
        format: "batch" yields `SampleBatch`; "torch" yields `TorchBatch` (a dict of tensors on `device`).
        timeout: seconds `next()` waits for a batch before raising `SampleTimeout`; None waits as long as it takes
            (unlike `store.sample`, where None does not wait: a Loader is asynchronous by nature).
        max_staleness: deliver only rows with `policy_version >= current policy version - max_staleness`.
        min_policy_version: deliver only rows with `policy_version >= min_policy_version`.
        policy_version: the learner's current policy version (an int, or a callable returning it); needed with
            `max_staleness`; update it with `set_policy_version`.
        history: iterations kept row by row in `metrics`.
        collate: with `format="batch"`, a function of each `SampleBatch` run on the background thread (its time
            counts as `collate_s`); `next()` yields what it returns (e.g. arrowbuf.rllib's RLlib episodes). Not with
            a staleness filter (which re-filters `SampleBatch`es).
        **sample_options: passed to every `source.sample` (e.g. `n_step=3, gamma=0.99`).
    """

    def __init__(self, source: SampleSource, batch_size: int, prefetch: int = 4, columns: Iterable[str] | None = None,
                 device: DeviceLike = "cpu", format: str = "batch", *, timeout: float | None = None,
                 max_staleness: int | None = None, min_policy_version: int | None = None,
                 policy_version: int | Callable[[], int] | None = None, history: int = 100_000,
                 collate: Callable[[SampleBatch], Any] | None = None, **sample_options: object) -> None:
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be a positive number of rows, got {batch_size!r}")
        if not isinstance(prefetch, (int, np.integer)) or isinstance(prefetch, bool) or prefetch < 1:
            raise InvalidArgument(f"prefetch must be >= 1 batches, got {prefetch!r}")
        if format not in _FORMATS:
            raise InvalidArgument(f"format must be one of {_FORMATS}, got {format!r}")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        if max_staleness is not None and max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0 policy versions, got {max_staleness!r}")
        if max_staleness is not None and policy_version is None:
            raise InvalidArgument("max_staleness needs the learner's policy version: pass policy_version= (an int or a "
                             "callable), and keep it current with loader.set_policy_version(v)")
        cols: list[str] | None = None
        if columns is not None:
            cols = list(dict.fromkeys([columns] if isinstance(columns, str) else columns))
        self._cuda = False
        if format == "torch":
            torch = require("torch", "torch")
            dev = torch.device(device)
            self._cuda = dev.type == "cuda"
            if self._cuda and not torch.cuda.is_available():
                raise InvalidArgument(f"device={device!r} but torch sees no CUDA device; use device='cpu'")
            if dev.type not in ("cpu", "cuda"):
                raise InvalidArgument(f"device must be 'cpu' or a CUDA device, got {device!r}")
            device = dev
        elif str(device) != "cpu":
            raise InvalidArgument(f"device={device!r} needs format='torch' (a SampleBatch holds host arrays)")
        filtered = max_staleness is not None or min_policy_version is not None
        if collate is not None and (format != "batch" or filtered):
            raise InvalidArgument("collate= runs on SampleBatches: use it with format='batch' and without "
                                  "max_staleness/min_policy_version")
        drop_version = False
        if filtered:
            schema = getattr(source, "schema", None)
            fields = getattr(schema, "fields", None)
            if fields is not None and POLICY_VERSION not in fields:
                raise SchemaError(f"max_staleness/min_policy_version read the {POLICY_VERSION!r} field, which "
                                  f"schema {getattr(schema, 'name', '?')!r} lacks; add `{POLICY_VERSION}: "
                                  f"{{dtype: int64}}` to the schema (see schemas/cartpole.yaml)")
            if cols is not None and POLICY_VERSION not in cols:
                cols.append(POLICY_VERSION)
                drop_version = True
        self.source = source
        self.batch_size = int(batch_size)
        self.prefetch = int(prefetch)
        self.format = format
        self.device = device
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.min_policy_version = min_policy_version
        self._policy_version = policy_version
        self.metrics = LoaderMetrics(history)
        self._shared = _Shared()
        # the background thread reads the floor through a weak reference: it must not keep the Loader alive
        cfg = _Config(self.batch_size, self.prefetch, cols, drop_version, format, device, self._cuda,
                      dict(sample_options), filtered, _weak_floor(self), collate)
        self._pipeline = _Pipeline(source, cfg, self._shared)
        self._thread = threading.Thread(target=self._pipeline.run, name=f"arrowbuf-loader-{id(self):x}", daemon=True)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._shared)
        self._thread.start()

    # ---------------------------------------------------------------- policy versions
    def set_policy_version(self, version: int) -> None:
        """Set the learner's current policy version (the reference of `max_staleness`)."""
        self._policy_version = int(version)

    @property
    def policy_version(self) -> int | None:
        v = self._policy_version
        return int(v()) if callable(v) else v

    def _floor(self) -> float:
        """The oldest policy_version that may be delivered now."""
        floor = -np.inf
        if self.min_policy_version is not None:
            floor = float(self.min_policy_version)
        if self.max_staleness is not None:
            floor = max(floor, float(self.policy_version) - self.max_staleness)  # type: ignore[arg-type]
        return floor

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        """The next batch; raises the background thread's error, `SampleTimeout`, or StopIteration once closed."""
        s = self._shared
        t_ask = time.perf_counter()
        deadline = None if self.timeout is None else t_ask + self.timeout
        stale_rows = 0
        while True:
            with s.cond:
                while not s.ready and s.error is None and not s.stop:
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        raise SampleTimeout(
                            f"Loader: no batch of {self.batch_size} within timeout={self.timeout}s "
                            f"({self.metrics.iterations} taken so far); the source has too little data, its rate "
                            f"limiter holds sampling back, or the staleness filter drops every row. Insert more "
                            f"or pass a longer timeout=")
                    s.cond.wait(left)
                if s.ready:
                    item: _Prepared = s.ready.popleft()
                    s.outstanding -= 1
                    s.cond.notify_all()
                elif s.error is not None:
                    raise s.error
                else:
                    raise StopIteration
            t_got = time.perf_counter()
            payload, dropped = self._refilter(item)
            stale_rows += dropped
            if payload is None:  # every row turned stale while the batch waited: take the next one
                self.metrics.stale_batches_skipped += 1
                continue
            break
        wait_s = t_got - t_ask
        exposed = min(item.t_ready, t_got) - max(item.t_start, t_ask)
        self.metrics._record(wait_s, item, exposed, stale_rows)
        if self._cuda:  # pragma: no cover - needs a GPU
            _record_stream(payload)
        return payload

    def _refilter(self, item: _Prepared) -> tuple[Any, int]:
        """Drop rows that became older than the floor since the batch was drawn; None when none is left."""
        if item.versions is None:
            return item.payload, 0
        keep = item.versions >= self._floor()
        if keep.all():
            return item.payload, 0
        dropped = int((~keep).sum())
        if not keep.any():
            return None, dropped
        if isinstance(item.payload, SampleBatch):
            return _select_rows(item.payload, keep), dropped
        tb: TorchBatch = item.payload
        torch = require("torch", "torch")
        rows = np.flatnonzero(keep)
        idx = torch.from_numpy(rows)
        out = {}
        for k, v in tb.items():
            out[k] = [v[i] for i in rows] if isinstance(v, list) else v.index_select(0, idx.to(v.device))
        w = tb.weights.index_select(0, idx.to(tb.weights.device)) if tb.weights is not None else None
        return TorchBatch(out, tb.indices[keep], w, tb.info), dropped

    # ---------------------------------------------------------------- priorities and inserts
    def update_priorities(self, batch: SampleBatch | TorchBatch | IdsLike, priorities: ValuesLike) -> None:
        """Queue new priorities for a batch's rows (or for an array of ids); returns at once.

        The background thread applies them before the next `source.sample` it starts; see the module docstring for
        the bound on batches already prefetched. Errors from the source surface from `next(loader)`. A batch sampled
        on the device (a store's device ring: its `indices` are a device tensor) with priorities given as a tensor
        stays on the device: the counts are checked here, the values by the store when it applies them.

        Raises:
            InvalidArgument: the number of priorities does not match the ids, or a priority is negative, not finite
                or too large (`samplers.validate_priorities`, the one check).
        """
        # a batch's ids; a tensor's `indices` is a method (of sparse tensors): a tensor is the ids themselves
        ids: IdsLike = batch.indices if isinstance(batch, _Indexed) and not _is_tensor(batch) else batch
        pri = priorities
        update: _Pending
        if _is_tensor(ids) and _is_tensor(pri):
            update = _queued_tensors(ids, pri)  # a device sample's ids: stay on the device (no host sync)
        else:
            h_ids, h_pri = validate_priorities(_to_numpy(ids), _to_numpy(pri))
            update = h_ids.copy(), h_pri.copy()  # the learner may reuse its buffers before the thread applies them
        s = self._shared
        with s.cond:
            if self._closed:
                raise StoreClosed("the Loader is closed")
            if s.error is not None or not self._thread.is_alive():
                self.source.update_priorities(*_ready(*update))  # no background thread to hand it to
                return
            s.pending.append(update)
            s.cond.notify_all()

    def extend(self, batch: object, **kwargs: Any) -> object:
        """`source.extend(batch, **kwargs)`, timed: the blocking insert time counts in this iteration's exposed latency.

        For learners that also write (single-process loops); writers elsewhere are not seen by the Loader.
        """
        t0 = time.perf_counter()
        try:
            return self.source.extend(batch, **kwargs)
        finally:
            self.metrics._add_insert(time.perf_counter() - t0)

    # ---------------------------------------------------------------- introspection
    @property
    def prefetched(self) -> int:
        """Batches ready to be taken now."""
        with self._shared.cond:
            return len(self._shared.ready)

    def fill(self, timeout: float | None = None) -> bool:
        """Wait until `prefetch` batches are ready (e.g. before timing). False on timeout, error or close."""
        s = self._shared
        with s.cond:
            return s.cond.wait_for(lambda: len(s.ready) >= self.prefetch or s.error is not None or s.stop,
                                   timeout) and len(s.ready) >= self.prefetch

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.prefetched}/{self.prefetch} ready"
        return f"Loader(batch_size={self.batch_size}, prefetch={self.prefetch}, format={self.format!r}, {state})"

    # ---------------------------------------------------------------- lifetime
    def close(self, timeout: float = 30.0) -> None:
        """Stop the background thread, discard prefetched batches, apply pending priority updates; idempotent.

        Returns within about one wait slice (50 ms) plus the `source.sample` call in progress; waits at most
        `timeout` seconds for the thread (a source call that hangs leaves a daemon thread behind).
        """
        if self._closed:
            return
        self._closed = True
        s = self._shared
        _stop(s)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with s.cond:
            s.ready.clear()
            pending, s.pending = s.pending, []
        for update in pending:  # priorities the learner computed are not lost on shutdown
            try:
                self.source.update_priorities(*_ready(*update))
            except StoreClosed:
                break
        self._finalizer.detach()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------- helpers
def _stop(shared: _Shared) -> None:
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
        cancel = shared.cancel
    shared.stop_event.set()
    if cancel is not None:
        cancel()


def _is_remote(source: object) -> TypeGuard[SessionSource]:
    """Whether `source` serves a fixed batch size through a learner session (`session(n, columns, prefetch=...,
    ...)`): a capability the class declares (`learner_sessions = True`, as `ab.flight.RemoteStore` does)."""
    return bool(getattr(type(source), "learner_sessions", False)) and callable(getattr(source, "session", None))


def _weak_floor(loader: Loader) -> Callable[[], float]:
    ref = weakref.ref(loader)

    def floor() -> float:
        obj = ref()
        if obj is None:
            raise _Stopped
        return obj._floor()

    return floor


def _is_tensor(x: object) -> TypeIs[torch.Tensor]:
    return type(x).__module__.startswith("torch")


class _DeviceUpdate:
    """Priorities queued as tensors (a device sample's ids and the learner's priorities): copies made on the learner's
    stream, and on CUDA an event the applying thread's stream waits for, so neither side waits on the host."""

    def __init__(self, pri: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.pri, self.event = pri, event

    def ready(self, ids: IdsLike) -> tuple[IdsLike, torch.Tensor]:
        """(ids, priorities), the calling thread's stream ordered after the learner's copies."""
        if self.event is not None:  # pragma: no cover - needs a GPU
            import torch

            torch.cuda.current_stream(self.pri.device).wait_event(self.event)
        return ids, self.pri


#: A queued priority update: host ids and priorities, or a device sample's ids with its queued tensor priorities.
_Pending = tuple[np.ndarray, np.ndarray] | tuple[IdsLike, "_DeviceUpdate"]


def _ready(ids: IdsLike, pri: np.ndarray | _DeviceUpdate) -> tuple[IdsLike, ValuesLike]:
    """A queued update as (ids, priorities) to apply, a device one ordered after the learner's copies."""
    return pri.ready(ids) if isinstance(pri, _DeviceUpdate) else (ids, pri)


def _queued_tensors(ids: torch.Tensor, pri: torch.Tensor) -> tuple[torch.Tensor, _DeviceUpdate]:
    """Tensor priorities for the queue: counts checked now (shapes: no device read), values by the store when the
    update is applied (a refused one surfaces from `next(loader)`)."""
    if ids.numel() != pri.numel():
        raise InvalidArgument(f"{ids.numel()} indices but {pri.numel()} priorities; pass one priority per index")
    ids, pri = ids.detach().reshape(-1).clone(), pri.detach().reshape(-1).clone()
    event = None
    if pri.is_cuda:  # pragma: no cover - needs a GPU
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(pri.device))
    return ids, _DeviceUpdate(pri, event)


def _to_numpy(x: IdsLike) -> npt.ArrayLike:
    if hasattr(x, "detach"):  # a torch tensor, possibly on a GPU
        return x.detach().cpu().numpy()
    return x


def _take(values: Gathered, rows: np.ndarray) -> Gathered:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.take(numpy_to_arrow(rows))
    return values[rows]


def _select_rows(batch: SampleBatch, keep: np.ndarray) -> SampleBatch:
    rows = np.flatnonzero(keep)
    arrays = {c: _take(batch[c], rows) for c in batch.columns}
    weights = batch.weights[rows] if batch.weights is not None else None
    return SampleBatch(arrays, batch.indices[rows], weights, batch.info)


def _map_tensors(v: torch.Tensor | list[torch.Tensor],
                 fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    return [fn(t) for t in v] if isinstance(v, list) else fn(v)


def _record_stream(tb: TorchBatch) -> None:  # pragma: no cover - needs a GPU
    """Tell the caching allocator the learner's stream uses these side-stream tensors (no early reuse)."""
    import torch

    stream = torch.cuda.current_stream()
    for v in list(tb.values()) + ([tb.weights] if tb.weights is not None else []):
        for t in (v if isinstance(v, list) else [v]):
            if t.is_cuda:
                t.record_stream(stream)


__all__ = ["POLICY_VERSION", "Loader", "LoaderMetrics", "TorchBatch"]
