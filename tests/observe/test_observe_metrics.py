"""Prometheus /metrics of a real served store (issue 26): scraped over HTTP while a writer and consumers run, parsed
with prometheus-client's own parser, checked against `stats()` and the known counts."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.observe.identity import acting_as

parser = pytest.importorskip("prometheus_client.parser")

SCHEMA = {"name": "obs", "fields": {
    "prompt_id": {"dtype": "int64"},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"},
    "policy_version": {"dtype": "int64"},
}}
BATCHES, ROWS = 20, 50


def batch(i: int, n: int = ROWS) -> dict:
    return {"prompt_id": np.arange(i * n, (i + 1) * n, dtype=np.int64), "done": np.ones(n, bool),
            "policy_version": np.zeros(n, np.int64)}


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value}, parsed by prometheus-client's own text parser."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    want = frozenset(labels.items())
    hits = [v for (n, lab), v in m.items() if n == name and want <= lab]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_scrape_a_served_store_while_a_writer_and_consumers_run():
    store = ab.ExperienceStore(SCHEMA, capacity=10_000, tasks=["ref", "train"], seed=0)
    with ab.serve(store, "grpc://127.0.0.1:0", metrics="127.0.0.1:0") as server:
        assert server.metrics_url.startswith("http://127.0.0.1:") and server.metrics_url.endswith("/metrics")
        writer_done = threading.Event()
        errors: list[BaseException] = []
        refs: list[int] = []

        def write() -> None:
            try:
                with ab.connect(server.location) as client:
                    for i in range(BATCHES):
                        client.extend(batch(i))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                writer_done.set()

        def ref_stage() -> None:  # takes every row once for "ref" and fills its reward
            try:
                with ab.connect(server.location) as client:
                    while len(refs) < BATCHES * ROWS:
                        b = client.consume("ref", 64, timeout=0.2)
                        if len(b.indices):
                            client.update(b.indices, {"reward": np.ones(len(b.indices), np.float32)})
                            refs.extend(b.indices.tolist())
                        elif writer_done.is_set() and len(refs) >= BATCHES * ROWS:
                            break
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=write), threading.Thread(target=ref_stage)]
        for t in threads:
            t.start()
        seen = []
        while any(t.is_alive() for t in threads):  # scrapes while rows move: always parseable, never going back
            m = scrape(server.metrics_url)
            seen.append(value(m, "arrowbuf_rows_inserted_total", store="obs"))
            assert value(m, "arrowbuf_rows", store="obs") <= BATCHES * ROWS
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert seen == sorted(seen) and seen[-1] <= BATCHES * ROWS

        store.policy_version = 1
        with acting_as("trainer"):
            got = store.consume("train", 300)
        assert len(got.indices) == 300
        with ab.connect(server.location) as client, pytest.raises(ab.InvalidArgument):
            client.sql("SELECT * FROM read_csv('/etc/passwd')")  # refused by the server's SQL sandbox, counted

        m = scrape(server.metrics_url)
        st = store.stats()
        n = BATCHES * ROWS
        assert value(m, "arrowbuf_rows_inserted_total", store="obs") == st["inserts"] == n
        assert value(m, "arrowbuf_bytes_inserted_total", store="obs") == n * store.schema.row_bytes
        assert value(m, "arrowbuf_rows", store="obs") == st["size"] == n
        assert value(m, "arrowbuf_capacity_rows", store="obs") == st["capacity"] == 10_000
        assert value(m, "arrowbuf_fill_ratio", store="obs") == pytest.approx(n / 10_000)
        assert value(m, "arrowbuf_storage_active_keys_total", storage_unit_id="obs") == n
        for tier, nbytes in st["bytes"].items():
            assert value(m, "arrowbuf_tier_bytes", store="obs", tier=tier) == nbytes
        cols = {lab for (name, lab) in m if name == "arrowbuf_column_bytes"}
        assert {dict(lab)["column"] for lab in cols} >= {"prompt_id", "reward", "policy_version"}
        assert value(m, "arrowbuf_rows_consumed_total", store="obs", task_name="ref") == st["consumed"]["ref"] == n
        assert value(m, "arrowbuf_rows_consumed_total", store="obs", task_name="train") == st["consumed"]["train"] \
            == 300
        assert sorted(refs) == list(range(n))
        # per task progress: ref took everything; train took 300 of the 1000 rows, all of which have their reward
        assert value(m, "arrowbuf_task_consumed_rows", store="obs", task_name="ref") == n
        assert value(m, "arrowbuf_task_ready_rows", store="obs", task_name="ref") == 0
        assert value(m, "arrowbuf_task_consumed_rows", store="obs", task_name="train") == 300
        assert value(m, "arrowbuf_task_ready_rows", store="obs", task_name="train") == n - 300
        assert value(m, "arrowbuf_task_waiting_rows", store="obs", task_name="train") == 0
        assert value(m, "arrowbuf_task_in_flight_rows", store="obs", task_name="train") == 0
        assert value(m, "arrowbuf_partition_consumption_progress", partition_id="obs", task_name="train") == \
            pytest.approx(0.3)
        assert value(m, "arrowbuf_partition_production_progress", partition_id="obs", task_name="train") == 1.0
        # staleness at consume: rows of version 0 delivered at version 1 (train), at version 0 (ref)
        assert value(m, "arrowbuf_consume_staleness_bucket", store="obs", task_name="train", le="0.0") == 0
        assert value(m, "arrowbuf_consume_staleness_bucket", store="obs", task_name="train", le="1.0") == 300
        assert value(m, "arrowbuf_consume_staleness_sum", store="obs", task_name="train") == 300
        assert value(m, "arrowbuf_consume_staleness_bucket", store="obs", task_name="ref", le="0.0") == n
        # latency histograms: store operations and Flight verbs
        extends = value(m, "arrowbuf_store_op_duration_seconds_count", store="obs", op_type="extend")
        assert extends == BATCHES
        assert value(m, "arrowbuf_store_op_duration_seconds_bucket", store="obs", op_type="extend", le="+Inf") \
            == BATCHES
        updates = value(m, "arrowbuf_store_op_duration_seconds_count", store="obs", op_type="update")
        assert updates >= 1
        consumes = value(m, "arrowbuf_store_op_duration_seconds_count", store="obs", op_type="consume")
        assert consumes >= 2
        puts = value(m, "arrowbuf_controller_request_total", op_type="DoPut")
        assert puts >= BATCHES + updates
        assert value(m, "arrowbuf_controller_request_duration_seconds_count", op_type="DoPut") == puts
        assert value(m, "arrowbuf_server_limit_hits_total", kind="refused") >= 1
        assert value(m, "arrowbuf_store_up", store="obs") == 1
        assert any(name == "process_resident_memory_bytes" for name, _ in m)
    store.close()


def test_an_in_process_store_serves_its_own_metrics_and_stops():
    store = ab.ExperienceStore(SCHEMA, capacity=1000, seed=0)
    store.extend(batch(0))
    store.sample(7)
    with store.serve_metrics("127.0.0.1:0") as endpoint:
        m = scrape(endpoint.url)
        assert value(m, "arrowbuf_rows_inserted_total", store="obs") == ROWS
        assert value(m, "arrowbuf_rows_sampled_total", store="obs") == 7 == store.stats()["samples"]
        assert value(m, "arrowbuf_store_op_duration_seconds_count", store="obs", op_type="sample") == 1
        url = endpoint.url
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
    store.close()


def test_a_bad_metrics_address_is_refused_before_anything_starts():
    store = ab.ExperienceStore(SCHEMA, capacity=100)
    for bad in ("9100", "127.0.0.1:99999", "127.0.0.1:x"):
        with pytest.raises(ab.InvalidArgument):
            store.serve_metrics(bad)
    store.close()


def test_every_metric_the_grafana_dashboard_plots_is_served(tmp_path):
    import json
    import pathlib
    import re

    dash = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "arrowbuf.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    wanted = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"\b(arrowbuf_\w+)", e)}
    wanted |= {n for e in exprs for n in re.findall(r"\b(process_\w+)", e)}
    store = ab.ExperienceStore(SCHEMA, capacity=1000, tasks=["train"], seed=0)
    with ab.serve(store, "grpc://127.0.0.1:0", metrics="127.0.0.1:0") as server:
        with ab.connect(server.location) as client:
            client.extend(batch(0))
            with pytest.raises(ab.InvalidArgument):
                client.sql("SELECT * FROM read_csv('/etc/passwd')")
        store.update(np.arange(ROWS), {"reward": np.ones(ROWS, np.float32)})
        store.policy_version = 5
        store.consume("train", 10, max_staleness=1)  # all stale: dropped
        store.extend(batch(1))
        store.checkpoint(tmp_path / "a")
        store.checkpoint(tmp_path / "b", background=True).wait()
        with pytest.raises(ab.SampleTimeout):
            empty = ab.ExperienceStore({**SCHEMA, "name": "empty"}, capacity=10)
            server.stores["empty"] = empty  # served too: its failed sample is a store error
            empty.sample(1, timeout=0.01)
        served = {name for name, _ in scrape(server.metrics_url)}
    served |= {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in served}
    missing = sorted(n for n in wanted if n not in served and f"{n}_total" not in served)
    assert not missing, missing
    store.close()
    empty.close()


def test_rate_limiter_waits_are_counted_per_side():
    limiter = ab.rate_limiters.SampleToInsertRatio(1.0, min_size=5, error_buffer=5)
    store = ab.ExperienceStore(SCHEMA, capacity=1000, rate_limiter=limiter, seed=0)
    store.extend(batch(0, n=10))  # inserts 10: the ratio now holds further inserts back until samples come
    with pytest.raises(ab.InsertTimeout):
        store.extend(batch(1, n=1), timeout=0.05)
    gated = ab.ExperienceStore({**SCHEMA, "name": "gated"}, capacity=100, rate_limiter=ab.rate_limiters.MinSize(50))
    gated.extend(batch(0, n=10))
    with pytest.raises(ab.SampleTimeout):
        gated.sample(1, timeout=0.05)
    with MetricsEndpoint_start({"obs": store, "gated": gated}) as ep:
        m = scrape(ep.url)
    assert value(m, "arrowbuf_rate_limiter_waits_total", store="obs", side="insert") == 1
    assert value(m, "arrowbuf_rate_limiter_waits_total", store="obs", side="sample") == 0
    assert value(m, "arrowbuf_rate_limiter_waits_total", store="gated", side="sample") == 1
    assert value(m, "arrowbuf_store_op_errors_total", store="obs", op_type="extend", error="InsertTimeout") == 1
    assert value(m, "arrowbuf_store_op_errors_total", store="gated", op_type="sample", error="SampleTimeout") == 1
    store.close()
    gated.close()


def MetricsEndpoint_start(stores):  # noqa: N802 - reads as the class method it calls
    from arrowbuf.observe.metrics import MetricsEndpoint

    return MetricsEndpoint.start("127.0.0.1:0", stores=stores)


def test_journal_progress_of_a_durable_store_is_served(tmp_path):
    """Records, bytes and fsyncs of the journal (counters) and its next and last durable lsn (gauges) equal
    `stats()["journal"]`; every acknowledged write is durable, so nothing is pending once the writes returned."""
    store = ab.ExperienceStore(SCHEMA, capacity=1000, tasks=["t"], seed=0, durable=str(tmp_path / "run"),
                               durability="group")
    plain = ab.ExperienceStore({**SCHEMA, "name": "plain"}, capacity=100)
    try:
        for i in range(5):
            store.extend(batch(i, n=10))
        store.update(np.arange(10), {"reward": np.ones(10, np.float32)})
        store.consume("t", 8)
        with MetricsEndpoint_start({"obs": store, "plain": plain}) as ep:
            m = scrape(ep.url)
        j = store.stats()["journal"]
        assert j["records"] >= 7  # 5 batches, an update, a consumption (and the task)
        assert value(m, "arrowbuf_journal_records_total", store="obs") == j["records"]
        assert value(m, "arrowbuf_journal_bytes_total", store="obs") == j["bytes"] > 0
        assert value(m, "arrowbuf_journal_fsyncs_total", store="obs") == j["fsyncs"] >= 1
        assert value(m, "arrowbuf_journal_next_lsn", store="obs") == j["next_lsn"]
        assert value(m, "arrowbuf_journal_durable_lsn", store="obs") == j["durable_lsn"] == j["next_lsn"] - 1
        assert value(m, "arrowbuf_journal_pending_records", store="obs") == 0
        assert not [k for k in m if k[0].startswith("arrowbuf_journal") and ("store", "plain") in k[1]]
    finally:
        store.close()
        plain.close()


def test_oldest_first_admission_counts_are_served_per_task():
    """consume(admission="oldest") holds back rows outside the task's version window: the scrape shows what it
    admitted and what waits (ahead of the store's version, or older than the window), equal to stats()."""
    store = ab.ExperienceStore(SCHEMA, capacity=1000, tasks=["train"], seed=0)
    store.policy_version = 5
    for v in (1, 5, 7):  # 1: stale for a window of 2, 5: admissible, 7: ahead of the store
        store.extend({"prompt_id": np.arange(v * 10, v * 10 + 4, dtype=np.int64), "done": np.ones(4, bool),
                      "policy_version": np.full(4, v, np.int64)})
    got = store.consume("train", 100, admission="oldest", max_staleness=2)
    assert len(got) == 4
    want = store.stats()["admission"]["train"]
    with store.serve_metrics("127.0.0.1:0") as endpoint:
        m = scrape(endpoint.url)
    store.close()
    assert value(m, "arrowbuf_task_admitted_rows_total", store="obs", task_name="train") == want["admitted"] == 4
    assert value(m, "arrowbuf_task_admission_waiting_ahead_rows", task_name="train") == want["waiting_ahead"] == 4
    assert value(m, "arrowbuf_task_admission_waiting_stale_rows", task_name="train") == want["waiting_stale"] == 4
    assert value(m, "arrowbuf_task_admission_dropped_rows_total", task_name="train") == want["dropped"] == 0
