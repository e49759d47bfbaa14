"""Hostile and careless clients against a real Flight server on 127.0.0.1:0 (issue 17).

Each test reproduces one hole the adversarial review found and fails on the pre-hardening tree. The SQL sandbox
is tested through every surface a client reaches: the `sql` ticket (plain Flight and `ab.connect`) and `store.sql`.
docs/security.md is the reader's version of this file.
"""

from __future__ import annotations

import contextlib
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

ROOT = Path(__file__).resolve().parents[2]
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
        with pytest.raises(ab.InvalidArgument, match="unknown server limit"):
            ab.serve(cartpole_store(rows=0), max_batch_rowz=10)
        with pytest.raises(ab.InvalidArgument):
            ab.ServerLimits(max_n_step=0)
        assert ab.ServerLimits().with_overrides(max_n_step=5).max_n_step == 5

    @pytest.mark.slow
    def test_concurrent_queries_are_bounded(self, servers):
        # the slow query ends by the server's own deadline (2 s: long enough to be seen running under any load, as the
        # refusal needs one call on an open connection after the test saw it run)
        server = servers(cartpole_store(), max_concurrent_sql=1, sql_limits=ab.SqlLimits(timeout=2.0))
        slow = flight.FlightClient(server.location)
        remote = ab.connect(server.location)
        try:
            outcome: list = []

            def hold() -> None:
                try:
                    slow.do_get(sql_ticket("SELECT sum(i) FROM range(10000000000000) t(i)"),
                                flight.FlightCallOptions(timeout=120)).read_all()
                except flight.FlightError as exc:
                    outcome.append(detail(exc)["code"])

            t = threading.Thread(target=hold, daemon=True)
            t.start()
            assert server.calls.wait_for(lambda running: running["sql"] == 1, timeout=30)
            with pytest.raises(ab.ResourceExhausted, match="sql queries"):
                remote.sql("SELECT 1 AS one")
        finally:
            t.join()  # the sandbox's deadline ends the slow query
            assert outcome == ["DEADLINE_EXCEEDED"]
            slow.close()
            remote.close()
        assert server.wait_idle(timeout=60.0)


# ---------------------------------------------------------------------------------------------------- request bounds
def sample_ticket(**fields) -> flight.Ticket:
    return flight.Ticket(json.dumps({"v": 1, "kind": "sample", "n": 4, **fields}).encode())


def expect_invalid(call, match: str) -> dict:
    """The call fails with the protocol's INVALID_ARGUMENT status naming `match` (a bounded client deadline makes
    an unbounded server fail the check instead of hanging the test)."""
    with pytest.raises(flight.FlightError) as info:
        call()
    d = detail(info.value)
    assert d["code"] == "INVALID_ARGUMENT" and match in d["message"], d
    return d


class TestRequestBounds:
    def test_numeric_options_are_bounded_and_stated_in_describe(self, servers):
        server = servers(cartpole_store())
        client = flight.FlightClient(server.location)
        deadline = flight.FlightCallOptions(timeout=20)
        try:
            info = json.loads(next(iter(client.do_action(flight.Action("describe", b"")))).body.to_pybytes())
            limits = info["limits"]
            assert limits["max_n_step"] < 10**6 and limits["max_timeout"] <= 24 * 3600
            assert limits["max_batch_bytes"] and limits["sql_limits"]["timeout"]
            # n_step 10**12 burned a core for minutes, holding the GIL
            expect_invalid(lambda: client.do_get(sample_ticket(options={"n_step": 10**12}), deadline).read_all(),
                           "max_n_step")
            expect_invalid(lambda: client.do_get(sample_ticket(timeout=1e6), deadline).read_all(), "max_timeout")
            expect_invalid(lambda: client.do_get(sample_ticket(options={"gamma": 5}), deadline).read_all(), "gamma")
            expect_invalid(lambda: client.do_get(sample_ticket(options={"bogus": 1}), deadline).read_all(), "bogus")
            session = {"v": 1, "kind": "session", "n": 2, "options": {"n_step": 10**9}}
            descriptor = flight.FlightDescriptor.for_command(json.dumps(session).encode())

            def exchange():
                writer, reader = client.do_exchange(descriptor, deadline)
                writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 1}'))
                writer.done_writing()
                reader.read_all()

            expect_invalid(exchange, "max_n_step")
            put = flight.FlightDescriptor.for_command(json.dumps({"kind": "extend", "timeout": 1e6}).encode())

            def doput():
                rb = pa.RecordBatch.from_pydict(_arrow_input(cartpole_batch(2)))
                writer, _ = client.do_put(put, rb.schema, deadline)
                writer.write_batch(rb)
                writer.close()

            expect_invalid(doput, "max_timeout")
            # within the bounds, everything still works
            ok = client.do_get(sample_ticket(options={"n_step": 3, "gamma": 0.9}), deadline).read_all()
            assert ok.num_rows == 4 and "n_step_return" in ok.column_names
        finally:
            client.close()

    def test_shard_info_is_answered_clearly_by_a_server_that_is_no_ray_shard(self, servers):
        """`shard_info` reached ExperienceStore.sample as a keyword: a TypeError quoting the server's internals."""
        from arrowbuf.ray.shard import ShardBackend  # the adapter a Ray shard serves (no Ray needed to build one)

        plain = servers(cartpole_store())
        shard = servers(ShardBackend(cartpole_store(), shard=1, generation=0))
        client = flight.FlightClient(plain.location)
        shard_client = flight.FlightClient(shard.location)
        try:
            describe = json.loads(next(iter(client.do_action(flight.Action("describe", b"")))).body.to_pybytes())
            assert describe["sample_options"] == ["n_step", "gamma"]
            for value in (True, False):
                with pytest.raises(flight.FlightError) as info:
                    client.do_get(sample_ticket(options={"shard_info": value})).read_all()
                d = detail(info.value)
                assert (d["error"], d["code"]) == ("InvalidArgument", "INVALID_ARGUMENT")
                assert "shard_info" in d["message"] and "Ray shard" in d["message"]
                assert "unexpected keyword" not in d["message"]
            with pytest.raises(ab.InvalidArgument, match="shard_info"):
                remote = ab.connect(plain.location)
                try:
                    remote.sample(2, shard_info=True)
                finally:
                    remote.close()
            session = {"v": 1, "kind": "session", "n": 2, "options": {"shard_info": True}}

            def exchange():
                writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(session).encode()))
                writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 1}'))
                writer.done_writing()
                reader.read_all()

            expect_invalid(exchange, "shard_info")
            # a shard's server takes it and adds its sampling-mass columns
            describe = json.loads(next(iter(shard_client.do_action(flight.Action("describe", b""))))
                                  .body.to_pybytes())
            assert describe["sample_options"] == ["n_step", "gamma", "shard_info"]
            table = shard_client.do_get(sample_ticket(options={"shard_info": True})).read_all()
            assert {"_mass", "_shard_mass", "_shard_min", "_shard_size"} <= set(table.column_names)
            # a shard's table stream is chunked like any store's (ShardBackend.iter_table), not one whole copy
            rows = shard_client.do_get(flight.Ticket(P.encode_ticket(P.TableRequest("table")))).read_all()
            assert rows.num_rows == 100 and rows.column("seq").to_pylist() == list(range(100))
        finally:
            client.close()
            shard_client.close()

    def test_consume_verbs_are_bounded_and_their_limits_stated(self, servers):
        """Issue 16's verbs (consume, update, set_policy_version, add_task): every number and string a client sends
        is bounded, the server states each bound in describe, and add_task cannot grow a store's tasks without end
        (each task is a ring-sized record, and eviction waits for every task)."""
        store = ab.ExperienceStore(SCHEMAS / "grpo.yaml", capacity=100, tasks=["train"])
        k = np.arange(8)
        store.extend({"prompt_id": k // 4, "prompt_tokens": [np.arange(3, dtype=np.int32)] * 8,
                      "response_tokens": [np.arange(5, dtype=np.int32)] * 8,
                      "logprobs": [np.zeros(5, np.float32)] * 8, "policy_version": np.zeros(8, np.int64),
                      "done": np.ones(8, bool)})
        server = servers(store, max_tasks=3, max_timeout=5.0, max_batch_rows=16)
        client = flight.FlightClient(server.location)
        deadline = flight.FlightCallOptions(timeout=20)

        def consume(**kw):
            ticket = {"v": 2, "kind": "consume", "task": "train", "n": 2, **kw}
            return client.do_get(flight.Ticket(json.dumps(ticket).encode()), deadline).read_all()

        def action(type_, **body):
            result = next(iter(client.do_action(flight.Action(type_, json.dumps({"v": 2, **body}).encode()),
                                                deadline)))
            return json.loads(result.body.to_pybytes())

        try:
            limits = json.loads(next(iter(client.do_action(flight.Action("describe", b"")))).body.to_pybytes())[
                "limits"]
            assert limits["max_tasks"] == 3 and limits["max_timeout"] == 5.0 and limits["max_batch_rows"] == 16
            assert limits["max_where_chars"] == P.MAX_WHERE_CHARS and limits["max_tokens"] == P.MAX_TOKENS
            assert limits["max_task_chars"] == P.MAX_TASK_CHARS and limits["max_policy_version"] == 2**63 - 1
            expect_invalid(lambda: consume(n=17), "max_batch_rows")
            expect_invalid(lambda: consume(timeout=6.0), "max_timeout")
            expect_invalid(lambda: consume(max_tokens=P.MAX_TOKENS + 1), "max_tokens")
            expect_invalid(lambda: consume(where="seq > 0 " + " " * P.MAX_WHERE_CHARS), "where")
            expect_invalid(lambda: consume(task="t" * (P.MAX_TASK_CHARS + 1)), "task")
            expect_invalid(lambda: consume(max_staleness=2**63), "max_staleness")
            expect_invalid(lambda: action("set_policy_version", policy_version=2**63), "policy_version")
            assert consume(where="prompt_id = 1", max_tokens=10).num_rows == 2  # within the bounds, it works
            assert action("add_task", task="ref")["tasks"] == ["train", "ref"]
            assert action("add_task", task="critic")["tasks"] == ["train", "ref", "critic"]
            with pytest.raises(flight.FlightError) as info:
                action("add_task", task="one-too-many")
            assert detail(info.value)["code"] == "RESOURCE_EXHAUSTED" and "max_tasks" in detail(info.value)["message"]
            assert store.tasks == ["train", "ref", "critic"]
        finally:
            client.close()

    def test_a_consume_filter_runs_under_the_servers_sql_limits(self, servers):
        """consume(where=...) over Flight ran under the sandbox's defaults (10 s, 256 MiB per run), not the limits
        the server states for SQL; now its predicate runs under the server's sql_limits like an `sql` ticket."""
        store = ab.ExperienceStore(SCHEMAS / "grpo.yaml", capacity=100, tasks=["train"])
        k = np.arange(8)
        store.extend({"prompt_id": k // 4, "prompt_tokens": [np.arange(3, dtype=np.int32)] * 8,
                      "response_tokens": [np.arange(5, dtype=np.int32)] * 8,
                      "logprobs": [np.zeros(5, np.float32)] * 8, "policy_version": np.zeros(8, np.int64),
                      "done": np.ones(8, bool)})
        server = servers(store, sql_limits=ab.SqlLimits(timeout=1.0))
        client = flight.FlightClient(server.location)
        slow = "(SELECT count(*) FROM range(1000000000) t(i) WHERE i % 7 = prompt_id % 7) > 0"  # ~10 s a row
        ticket = {"v": 2, "kind": "consume", "task": "train", "n": 2, "where": slow}
        try:
            with pytest.raises(flight.FlightError) as info:
                client.do_get(flight.Ticket(json.dumps(ticket).encode()), flight.FlightCallOptions(timeout=60)
                              ).read_all()
            d = detail(info.value)
            assert d["code"] == "DEADLINE_EXCEEDED" and "1.0 s" in d["message"], d
            assert server.calls.wait_idle(timeout=30) and server.calls.running()["sql"] == 0
            assert store.stats()["consumed"]["train"] == 0  # nothing was consumed by the failed call
        finally:
            client.close()

    @pytest.mark.slow
    def test_consume_filters_count_against_the_sql_query_cap(self, servers):
        """A where= predicate is a sandboxed query like an `sql` ticket: while max_concurrent_sql queries run, a
        consume with a filter is refused (RESOURCE_EXHAUSTED, nothing consumed); one without a filter is not."""
        store = ab.ExperienceStore(SCHEMAS / "grpo.yaml", capacity=100, tasks=["train"])
        k = np.arange(8)
        store.extend({"prompt_id": k // 4, "prompt_tokens": [np.arange(3, dtype=np.int32)] * 8,
                      "response_tokens": [np.arange(5, dtype=np.int32)] * 8,
                      "logprobs": [np.zeros(5, np.float32)] * 8, "policy_version": np.zeros(8, np.int64),
                      "done": np.ones(8, bool)})
        server = servers(store, max_concurrent_sql=1, sql_limits=ab.SqlLimits(timeout=60.0))
        busy = flight.FlightClient(server.location)
        client = flight.FlightClient(server.location)
        def slow_sql():  # holds the only sql slot until its client gives up, after 3 s (the test makes two calls)
            with pytest.raises(flight.FlightTimedOutError):
                busy.do_get(sql_ticket("SELECT count(*) FROM range(100000000000) t(i) WHERE i % 7 = 3"),
                            flight.FlightCallOptions(timeout=3.0)).read_all()

        def consume(**kw):
            ticket = {"v": 2, "kind": "consume", "task": "train", "n": 2, **kw}
            return client.do_get(flight.Ticket(json.dumps(ticket).encode()), flight.FlightCallOptions(timeout=30)
                                 ).read_all()

        thread = threading.Thread(target=slow_sql)
        thread.start()
        try:
            assert server.calls.wait_for(lambda running: running["sql"] == 1, timeout=30)
            with pytest.raises(flight.FlightError) as info:
                consume(where="prompt_id = 0")
            assert detail(info.value)["code"] == "RESOURCE_EXHAUSTED", detail(info.value)
            assert store.stats()["consumed"]["train"] == 0
            assert consume().num_rows == 2  # no filter, no sql slot
        finally:
            thread.join(60)  # the query stops when its client goes away
            busy.close()
        assert server.calls.wait_for(lambda running: running["sql"] == 0, timeout=30)
        assert consume(where="prompt_id = 1").num_rows == 2
        client.close()

    def test_empty_column_list_is_refused_not_undecodable(self, servers):
        server = servers(cartpole_store())
        client = flight.FlightClient(server.location)
        remote = ab.connect(server.location)
        try:
            expect_invalid(lambda: client.do_get(sample_ticket(columns=[])).read_all(), "columns")
            with pytest.raises(ab.InvalidArgument):
                remote.sample(4, columns=[])
            assert len(remote.sample(4, columns=["reward"])) == 4
        finally:
            remote.close()
            client.close()


def _arrow_input(cols: dict[str, np.ndarray]) -> dict[str, pa.Array]:
    out = {}
    for k, v in cols.items():
        out[k] = pa.FixedShapeTensorArray.from_numpy_ndarray(v) if v.ndim > 1 else pa.array(v)
    return out


# ---------------------------------------------------------------------------------------------------- DoPut
class TestDoPutValidation:
    def test_the_schema_message_is_checked_before_any_batch(self, servers):
        """A 1 GiB batch of the wrong dtype was read whole before it was rejected: now the stream's schema is."""
        store = cartpole_store()
        server = servers(store)
        client = flight.FlightClient(server.location)
        good = _arrow_input(cartpole_batch(2))
        wrong = [
            ("obs", pa.field("obs", pa.string())),                                  # wrong type
            ("obs", pa.field("obs", pa.fixed_shape_tensor(pa.float32(), [5]))),     # wrong shape
            ("action", pa.field("action", pa.float64())),                           # float -> int64 would round
            ("reward", pa.field("reward", pa.list_(pa.float32()))),                 # ragged for a scalar
        ]
        try:
            for name, bad_field in wrong:
                fields = [bad_field if f == name else pa.field(f, good[f].type) for f in good]
                writer, _ = client.do_put(P.store_descriptor("cartpole"), pa.schema(fields))
                with pytest.raises(flight.FlightError) as info:  # no batch sent: the schema alone is refused
                    writer.close()
                d = detail(info.value)
                assert d["error"] == "SchemaError" and repr(name) in d["message"], d
            assert len(store) == 100
        finally:
            client.close()

    def test_a_message_over_the_byte_limit_is_refused(self, servers):
        """One DoPut message over max_batch_bytes is refused; `RemoteStore.extend` sends such a batch in parts
        (protocol 3, tests/flight/test_flight_parts.py), each within the limit."""
        store = cartpole_store()
        server = servers(store, max_batch_bytes=4096)
        remote = ab.connect(server.location)
        client = flight.FlightClient(server.location)
        try:
            rb = remote.to_batch(cartpole_batch(200))
            with pytest.raises(flight.FlightError, match="max_batch_bytes"):
                writer, reader = client.do_put(P.put_descriptor(None), rb.schema)
                writer.write_batch(rb)
                writer.done_writing()
                reader.read()
                writer.close()
            assert len(store) == 100  # the rows the store was made with
            remote.extend(cartpole_batch(200))  # in parts
            remote.extend(cartpole_batch(10))
            assert len(store) == 310
        finally:
            client.close()
            remote.close()

    def test_duplicate_columns_and_bad_actor_values_are_bad_input(self, servers):
        store = cartpole_store()
        server = servers(store)
        client = flight.FlightClient(server.location)
        cols = _arrow_input(cartpole_batch(3))
        try:
            names = [*cols, "reward"]
            dup = pa.RecordBatch.from_arrays([*cols.values(), cols["reward"]], names=names)
            with pytest.raises(ab.SchemaError, match="duplicate"):
                store.extend(dup)
            writer, _ = client.do_put(P.store_descriptor("cartpole"), dup.schema)
            with pytest.raises(flight.FlightError) as info:
                writer.write_batch(dup)
                writer.close()
            assert detail(info.value)["error"] == "SchemaError"
            for actor in ([None, "a", "b"], [1, "a", 2.5]):
                with pytest.raises(ab.SchemaError, match="actor"):
                    store.extend({**cartpole_batch(3), "actor": np.array(actor, dtype=object)})
            rb = pa.RecordBatch.from_pydict({**cols, "actor": pa.array(["a", None, "b"])})
            writer, _ = client.do_put(P.store_descriptor("cartpole"), rb.schema)
            with pytest.raises(flight.FlightError) as info:
                writer.write_batch(rb)
                writer.close()
            assert detail(info.value)["code"] == "INVALID_ARGUMENT"
            assert len(store) == 100
        finally:
            client.close()


# ---------------------------------------------------------------------------------------------------- silent changes
class TestNoSilentValueChanges:
    def test_nulls_inside_tensors_and_ragged_lists_are_refused(self, servers):
        store = cartpole_store()
        server = servers(store)
        remote = ab.connect(server.location)
        cols = _arrow_input(cartpole_batch(2))
        storage = pa.FixedSizeListArray.from_arrays(pa.array([1.0, None, 3.0, 4.0] * 2, pa.float32()), 4)
        cols["obs"] = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), [4]), storage)
        try:
            with pytest.raises(ab.SchemaError, match="null"):
                store.extend(pa.RecordBatch.from_pydict(cols))
            with pytest.raises(ab.SchemaError, match="null"):
                remote.extend(pa.RecordBatch.from_pydict(cols))
            assert len(store) == 100
            tokens = ab.ExperienceStore(SCHEMAS / "tokens.yaml", capacity=100)
            row = {"prompt_tokens": pa.array([[1, None, 3]], pa.list_(pa.int32())),
                   "response_tokens": pa.array([[4]], pa.list_(pa.int32())),
                   "logprobs": pa.array([[0.5]], pa.list_(pa.float32())), "reward": pa.array([1.0], pa.float32()),
                   "done": pa.array([True]), "policy_version": pa.array([0])}
            with pytest.raises(ab.SchemaError, match="null"):
                tokens.extend(pa.RecordBatch.from_pydict(row))
            assert len(tokens) == 0
        finally:
            remote.close()

    def test_out_of_range_values_are_refused(self):
        store = cartpole_store(rows=0)
        with pytest.raises(ab.SchemaError, match="episode_id"):
            store.extend({**cartpole_batch(2), "episode_id": np.array([2**64 - 1, 1], np.uint64)})
        big = cartpole_batch(2)
        big["reward"] = np.array([1e300, 1.0])  # float64 into a float32 field: was stored as inf
        with pytest.raises(ab.SchemaError, match="range"):
            store.extend(big)
        assert len(store) == 0
        strict = ab.ExperienceStore({"name": "strict", "fields": {"x": {"dtype": "float32", "allow_nan": False}}},
                                    capacity=10)
        for bad in (np.inf, -np.inf, np.nan):
            with pytest.raises(ab.SchemaError, match="allow_nan"):
                strict.extend({"x": np.array([1.0, bad], np.float32)})
        strict.extend({"x": np.array([1.0, 2.0], np.float32)})
        assert len(strict) == 2


# ---------------------------------------------------------------------------------------------------- streams, calls
def atari_store(rows: int) -> ab.ExperienceStore:
    store = ab.ExperienceStore(SCHEMAS / "atari.yaml", capacity=rows, seed=0)
    obs = np.full((rows, 4, 84, 84), 3, np.uint8)
    term = np.zeros(rows, bool)
    term[-1] = True
    store.extend({"obs": obs, "action": np.zeros(rows, np.int64), "reward": np.zeros(rows, np.float32),
                  "terminated": term, "truncated": np.zeros(rows, bool), "next_obs": obs})
    return store


class TestStreamsAndCalls:
    def test_table_streams_chunks_and_is_bounded(self, servers):
        """10 slow readers of a 101 MB store took the server from 188 MB to 1.4 GB: each request copied it all."""
        store = atari_store(2000)  # ~56 MB: more than gRPC buffers for a reader that does not read
        server = servers(store, max_table_streams=1)
        ticket = flight.Ticket(P.encode_ticket(P.TableRequest("table", columns=["obs", "seq"])))
        slow = flight.FlightClient(server.location)
        other = flight.FlightClient(server.location)
        try:
            reader = slow.do_get(ticket)
            first = reader.read_chunk().data
            assert 0 < first.num_rows < 2000  # chunks, not one table
            with pytest.raises(flight.FlightError) as info:  # the slow reader holds the only table slot
                other.do_get(ticket).read_all()
            assert detail(info.value)["code"] == "RESOURCE_EXHAUSTED"
            rest = reader.read_all()
            assert first.num_rows + rest.num_rows == 2000
            assert rest.column("seq").to_pylist()[-1] == 1999
            assert server.calls.wait_for(lambda running: running["table"] == 0, timeout=30)
            assert other.do_get(ticket).read_all().num_rows == 2000
        finally:
            slow.close()
            other.close()

    def test_a_reader_that_goes_away_frees_its_table_slot(self, servers):
        store = atari_store(2000)
        server = servers(store, max_table_streams=1)
        ticket = flight.Ticket(P.encode_ticket(P.TableRequest("table", columns=["obs"])))
        slow = flight.FlightClient(server.location)
        reader = slow.do_get(ticket)
        reader.read_chunk()
        slow.close()  # gone mid-stream
        del reader
        assert server.calls.wait_for(lambda running: running["table"] == 0, timeout=60)

    def test_concurrent_calls_are_bounded(self, servers):
        """One thread per call with no cap: past its slots a call is refused at once; open streams (sessions,
        uploads) take at most `stream_slots` of the calls, so short calls are still served (issue 30)."""
        server = servers(cartpole_store(), max_concurrent_calls=3)
        client = flight.FlightClient(server.location)
        descriptor = P.session_descriptor(P.SessionRequest(2, prefetch=0))
        sessions = []
        try:
            for _ in range(server.limits.stream_slots):  # open sessions hold their calls
                writer, reader = client.do_exchange(descriptor)
                writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 1}'))
                assert reader.read_chunk().data.num_rows == 2
                sessions.append((writer, reader))
            assert server.calls.running()["call"] == 2
            writer, reader = client.do_exchange(descriptor)  # one stream more than its slots
            with pytest.raises(flight.FlightError) as info:
                reader.read_chunk()
            assert detail(info.value)["code"] == "RESOURCE_EXHAUSTED"
            with contextlib.suppress(flight.FlightError):
                writer.close()
            assert json.loads(next(iter(client.do_action(flight.Action("len", b"")))).body.to_pybytes()) == {
                "len": 100}  # a short call still has a slot
            for writer, _ in sessions:
                writer.done_writing()
                writer.close()
            sessions.clear()
            assert server.wait_idle(timeout=30)
            assert json.loads(next(iter(client.do_action(flight.Action("len", b"")))).body.to_pybytes()) == {
                "len": 100}
        finally:
            for writer, _ in sessions:
                writer.close()
            client.close()

    def test_get_schema_errors_carry_no_traceback_or_server_paths(self, servers):
        server = servers(cartpole_store())
        client = flight.FlightClient(server.location)
        try:
            for descriptor in (flight.FlightDescriptor.for_path("nope"), flight.FlightDescriptor.for_command(b"x"),
                               flight.FlightDescriptor.for_path("cartpole", "x" * 5000)):
                with pytest.raises(pa.ArrowException) as info:
                    client.get_schema(descriptor)
                text = str(info.value)
                assert str(ROOT) not in text and ".py\"" not in text, text
                assert len(text) < 2000
        finally:
            client.close()

    def test_error_messages_truncate_long_client_values(self, servers):
        server = servers(cartpole_store())
        client = flight.FlightClient(server.location)
        long = "x" * 100_000
        try:
            for call in (lambda: client.do_get(sample_ticket(columns=[long[:1000]])).read_all(),
                         lambda: client.do_get(flight.Ticket(json.dumps({"kind": "sample", "n": 1, long: 1})
                                                             .encode())).read_all(),
                         lambda: client.do_get(sql_ticket(f"SELECT {long}")).read_all(),
                         lambda: next(iter(client.do_action(flight.Action("describe",
                                                                          json.dumps({"store": long}).encode()))))):
                with pytest.raises(flight.FlightError) as info:
                    call()
                assert len(detail(info.value)["message"]) < 2000
        finally:
            client.close()


# ---------------------------------------------------------------------------------------------------- shutdown
STALLED_LEARNER = r"""
import json, sys, time, pyarrow as pa, pyarrow.flight as flight
client = flight.FlightClient(sys.argv[1])
cmd = {"v": 1, "kind": "session", "n": 2000, "prefetch": 0}
writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()))
writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 16}'))  # 16 batches of 56 MB; it reads one
assert reader.read_chunk().data.num_rows == 2000   # the next one is larger than every buffer on the way
print("stalling", flush=True)
sys.stdin.read()   # until the test ends
"""


@pytest.mark.slow
def test_a_learner_that_never_reads_cannot_hold_arrowbuf_serve_open(tmp_path):
    """After SIGTERM, `arrowbuf serve` stayed alive as long as a session that reads nothing stayed connected."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "arrowbuf.cli", "serve", "--schema", str(SCHEMAS / "atari.yaml"),
            "--capacity", "100", "--port", "0"]
    server = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    learner = None
    try:
        line = server.stdout.readline().decode()
        assert "serving" in line, server.stderr.read().decode()
        location = line.split(" at ")[1].strip()
        remote = ab.connect(location)
        obs = np.zeros((100, 4, 84, 84), np.uint8)
        remote.extend({"obs": obs, "action": np.zeros(100, np.int64), "reward": np.zeros(100, np.float32),
                       "terminated": np.zeros(100, bool), "truncated": np.zeros(100, bool)})
        remote.close()
        learner = subprocess.Popen([sys.executable, "-c", STALLED_LEARNER, location], env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert learner.stdout.readline().strip() == b"stalling", learner.stderr.read().decode()
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0  # shutdown_timeout (2 s) bounds it; it hung until the learner went away
    finally:
        for p in (server, learner):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                for pipe in (p.stdin, p.stdout, p.stderr):
                    if pipe is not None:
                        pipe.close()


EMBEDDED_SERVER = r"""
import signal, sys
import numpy as np
import arrowbuf as ab

how = sys.argv[2]
store = ab.ExperienceStore(sys.argv[1], capacity=2000)
store.extend({"obs": np.zeros((2000, 4, 84, 84), np.uint8), "action": np.zeros(2000, np.int64),
              "reward": np.zeros(2000, np.float32), "terminated": np.zeros(2000, bool),
              "truncated": np.zeros(2000, bool)})
server = ab.serve(store, "grpc://127.0.0.1:0", shutdown_timeout=1.0)
print(server.location, flush=True)
if how.startswith("sigterm"):  # the usual embedding: a signal handler closes the server, main waits for it
    signal.signal(signal.SIGTERM, lambda signum, frame: server.close())
    if how == "sigterm-other-thread":  # the kernel hands the signal to one of gRPC's threads, not to main
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    server.wait()
elif how == "with":           # a with block that ends
    with server:
        sys.stdin.readline()
else:                         # "exit": main returns without closing; the interpreter's exit has to stop it
    sys.stdin.readline()
print("main returned", flush=True)
"""


def _stall_session(client: flight.FlightClient):
    """A learner session that asks for 16 batches of 56 MB, reads one and then nothing."""
    descriptor = P.session_descriptor(P.SessionRequest(2000, prefetch=0))
    writer, reader = client.do_exchange(descriptor)
    writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 16}'))
    assert reader.read_chunk().data.num_rows == 2000  # the next one is larger than every buffer on the way
    return writer, reader


def _stall_table(client: flight.FlightClient):
    """A `table` reader (56 MB of obs) that reads one chunk and then nothing."""
    reader = client.do_get(flight.Ticket(P.encode_ticket(P.TableRequest("table", columns=["obs"]))))
    assert reader.read_chunk().data.num_rows > 0
    return reader


@pytest.mark.slow
@pytest.mark.parametrize("stall", [_stall_session, _stall_table], ids=["session", "table"])
@pytest.mark.parametrize("how", ["exit", "with", "sigterm", "sigterm-other-thread"])
def test_a_client_that_never_reads_cannot_hold_an_embedded_server(how, stall):
    """`ab.serve` in a user's process: the process hung at exit (pyarrow's own shutdown waits for every call, and a
    call whose client reads nothing never ends) after `close()`, SIGTERM or returning from main. A SIGTERM the kernel
    gave another thread (CI saw it once under load; forced here by blocking it in main) left `server.wait()` asleep,
    so the handler that closes the server never ran."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", EMBEDDED_SERVER, str(SCHEMAS / "atari.yaml"), how], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = None
    try:
        location = proc.stdout.readline().decode().strip()
        assert location.startswith("grpc://"), proc.stderr.read().decode()
        client = flight.FlightClient(location)
        held = stall(client)
        if how.startswith("sigterm"):
            proc.send_signal(signal.SIGTERM)
        else:
            proc.stdin.write(b"exit\n")
            proc.stdin.flush()
        # the failure detector: the process exits (shutdown_timeout is 1 s); it hung until the client went away
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
        assert b"main returned" in proc.stdout.read()
        del held
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if client is not None:
            client.close()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


TABLE_SERVER = r"""
import sys
import numpy as np
import arrowbuf as ab

rows = int(sys.argv[2])
store = ab.ExperienceStore(sys.argv[1], capacity=rows)
for start in range(0, rows, 1000):  # row k: action k, every obs byte k % 251
    k = np.arange(start, start + 1000)
    store.extend({"obs": np.broadcast_to((k % 251).astype(np.uint8)[:, None, None, None], (1000, 4, 84, 84)),
                  "action": k, "reward": k.astype(np.float32), "terminated": np.zeros(1000, bool),
                  "truncated": np.zeros(1000, bool)})
server = ab.serve(store, "grpc://127.0.0.1:0", max_table_streams=4, shutdown_timeout=1.0)
print(server.location, flush=True)
with server:
    sys.stdin.readline()
"""


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _check_rows(batch: pa.RecordBatch) -> None:
    """Every row as committed: obs bytes, action and seq all name the same row (a torn row would mix two)."""
    action = batch.column("action").to_numpy()
    seq = batch.column("seq").to_numpy()
    obs = batch.column("obs").to_numpy_ndarray().reshape(batch.num_rows, -1)
    np.testing.assert_array_equal(seq, action)
    np.testing.assert_array_equal(obs.min(axis=1), action % 251)
    np.testing.assert_array_equal(obs.max(axis=1), action % 251)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_slow_table_readers_hold_about_a_chunk_each_and_read_consistent_rows():
    """10 slow readers of a 101 MB store took the server from 188 MB to 1.4 GB: each `table` stream copied the whole
    store. Four readers that each read one chunk and stall must not cost the server a copy of the store each."""
    import subprocess
    import sys

    rows = 10_000  # 282 MB of obs
    store_bytes = rows * 4 * 84 * 84
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", TABLE_SERVER, str(SCHEMAS / "atari.yaml"), str(rows)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    clients: list = []
    try:
        location = proc.stdout.readline().decode().strip()
        assert location.startswith("grpc://"), proc.stderr.read().decode()
        before = _rss_bytes(proc.pid)
        ticket = flight.Ticket(P.encode_ticket(P.TableRequest("table", columns=["obs", "action", "seq"])))
        readers = []
        for _ in range(4):
            clients.append(flight.FlightClient(location))
            readers.append(clients[-1].do_get(ticket))
            first = readers[-1].read_chunk().data
            assert 0 < first.num_rows < rows  # chunks, not the table in one message
            _check_rows(first)
        grown = _rss_bytes(proc.pid) - before
        # a copy per stream was 4 x 282 MB; a chunk per stream (plus what gRPC buffers) is a few MB each
        assert grown < store_bytes // 2, f"server RSS grew {grown >> 20} MiB for 4 stalled table streams"

        writer = ab.connect(location)  # a writer runs while the readers go on: every row they read is as committed
        clients.append(writer)
        done = threading.Event()
        wrote: list = []

        def write() -> None:
            k = rows
            while not done.is_set() and k < 2 * rows:  # one turn of the ring
                ids = np.arange(k, k + 200)
                writer.extend({"obs": np.broadcast_to((ids % 251).astype(np.uint8)[:, None, None, None],
                                                      (200, 4, 84, 84)),
                               "action": ids, "reward": ids.astype(np.float32),
                               "terminated": np.zeros(200, bool), "truncated": np.zeros(200, bool)})
                k += 200
            wrote.append(k)

        thread = threading.Thread(target=write)
        thread.start()
        try:
            for reader in readers:
                last = -1
                for chunk in reader:
                    _check_rows(chunk.data)
                    seq = chunk.data.column("seq").to_numpy()
                    assert seq[0] > last and np.all(np.diff(seq) == 1)  # oldest first; a gap only between chunks
                    last = int(seq[-1])
                # nothing newer than the request; rows the writer evicted before the stream reached them are
                # skipped (a gap in seq), never sent torn
                assert 0 <= last < rows
        finally:
            done.set()
            thread.join(60)
        assert wrote and wrote[0] > rows
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.stdin.write(b"exit\n")
            proc.stdin.flush()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


PUT_SERVER = r"""
import sys
import arrowbuf as ab

store = ab.ExperienceStore(sys.argv[1], capacity=100)
server = ab.serve(store, "grpc://127.0.0.1:0", token="s3cret", max_batch_bytes=1 << 20)
print(server.location, flush=True)
with server:
    sys.stdin.readline()
"""


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_an_unauthenticated_put_is_refused_before_its_batch_is_received():
    """What docs/security.md promises about DoPut memory: the token is checked from the call's headers, before the
    first message is read, so a client without it cannot make the server receive a large batch (a client with it
    can, once per stream, up to the message's size: gRPC's receive size is not settable through pyarrow)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", PUT_SERVER, str(SCHEMAS / "tokens.yaml")], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = None
    try:
        location = proc.stdout.readline().decode().strip()
        assert location.startswith("grpc://"), proc.stderr.read().decode()
        client = flight.FlightClient(location)
        before = _peak_rss_bytes(proc.pid)
        n = 50_000_000  # one row with a 200 MB ragged value
        one = pa.array([0, 1], pa.int32())
        batch = pa.RecordBatch.from_pydict({
            "prompt_tokens": pa.ListArray.from_arrays(one, pa.array([1], pa.int32())),
            "response_tokens": pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.array(np.zeros(n, np.int32))),
            "logprobs": pa.ListArray.from_arrays(one, pa.array([0.0], pa.float32())),
            "reward": pa.array([0.0], pa.float32()), "done": pa.array([True]),
            "policy_version": pa.array([0], pa.int64())})
        with pytest.raises(flight.FlightUnauthenticatedError):
            writer, _ = client.do_put(flight.FlightDescriptor.for_path("tokens"), batch.schema)
            writer.write_batch(batch)
            writer.done_writing()
            writer.close()
        grown = _peak_rss_bytes(proc.pid) - before
        assert grown < 64 << 20, f"the server's peak RSS grew {grown >> 20} MiB for a refused call"
        opts = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer s3cret")])
        with pytest.raises(flight.FlightError) as info:  # with the token: received, then refused by the byte limit
            writer, _ = client.do_put(flight.FlightDescriptor.for_path("tokens"), batch.schema, options=opts)
            writer.write_batch(batch)
            writer.done_writing()
            writer.close()
        assert "max_batch_bytes" in str(info.value)
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.stdin.write(b"exit\n")
            proc.stdin.flush()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
