"""Prometheus metrics of stores and Flight servers: a custom collector that reads them at scrape time, and the
`/metrics` HTTP endpoint (`MetricsEndpoint`). Needs `pip install 'arrowbuf[metrics]'` (prometheus-client), imported
only when an endpoint starts.

Nothing here runs on the data path: counters and gauges are derived from `store.stats()`, `store.placement()` and
`store.observability()` when Prometheus scrapes; latency histograms come from the `Timings` the store and the
server fill (`arrowbuf.observe.timings`). Every metric, its meaning and its TransferQueue counterpart are listed in
docs/observability.md. Metrics that mean what a TransferQueue metric means carry its name with the prefix
`arrowbuf_` instead of `tq_`, and its labels (`task_name`, `op_type`, `partition_id`, `storage_unit_id`).

Usage::

    with store.serve_metrics("127.0.0.1:0") as endpoint:      # or ab.serve(store, loc, metrics="127.0.0.1:9100")
        print(endpoint.url)                                    # http://127.0.0.1:<port>/metrics
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidArgument, MissingDependency, StoreClosed
from ..serving.http import BoundedHTTPServer, GuardedHandler, RequestGuard
from ..serving.limits import NetLimits, check_bind
from ..surface import Observable

log = logging.getLogger("arrowbuf.observe")

#: Staleness histogram bounds (policy versions) of `arrowbuf_consume_staleness`.
STALENESS_BOUNDS = (0, 1, 2, 3, 4, 8, 16, 32, 64)
#: Error classes counted as limits hit by a Flight server, by kind.
LIMIT_KINDS = {"ResourceExhausted": "busy", "InvalidArgument": "refused", "SchemaError": "refused",
               "ValueError": "refused", "TypeError": "refused", "QueryTimeout": "timed_out"}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependency("metrics need prometheus-client: pip install 'arrowbuf[metrics]'") from None
    return prometheus_client


def parse_address(address: str) -> tuple[str, int]:
    """"HOST:PORT" (or "[v6]:PORT") -> (host, port).

    Raises:
        InvalidArgument: not of that form, or a port outside 0..65535.
    """
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgument(f"a metrics address is 'HOST:PORT' (e.g. '127.0.0.1:9100'; port 0 picks one), got "
                              f"{address!r}")
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 0 <= p <= 65535:
        raise InvalidArgument(f"metrics address {address!r}: the port must be 0..65535")
    return host, p


class StoreCollector:
    """A Prometheus collector over named stores and Flight servers, read at scrape time (module docstring).

    Args:
        stores: name -> store, or a callable returning that (a server's stores).
        servers: Flight servers (`StoreServer`) whose verb latencies and limits hit to report.
    """

    def __init__(self, stores: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                 servers: list[Any] | None = None) -> None:
        self._stores = stores
        self.servers = list(servers or [])
        self.started = time.time()

    def describe(self) -> list[Any]:
        return []  # families are produced at scrape time (labels depend on the stores' tasks)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        stores = self._stores() if callable(self._stores) else self._stores
        c: dict[str, Any] = {}
        g: dict[str, Any] = {}
        h: dict[str, Any] = {}

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            if name not in c:
                c[name] = CounterMetricFamily(name, doc, labels=labels)
            return c[name]

        def gauge(name: str, doc: str, labels: list[str]) -> Any:
            if name not in g:
                g[name] = GaugeMetricFamily(name, doc, labels=labels)
            return g[name]

        def hist(name: str, doc: str, labels: list[str]) -> Any:
            if name not in h:
                h[name] = HistogramMetricFamily(name, doc, labels=labels)
            return h[name]

        gauge("arrowbuf_controller_uptime_seconds", "Seconds since the metrics endpoint started (tq_controller_"
              "uptime_seconds)", []).add_metric([], time.time() - self.started)
        gauge("arrowbuf_partitions_total", "Stores reported (tq_partitions_total)", []).add_metric([], len(stores))
        for name, store in list(stores.items()):
            try:
                self._store(name, store, counter, gauge, hist)
            except Exception as exc:  # noqa: BLE001 - one closed or failing store must not break the scrape
                log.debug("metrics: store %r not reported: %s", name, exc)
                gauge("arrowbuf_store_up", "1 when the store answered this scrape", ["store"]).add_metric([name], 0)
            else:
                gauge("arrowbuf_store_up", "1 when the store answered this scrape", ["store"]).add_metric([name], 1)
        for server in self.servers:
            self._server(server, counter, gauge, hist)
        yield from c.values()
        yield from g.values()
        yield from h.values()

    # ------------------------------------------------------------------ one store
    def _store(self, name: str, store: Any, counter: Any, gauge: Any, hist: Any) -> None:
        st = store.stats()
        row_bytes = int(store.schema.row_bytes)
        if isinstance(st.get("shards"), list):  # a ShardedStore: totals here, and one series per shard
            st = self._shards(name, st, counter, gauge)
        size, cap = int(st.get("size", 0)), int(st.get("capacity", 0) or 0)
        inserts, samples = int(st.get("inserts", 0)), int(st.get("samples", 0))
        counter("arrowbuf_rows_inserted", "Rows committed by writers", ["store"]).add_metric([name], inserts)
        counter("arrowbuf_bytes_inserted", "Bytes of fixed-width fields committed (rows x row bytes; ragged fields "
                "not counted)", ["store"]).add_metric([name], inserts * row_bytes)
        counter("arrowbuf_rows_sampled", "Items delivered by sample()", ["store"]).add_metric([name], samples)
        counter("arrowbuf_bytes_sampled", "Bytes of fixed-width fields delivered by sample() (items x row bytes)",
                ["store"]).add_metric([name], samples * row_bytes)
        consumed = st.get("consumed", {}) or {}
        for task, n in consumed.items():
            counter("arrowbuf_rows_consumed", "Rows delivered by consume() per task", ["store", "task_name"]
                    ).add_metric([name, task], int(n))
            counter("arrowbuf_bytes_consumed", "Bytes of fixed-width fields delivered by consume() per task",
                    ["store", "task_name"]).add_metric([name, task], int(n) * row_bytes)
        for key, doc in (("stale_dropped", "Rows dropped as stale by consume(max_staleness=...), all tasks"),
                         ("groups_dropped_zero_variance", "Groups dropped by the zero-variance filter, all tasks"),
                         ("insert_waits", "Writes that waited for consumers or the staleness window"),
                         ("update_skipped", "update() ids skipped (row evicted or replaced)"),
                         ("priority_updates_ignored", "Priority updates of evicted or recycled items")):
            if key in st:
                counter(f"arrowbuf_{key}", doc, ["store"]).add_metric([name], int(st[key]))
        for task, a in (st.get("admission") or {}).items():  # oldest-first admission (consume(admission=...))
            labels = [name, task]
            counter("arrowbuf_task_admitted_rows", "Rows delivered by oldest-first consumes per task",
                    ["store", "task_name"]).add_metric(labels, int(a.get("admitted", 0)))
            counter("arrowbuf_task_admission_dropped_rows", "Rows dropped as stale for a task",
                    ["store", "task_name"]).add_metric(labels, int(a.get("dropped", 0)))
            for key, doc in (("waiting_ahead", "Live rows newer than the store's policy version, held back"),
                             ("waiting_stale", "Live rows older than the task's version window, held back")):
                gauge(f"arrowbuf_task_admission_{key}_rows", doc, ["store", "task_name"]).add_metric(
                    labels, int(a.get(key, 0)))
        gauge("arrowbuf_rows", "Live rows", ["store"]).add_metric([name], size)
        gauge("arrowbuf_capacity_rows", "Rows the ring holds", ["store"]).add_metric([name], cap)
        gauge("arrowbuf_fill_ratio", "Live rows / capacity", ["store"]).add_metric([name], size / cap if cap else 0.0)
        gauge("arrowbuf_storage_capacity_total", "Rows the store holds (tq_storage_capacity_total)",
              ["storage_unit_id"]).add_metric([name], cap)
        gauge("arrowbuf_storage_active_keys_total", "Live rows (tq_storage_active_keys_total)",
              ["storage_unit_id"]).add_metric([name], size)
        gauge("arrowbuf_storage_utilization_ratio", "Live rows / capacity (tq_storage_utilization_ratio)",
              ["storage_unit_id"]).add_metric([name], size / cap if cap else 0.0)
        gauge("arrowbuf_partition_samples_total", "Live rows (tq_partition_samples_total)", ["partition_id"]
              ).add_metric([name], size)
        if "policy_version" in st:
            gauge("arrowbuf_policy_version", "The store's policy version", ["store"]).add_metric(
                [name], int(st["policy_version"]))
        if isinstance(st.get("journal"), dict):  # a durable store (or durable shards: their sums)
            self._journal(name, st["journal"], counter, gauge)
        # sizes: the one definition of arrowbuf.engine.sizes (stats(), arrowbuf inspect and the inspector show the same)
        if "rows_bytes" in st:
            gauge("arrowbuf_rows_bytes", "Bytes of the live rows' values as the store keeps them (rows' bytes)",
                  ["store"]).add_metric([name], int(st["rows_bytes"]))
        if "reserved_bytes" in st:
            gauge("arrowbuf_reserved_bytes", "Bytes the store's memory tiers hold for it, rows or not (reserved: the "
                  "ring of capacity rows plus one chunk, final observations, the index)", ["store"]).add_metric(
                [name], int(st["reserved_bytes"]))
        for column, sizes in (st.get("columns") or {}).items():
            gauge("arrowbuf_column_rows_bytes", "Bytes of the live rows' values per column (rows' bytes)",
                  ["store", "column"]).add_metric([name, str(column)], int(sizes.get("rows_bytes", 0)))
        for tier, nbytes in (st.get("bytes") or {}).items():
            gauge("arrowbuf_tier_bytes", "Reserved bytes per memory tier (what the tier holds for the store, rows or "
                  "not)", ["store", "tier"]).add_metric([name, str(tier)], int(nbytes))
        if isinstance(store, Observable):  # a store in this process: per-column placement and what it records
            try:
                table = store.placement().to_pylist()
            except StoreClosed:
                table = []
            for row in table:
                gauge("arrowbuf_column_bytes", "Reserved bytes per column per tier: its arenas (store.placement())",
                      ["store", "column", "tier"]).add_metric([name, str(row["column"]), str(row["tier"])],
                                                              int(row["bytes"]))
            self._observed(name, store.observability(), counter, gauge, hist)

    def _observed(self, name: str, obs: dict[str, Any], counter: Any, gauge: Any, hist: Any) -> None:
        progress = obs.get("progress") or {}
        live = int(progress.get("live", 0))
        produced = int(progress.get("produced", 0))
        for task, p in (progress.get("tasks") or {}).items():
            labels = [name, task]
            for key, doc in (("ready", "Live rows a task can take now (every field written, not consumed)"),
                             ("waiting", "Live rows not consumed by a task that still miss a field filled later"),
                             ("consumed", "Live rows a task took (delivered or dropped as stale)"),
                             ("in_flight", "Rows taken by a task and still being delivered")):
                gauge(f"arrowbuf_task_{key}_rows", doc, ["store", "task_name"]).add_metric(labels, int(p[key]))
            gauge("arrowbuf_task_produced_rows", "Live rows with every field written (the same for every task)",
                  ["store", "task_name"]).add_metric(labels, produced)
            gauge("arrowbuf_partition_production_progress", "Live rows with every field written / live rows "
                  "(tq_partition_production_progress)", ["partition_id", "task_name"]).add_metric(
                [name, task], produced / live if live else 0.0)
            gauge("arrowbuf_partition_consumption_progress", "Live rows a task took / live rows "
                  "(tq_partition_consumption_progress)", ["partition_id", "task_name"]).add_metric(
                [name, task], int(p["consumed"]) / live if live else 0.0)
        for task, lin in (obs.get("lineage") or {}).items():
            counter("arrowbuf_task_stale_dropped", "Rows dropped as stale per task", ["store", "task_name"]
                    ).add_metric([name, task], int(lin["stale"]))
            counts = lin["staleness"]
            buckets, total, acc = [], 0.0, 0
            for s, n in enumerate(counts):
                total += s * n
            for bound in STALENESS_BOUNDS:
                acc = sum(counts[: bound + 1])
                buckets.append((str(float(bound)), acc))
            buckets.append(("+Inf", sum(counts)))
            hist("arrowbuf_consume_staleness", "Staleness (policy versions) of the rows consume() delivered",
                 ["store", "task_name"]).add_metric([name, task], buckets, total)
        for side, n in (obs.get("limiter_waits") or {}).items():
            counter("arrowbuf_rate_limiter_waits", "Calls the rate limiter held back (waited, or timed out), by side",
                    ["store", "side"]).add_metric([name, side], int(n))
        gauge("arrowbuf_lineage_bytes", "Bytes the lineage records take", ["store"]).add_metric(
            [name], int(obs.get("lineage_bytes", 0)))
        for op, t in (obs.get("timings") or {}).items():
            if t["count"]:
                hist("arrowbuf_store_op_duration_seconds", "Latency of store operations (extend, sample, consume, "
                     "update)", ["store", "op_type"]).add_metric([name, op], _buckets(t["buckets"]), t["sum"])
            for outcome, n in t["outcomes"].items():
                counter("arrowbuf_store_op_errors", "Store operations that raised, by error (InsertTimeout: a "
                        "rate limiter or consumer hold; SampleTimeout: nothing to sample in time)",
                        ["store", "op_type", "error"]).add_metric([name, op, outcome], n)
        ck = obs.get("checkpoints") or {}
        counter("arrowbuf_checkpoints", "Checkpoints started", ["store"]).add_metric([name], int(ck.get("count", 0)))
        gauge("arrowbuf_checkpoint_running", "1 while a background checkpoint runs", ["store"]).add_metric(
            [name], 1 if ck.get("running") else 0)
        if ck.get("progress") is not None:
            gauge("arrowbuf_checkpoint_progress_ratio", "Fraction of the row bytes the last background checkpoint "
                  "wrote", ["store"]).add_metric([name], float(ck["progress"]))
        last = ck.get("last") or {}
        for key, doc in (("rows", "Rows in the last checkpoint"), ("bytes_written", "Bytes the last checkpoint "
                         "wrote"), ("seconds", "Seconds the last checkpoint took"),
                         ("at", "Unix time the last checkpoint finished")):
            if last.get(key) is not None:
                gauge(f"arrowbuf_checkpoint_last_{key}", doc, ["store"]).add_metric([name], float(last[key]))

    def _journal(self, name: str, j: dict[str, Any], counter: Any, gauge: Any) -> None:
        """Journal progress of a durable store (`stats()["journal"]`, `arrowbuf.store.durable`)."""
        for key, doc in (("records", "Journal records appended since the store opened its journal"),
                         ("bytes", "Journal bytes appended since the store opened its journal"),
                         ("fsyncs", "fdatasyncs of the journal (group commit: one covers many records)")):
            if key in j:
                counter(f"arrowbuf_journal_{key}", doc, ["store"]).add_metric([name], int(j[key]))
        if "next_lsn" in j and "durable_lsn" in j:
            nxt, durable = int(j["next_lsn"]), int(j["durable_lsn"])
            gauge("arrowbuf_journal_next_lsn", "Log sequence number of the next journal record", ["store"]
                  ).add_metric([name], nxt)
            gauge("arrowbuf_journal_durable_lsn", "Log sequence number of the last journal record durable under "
                  "the policy (it and every record before it survive a crash)", ["store"]).add_metric([name], durable)
            gauge("arrowbuf_journal_pending_records", "Journal records appended and not yet durable", ["store"]
                  ).add_metric([name], max(0, nxt - 1 - durable))

    def _shards(self, name: str, st: dict[str, Any], counter: Any, gauge: Any) -> dict[str, Any]:
        """Per-shard series of a sharded store (label `shard`); returns its stats with the totals the store-level
        series need (capacity, consumed per task, bytes per tier: sums over the shards that answered)."""
        total: dict[str, Any] = dict(st)
        total["capacity"] = 0
        consumed: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        journal: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for k, sh in enumerate(st["shards"]):
            labels = [name, str(k)]
            gauge("arrowbuf_shard_up", "1 when the shard answered the scrape", ["store", "shard"]).add_metric(
                labels, 0 if sh is None else 1)
            if sh is None:
                continue
            total["capacity"] += int(sh.get("capacity", 0) or 0)
            gauge("arrowbuf_shard_rows", "Live rows per shard", ["store", "shard"]).add_metric(
                labels, int(sh.get("size", 0)))
            gauge("arrowbuf_shard_capacity_rows", "Rows each shard holds", ["store", "shard"]).add_metric(
                labels, int(sh.get("capacity", 0) or 0))
            counter("arrowbuf_shard_rows_inserted", "Rows committed per shard", ["store", "shard"]).add_metric(
                labels, int(sh.get("inserts", 0)))
            counter("arrowbuf_shard_rows_sampled", "Items sampled per shard", ["store", "shard"]).add_metric(
                labels, int(sh.get("samples", 0)))
            for task, n in (sh.get("consumed") or {}).items():
                consumed[task] = consumed.get(task, 0) + int(n)
                counter("arrowbuf_shard_rows_consumed", "Rows consumed per shard and task",
                        ["store", "shard", "task_name"]).add_metric([*labels, task], int(n))
            for tier, b in (sh.get("bytes") or {}).items():
                nbytes[tier] = nbytes.get(tier, 0) + int(b)
            for key in ("rows_bytes", "reserved_bytes"):
                sizes[key] = sizes.get(key, 0) + int(sh.get(key, 0) or 0)
            j = sh.get("journal")
            if isinstance(j, dict):  # durable shards: counters summed; lsns are per shard
                for key in ("records", "bytes", "fsyncs"):
                    journal[key] = journal.get(key, 0) + int(j.get(key, 0))
                if "durable_lsn" in j:
                    gauge("arrowbuf_shard_journal_durable_lsn", "Last journal record durable per shard (lsn)",
                          ["store", "shard"]).add_metric(labels, int(j["durable_lsn"]))
        total["consumed"] = consumed
        total["bytes"] = nbytes
        total.update(sizes)
        total.pop("journal", None)
        if journal:
            total["journal"] = journal
        return total

    # ------------------------------------------------------------------ one Flight server
    def _server(self, server: Any, counter: Any, gauge: Any, hist: Any) -> None:
        timings = getattr(server, "timings", None)
        loc = str(getattr(server, "location", ""))
        snap = timings.snapshot() if timings is not None else {}
        for verb, t in snap.items():
            if t["count"]:
                hist("arrowbuf_controller_request_duration_seconds", "Latency of Flight verbs "
                     "(tq_controller_request_duration_seconds)", ["server", "op_type"]).add_metric(
                    [loc, verb], _buckets(t["buckets"]), t["sum"])
            counter("arrowbuf_controller_request", "Flight calls per verb (tq_controller_request_total)",
                    ["server", "op_type"]).add_metric([loc, verb], t["count"])
            errors = sum(t["outcomes"].values())
            counter("arrowbuf_controller_request_errors", "Flight calls that failed (tq_controller_request_errors_"
                    "total)", ["server", "op_type"]).add_metric([loc, verb], errors)
            for outcome, n in t["outcomes"].items():
                kind = LIMIT_KINDS.get(outcome)
                if kind is not None:
                    counter("arrowbuf_server_limit_hits", "Calls refused by the server's limits: busy (no free "
                            "slot), refused (over a bound, invalid), timed_out (SQL deadline)",
                            ["server", "op_type", "kind"]).add_metric([loc, verb, kind], n)
        calls = getattr(server, "calls", None)
        if calls is not None:
            for kind, n in calls.running().items():
                gauge("arrowbuf_server_calls_running", "Calls running now per slot kind", ["server", "kind"]
                      ).add_metric([loc, kind], n)


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    from .timings import BOUNDS

    out: list[tuple[str, float]] = []
    acc = 0
    for bound, n in zip(BOUNDS, counts):
        acc += n
        out.append((repr(float(bound)), acc))
    out.append(("+Inf", acc + counts[-1]))
    return out


class _MetricsHandler(GuardedHandler):
    """GET /metrics (or /): the registry in Prometheus' text format; Host and Origin checked (a browser page cannot
    read it through DNS rebinding), nothing else served."""

    registry: Any

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self.check_request(needs_origin=True):
            return
        if urlsplit(self.path).path not in ("/metrics", "/"):
            self.send_json(404, {"error": "NotFound", "code": "NOT_FOUND", "message": "this server serves /metrics"})
            return
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            body = generate_latest(self.registry)
        except Exception as exc:  # noqa: BLE001 - one failing collector: an answer, not a dropped connection
            self.send_exception(exc, "metrics scrape")
            return
        self.send(200, body, CONTENT_TYPE_LATEST)


class MetricsEndpoint:
    """A running `/metrics` HTTP endpoint (`arrowbuf.serving.http.BoundedHTTPServer` in a daemon thread); see
    `start`.

    Attributes:
        url: `http://host:port/metrics`. collector: the `StoreCollector`. registry: its CollectorRegistry.
        http: the HTTP server (its connections, `refused`).
    """

    def __init__(self, httpd: BoundedHTTPServer, thread: threading.Thread, host: str, collector: StoreCollector,
                 registry: Any) -> None:
        self.http = httpd
        self._thread = thread
        self.collector = collector
        self.registry = registry
        self.host = host
        self.port = int(httpd.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"
        self._closed = False

    @classmethod
    def start(cls, address: str = "127.0.0.1:0", *, stores: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
              servers: list[Any] | None = None, limits: NetLimits | None = None,
              allowed_hosts: tuple[str, ...] = ()) -> MetricsEndpoint:
        """Serve the metrics of `stores` (and `servers`) at `http://address/metrics`.

        Binds 127.0.0.1 unless told otherwise; the endpoint has no authentication (Prometheus' text format is
        read-only), so a non-loopback address warns. Bounded like every arrowbuf server (`limits`: connections at
        once, idle and total timeouts; docs/security.md), and a Host header must name this machine (by a loopback
        name, an IP address, the bound name, or one of `allowed_hosts`).

        Raises:
            MissingDependency: prometheus-client is not installed. InvalidArgument: a malformed address.
            OSError: the port is taken.
        """
        prom = _prometheus()
        host, port = parse_address(address)
        check_bind("metrics", host, None, takes_token=False, stacklevel=3)
        from prometheus_client.process_collector import ProcessCollector

        registry = prom.CollectorRegistry(auto_describe=False)
        collector = StoreCollector(stores, servers)
        registry.register(collector)
        ProcessCollector(registry=registry)  # process_resident_memory_bytes (tq_*_memory_rss_bytes), cpu, fds
        limits = limits or NetLimits()
        handler = type("MetricsHandler", (_MetricsHandler,), {"registry": registry, "limits": limits,
                                                              "guard": RequestGuard(host, allowed_hosts)})
        httpd = BoundedHTTPServer((host, port), handler, limits)
        thread = threading.Thread(target=httpd.serve_forever, name="arrowbuf-metrics", daemon=True)
        thread.start()
        return cls(httpd, thread, host, collector, registry)

    def scrape(self) -> str:
        """The text Prometheus would read now (without HTTP)."""
        prom = _prometheus()
        return str(prom.generate_latest(self.registry).decode())

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.http.close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsEndpoint({self.url!r}{', closed' if self._closed else ''})"
