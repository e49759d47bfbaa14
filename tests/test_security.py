"""Hostile and careless clients against a real Flight server on 127.0.0.1:0 (issue 17).

Each test reproduces one hole the adversarial review found and fails on the pre-hardening tree. The SQL sandbox
is tested through every surface a client reaches: the `sql` ticket (plain Flight and `ab.connect`) and `store.sql`.
docs/security.md is the reader's version of this file.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import arrowbuf as ab
from arrowbuf.flight import protocol as P

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"


def cartpole_batch(n: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([ids] * 4, axis=1), "action": (np.arange(n) % 2).astype(np.int64),
            "reward": np.ones(n, np.float32), "terminated": (np.arange(n) % 10) == 9,
            "truncated": np.zeros(n, bool), "policy_version": np.zeros(n, np.int64),
            "next_obs": np.stack([ids + 0.5] * 4, axis=1)}


def cartpole_store(capacity: int = 1000, rows: int = 100) -> ab.ExperienceStore:
    store = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=capacity, seed=0)
    if rows:
        store.extend(cartpole_batch(rows))
    return store


@pytest.fixture
def servers():
    """Start servers through `start(...)`; every one is closed at teardown, even when the test fails."""
    started: list = []

    def start(stores, **kw):
        kw.setdefault("shutdown_timeout", 1.0)
        server = ab.serve(stores, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def detail(exc: flight.FlightError) -> dict:
    return json.loads(exc.extra_info)


def sql_ticket(query: str) -> flight.Ticket:
    return flight.Ticket(P.encode_ticket(P.TableRequest("sql", query=query)))


# ---------------------------------------------------------------------------------------------------- SQL sandbox
class TestSqlSandbox:
    WAL = ":memory:.wal"

    def test_sql_cannot_write_files_next_to_the_server(self, servers):
        """`COPY ... TO '<cwd>/:memory:.wal'` wrote 64 MiB per query although external access was disabled."""
        server = servers(cartpole_store())
        client = flight.FlightClient(server.location)
        target = Path(os.getcwd()) / self.WAL
        assert not target.exists()
        try:
            for query in (f"COPY (SELECT * FROM range(1000)) TO '{target}' (FORMAT csv)",
                          f"COPY (SELECT 1) TO '{self.WAL}' (FORMAT csv)",
                          f"SELECT * FROM read_text('{target}')",
                          "ATTACH 'evil.db' AS evil", "INSTALL httpfs", "SET lock_configuration=false"):
                with pytest.raises(flight.FlightError) as info:
                    client.do_get(sql_ticket(query)).read_all()
                assert detail(info.value)["error"] == "InvalidArgument", query
                assert not target.exists(), query
                assert not (Path(os.getcwd()) / "evil.db").exists()
        finally:
            for leftover in (target, Path(os.getcwd()) / "evil.db"):
                if leftover.exists():
                    leftover.unlink()
            client.close()

    @pytest.mark.parametrize("query", [
        "SELECT * FROM duckdb_settings()",
        "SELECT name, value FROM system.main.duckdb_settings()",
        "SELECT current_setting('allowed_paths')",
        "SELECT current_setting('home_directory') AS h",
        "SELECT version()",
        "SELECT * FROM pragma_version()",
        "SELECT * FROM information_schema.tables",
        "SELECT * FROM query('SELECT * FROM duckdb_settings()')",
        "SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT 1'))",
    ])
    def test_sql_does_not_leak_paths_settings_or_versions(self, servers, query):
        import duckdb

        server = servers(cartpole_store())
        remote = ab.connect(server.location)
        try:
            table = remote.sql(query)
        except ab.ArrowbufError as exc:  # refused by the sandbox (ab.InvalidArgument): fine, if it says nothing
            assert isinstance(exc, ValueError) and "sql" in str(exc)
            text = str(exc)
        else:
            text = json.dumps(table.to_pylist(), default=str)
        finally:
            remote.close()
        for secret in (os.getcwd(), os.path.expanduser("~"), duckdb.__version__):
            assert secret not in text, (query, text[:300])

    def test_the_sandbox_still_answers_ordinary_queries(self, servers):
        store = cartpole_store()
        server = servers(store)
        remote = ab.connect(server.location)
        try:
            got = remote.sql("WITH e AS (SELECT episode_id, sum(reward) AS r FROM experience GROUP BY 1) "
                             "SELECT count(*) AS n, sum(r) AS total FROM e JOIN range(100) t(i) ON e.episode_id = i")
            assert got.to_pylist() == [{"n": 10, "total": 100.0}]
            assert store.sql("SELECT count(*) AS n FROM experience").column("n")[0].as_py() == 100
            with pytest.raises(ab.InvalidArgument):  # the local surface uses the same sandbox
                store.sql("COPY (SELECT 1) TO 'x.csv'")
        finally:
            remote.close()

    def test_a_query_past_its_deadline_is_stopped(self, servers):
        server = servers(cartpole_store(), sql_limits=ab.SqlLimits(timeout=0.5))
        client = flight.FlightClient(server.location)
        remote = ab.connect(server.location)
        try:
            endless = "SELECT sum(i) FROM range(10000000000000) t(i)"
            with pytest.raises(flight.FlightTimedOutError) as info:
                client.do_get(sql_ticket(endless)).read_all()
            assert detail(info.value)["code"] == "DEADLINE_EXCEEDED"
            with pytest.raises(ab.QueryTimeout, match="deadline"):
                remote.sql("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r")
            assert remote.sql("SELECT count(*) AS n FROM experience").column("n")[0].as_py() == 100
        finally:
            remote.close()
            client.close()

    def test_a_query_stops_when_its_client_goes_away(self, servers):
        server = servers(cartpole_store(), sql_limits=ab.SqlLimits(timeout=600.0))
        client = flight.FlightClient(server.location)
        try:
            with pytest.raises(flight.FlightTimedOutError):
                client.do_get(sql_ticket("SELECT sum(i) FROM range(10000000000000) t(i)"),
                              flight.FlightCallOptions(timeout=0.5)).read_all()
            # the client gave up; the query must not go on for its 600 s deadline
            assert server.wait_idle(timeout=60.0)
        finally:
            client.close()

    def test_memory_and_result_size_limits(self, servers):
        server = servers(cartpole_store(), sql_limits=ab.SqlLimits(memory_limit=16 << 20, max_result_bytes=1 << 20))
        client = flight.FlightClient(server.location)
        remote = ab.connect(server.location)
        try:
            with pytest.raises(flight.FlightError) as info:
                client.do_get(sql_ticket("SELECT * FROM range(50000000) ORDER BY random()")).read_all()
            assert detail(info.value)["code"] == "RESOURCE_EXHAUSTED"
            with pytest.raises(ab.ResourceExhausted, match="memory limit"):
                remote.sql("SELECT list(i) FROM range(50000000) t(i)")
            with pytest.raises(ab.ResourceExhausted, match="result"):
                remote.sql("SELECT * FROM range(10000000)")
            assert remote.sql("SELECT count(*) AS n FROM range(10000000)").column("n")[0].as_py() == 10_000_000
        finally:
            remote.close()
            client.close()

    def test_limits_have_safe_defaults_and_are_validated(self):
        limits = ab.SqlLimits()
        assert limits.timeout is not None and limits.memory_limit is not None and limits.max_result_bytes
        with pytest.raises(ab.InvalidArgument):
            ab.SqlLimits(timeout=-1)
        with pytest.raises(ab.InvalidArgument):
            ab.SqlLimits(memory_limit=10)
        with pytest.raises(ab.InvalidArgument):
            ab.serve(cartpole_store(rows=0), sql_limits={"timeout": 1})

    def test_concurrent_queries_are_bounded(self, servers):
        server = servers(cartpole_store(), max_concurrent_sql=1, sql_limits=ab.SqlLimits(timeout=600.0))
        slow = flight.FlightClient(server.location)
        remote = ab.connect(server.location)
        try:
            def hold() -> None:
                with pytest.raises(flight.FlightError):
                    slow.do_get(sql_ticket("SELECT sum(i) FROM range(10000000000000) t(i)"),
                                flight.FlightCallOptions(timeout=2)).read_all()

            t = threading.Thread(target=hold, daemon=True)
            t.start()
            assert server.calls.wait_for(lambda running: running["sql"] == 1, timeout=30)
            with pytest.raises(ab.ResourceExhausted, match="sql queries"):
                remote.sql("SELECT 1 AS one")
        finally:
            t.join()  # the slow call's own deadline ends it; the server interrupts the query
            slow.close()
            remote.close()
        assert server.wait_idle(timeout=60.0)
