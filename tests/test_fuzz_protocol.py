"""Protocol fuzzing: Hypothesis drives every Flight verb of a real server on 127.0.0.1:0 with malformed requests.

Every verb (DoGet tickets of each kind, DoPut descriptors, schemas and batches, DoExchange descriptors and
metadata, DoAction bodies of each action, ListFlights, GetFlightInfo, GetSchema) must answer with success or one
of the protocol's mapped errors: never INTERNAL, never a traceback, never a partial batch, never a file outside the
checkpoint root. Afterwards the server still serves and no call is left running.

The case count comes from a Hypothesis profile: `ci` (the default, bounded for .ci/run) or `long`
(`HYPOTHESIS_PROFILE=long pytest tests/test_fuzz_protocol.py`, see docs/security.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import protocol as P

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci")
                            if os.environ.get("HYPOTHESIS_PROFILE") in ("ci", "long") else "ci")

#: the error classes a malformed request may produce (everything else is a server bug)
MAPPED = {"SchemaError", "InvalidArgument", "StoreNotFound", "SampleTimeout", "QueryTimeout", "ResourceExhausted",
          "ValueError", "TypeError"}
CALL = flight.FlightCallOptions(timeout=60)  # a hung server fails the test instead of hanging it


def _cartpole(n: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([ids] * 4, axis=1), "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
            "terminated": (np.arange(n) % 10) == 9, "truncated": np.zeros(n, bool),
            "policy_version": np.zeros(n, np.int64), "next_obs": np.stack([ids + 0.5] * 4, axis=1)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Two stores behind one server with small limits; the checkpoint root sits in an otherwise empty folder."""
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "ckpt"
    root.mkdir()
    cartpole = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=500, seed=0)
    cartpole.extend(_cartpole(50))
    tokens = ab.ExperienceStore(SCHEMAS / "tokens.yaml", capacity=100, seed=0)
    server = ab.serve({"cartpole": cartpole, "tokens": tokens}, checkpoint_root=root, max_batch_rows=64,
                      max_batch_bytes=1 << 20, max_n_step=16, max_timeout=1.0, shutdown_timeout=1.0,
                      sql_limits=ab.SqlLimits(timeout=2.0, memory_limit=64 << 20, max_result_bytes=1 << 20))
    client = flight.FlightClient(server.location)
    try:
        yield {"stores": {"cartpole": cartpole, "tokens": tokens}, "server": server, "client": client,
               "base": base, "root": root}
    finally:
        client.close()
        server.close()


def _outcome(call, *, schema_verb: bool = False) -> None:
    """The call succeeds, or fails with a mapped error (GetSchema: no status detail, but no traceback either)."""
    try:
        call()
    except pa.ArrowException as exc:
        text = str(exc)
        assert "Traceback" not in text or "<arrowbuf>" in text, text[:500]
        assert str(ROOT) not in text, text[:500]
        if schema_verb:
            assert "internal server error" not in text, text[:500]
            return
        assert isinstance(exc, flight.FlightError), text[:500]
        detail = json.loads(exc.extra_info)
        assert detail["error"] in MAPPED and detail["code"] != "INTERNAL", detail
        assert len(detail["message"]) <= P.MAX_MESSAGE_CHARS + 64


# ---------------------------------------------------------------------------------------------------- strategies
numbers = (st.integers(-2**70, 2**70) | st.floats() | st.sampled_from([0, 1, 2, 64, 65, 10**12, 0.5, 1e6, -1])
           | st.booleans() | st.none())
texts = st.text(max_size=12) | st.sampled_from(["cartpole", "tokens", "obs", "seq", "reward", "x" * 300, ""])
json_values = st.recursive(numbers | texts, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(texts, inner, max_size=3), max_leaves=8)
columns = st.none() | st.lists(st.sampled_from(["obs", "seq", "reward", "next_obs", "episode_id", "bogus", ""]),
                               max_size=4) | json_values
options = st.dictionaries(st.sampled_from(["n_step", "gamma", "shard_info", "bogus", "v"]), numbers | json_values,
                          max_size=3)
queries = st.sampled_from([
    "SELECT count(*) FROM experience", "SELECT * FROM experience LIMIT 3", "SELECT * FROM duckdb_settings()",
    "COPY (SELECT 1) TO 'x.csv'", "SELECT * FROM read_text('/etc/passwd')", "SELECT sum(i) FROM range(1e13) t(i)",
    "SELECT * FROM range(100000000)", "ATTACH 'x.db'", "SET threads=8", "SELECT 1; SELECT 2", "",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r",
]) | st.text(max_size=40)
tickets = st.fixed_dictionaries(
    {"kind": st.sampled_from(["sample", "table", "episodes", "sql"]) | texts},
    optional={"v": st.sampled_from([1, 2, True, None]), "store": texts | numbers, "n": numbers, "columns": columns,
              "timeout": numbers, "options": options | json_values, "query": queries | numbers, "extra": json_values},
)
raw = st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode())
put_commands = st.fixed_dictionaries({}, optional={"kind": st.sampled_from(["extend", "x"]) | texts,
                                                    "store": texts | numbers, "timeout": numbers, "v": numbers,
                                                    "extra": json_values})
session_commands = st.fixed_dictionaries(
    {"kind": st.sampled_from(["session"]) | texts},
    optional={"n": numbers, "store": texts, "columns": columns, "timeout": numbers, "prefetch": numbers,
              "options": options | json_values, "extra": json_values})
exchange_messages = st.fixed_dictionaries(
    {"op": st.sampled_from(["sample", "update_priorities"]) | texts},
    optional={"count": numbers, "indices": st.lists(numbers, max_size=4) | json_values,
              "priorities": st.lists(numbers, max_size=4) | json_values, "extra": json_values})
action_bodies = st.fixed_dictionaries({}, optional={
    "store": texts, "indices": st.lists(numbers, max_size=4) | json_values,
    "priorities": st.lists(numbers, max_size=4) | json_values, "keep": numbers, "v": numbers, "extra": json_values,
    "path": st.sampled_from(["run-1", "../escape", "/tmp/abs", "a/../../b", ".hidden", "ok/deeper", "", "x" * 300])
    | texts})
arrow_types = st.sampled_from([
    pa.float32(), pa.float64(), pa.int64(), pa.int8(), pa.uint64(), pa.bool_(), pa.string(), pa.binary(),
    pa.list_(pa.float32()), pa.list_(pa.int32()), pa.fixed_shape_tensor(pa.float32(), [4]),
    pa.fixed_shape_tensor(pa.float32(), [5]), pa.fixed_shape_tensor(pa.int64(), [4]), pa.list_(pa.float32(), 4),
    pa.null(), pa.dictionary(pa.int8(), pa.string()), pa.struct([("a", pa.int8())]),
])
field_names = st.sampled_from(["obs", "action", "reward", "terminated", "truncated", "policy_version", "next_obs",
                               "episode_id", "actor", "seq", "bogus", "prompt_tokens", "response_tokens",
                               "logprobs", "done"])


def _column(data, typ: pa.DataType, rows: int) -> pa.Array:
    """An Arrow column of `typ`, with random values and sometimes nulls."""
    if isinstance(typ, pa.FixedShapeTensorType):
        size = int(np.prod(typ.shape))
        flat = pa.array(data.draw(st.lists(st.floats(width=32) | st.none(), min_size=rows * size,
                                           max_size=rows * size)), pa.float32()).cast(typ.value_type, safe=False)
        return pa.ExtensionArray.from_storage(typ, pa.FixedSizeListArray.from_arrays(flat, size))
    if pa.types.is_fixed_size_list(typ):
        flat = pa.array(data.draw(st.lists(st.floats(width=32), min_size=rows * 4, max_size=rows * 4)), pa.float32())
        return pa.FixedSizeListArray.from_arrays(flat, 4)
    if pa.types.is_list(typ):
        vals = st.integers(-5, 5) if pa.types.is_integer(typ.value_type) else st.floats(width=32)
        return pa.array(data.draw(st.lists(st.none() | st.lists(vals | st.none(), max_size=3), min_size=rows,
                                           max_size=rows)), typ)
    if pa.types.is_dictionary(typ) or pa.types.is_struct(typ) or pa.types.is_null(typ):
        return pa.nulls(rows, typ)
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        return pa.array(data.draw(st.lists(st.none() | st.text(max_size=4), min_size=rows, max_size=rows))).cast(typ)
    if pa.types.is_boolean(typ):
        return pa.array(data.draw(st.lists(st.none() | st.booleans(), min_size=rows, max_size=rows)), typ)
    if pa.types.is_integer(typ):
        info = np.iinfo(typ.to_pandas_dtype())
        return pa.array(data.draw(st.lists(st.none() | st.integers(int(info.min), int(info.max)), min_size=rows,
                                           max_size=rows)), typ)
    return pa.array(data.draw(st.lists(st.none() | st.floats(), min_size=rows, max_size=rows)), typ)


def _valid_columns(rows: int) -> dict[str, pa.Array]:
    out = {}
    for k, v in _cartpole(rows).items():
        if v.ndim > 1:
            storage = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
            out[k] = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), [v.shape[1]]), storage)
        else:
            out[k] = pa.array(v)
    return out


# ---------------------------------------------------------------------------------------------------- the verbs
class TestFuzzEveryVerb:
    @FUZZ
    @given(ticket=tickets.map(lambda d: json.dumps(d).encode()) | raw)
    def test_do_get(self, target, ticket):
        _outcome(lambda: target["client"].do_get(flight.Ticket(ticket), CALL).read_all())

    @FUZZ
    @given(data=st.data(), use_path=st.booleans(), path=st.lists(texts, max_size=3),
           command=put_commands.map(lambda d: json.dumps(d).encode()) | raw)
    def test_do_put(self, target, data, use_path, path, command):
        store = target["stores"]["cartpole"]
        client = target["client"]
        descriptor = flight.FlightDescriptor.for_path(*path) if use_path else \
            flight.FlightDescriptor.for_command(command)
        rows = data.draw(st.integers(0, 3) | st.just(70))
        cols = _valid_columns(rows)
        for name, typ in data.draw(st.lists(st.tuples(field_names, arrow_types), max_size=3)):
            cols[name] = _column(data, typ, rows)  # replace or add a column of an arbitrary type
        for name in data.draw(st.lists(st.sampled_from(sorted(cols)), max_size=2)):
            cols.pop(name, None)
        batch = pa.RecordBatch.from_pydict(cols) if cols else pa.RecordBatch.from_pydict({"x": pa.nulls(rows)})
        n = len(store)

        def put():
            writer, _ = client.do_put(descriptor, batch.schema, CALL)
            try:
                writer.write_batch(batch)
            finally:
                writer.close()

        _outcome(put)
        assert len(store) in (n, min(n + batch.num_rows, store.capacity))  # all of the batch or nothing

    @FUZZ
    @given(command=session_commands.map(lambda d: json.dumps(d).encode()) | raw,
           messages=st.lists(exchange_messages.map(lambda d: json.dumps(d).encode()) | raw, min_size=1, max_size=3),
           send_batch=st.booleans())
    def test_do_exchange(self, target, command, messages, send_batch):
        client = target["client"]

        def session():
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), CALL)
            try:
                if send_batch:
                    writer.begin(pa.schema([("x", pa.int8())]))
                    writer.write_batch(pa.RecordBatch.from_pydict({"x": pa.array([1], pa.int8())}))
                for m in messages:
                    writer.write_metadata(pa.py_buffer(m))
                writer.done_writing()
                for _ in reader:
                    pass
            finally:
                writer.close()

        _outcome(session)

    @FUZZ
    @given(type_=st.sampled_from(sorted(P.ACTIONS)) | texts,
           body=action_bodies.map(lambda d: json.dumps(d).encode()) | raw)
    def test_do_action(self, target, type_, body):
        _outcome(lambda: list(target["client"].do_action(flight.Action(type_, body), CALL)))
        # a checkpoint lands under the root or nowhere
        assert sorted(p.name for p in target["base"].iterdir()) == ["ckpt"]

    @FUZZ
    @given(criteria=st.binary(max_size=32), use_path=st.booleans(), path=st.lists(texts, max_size=3),
           command=raw)
    def test_list_flights_flight_info_and_schema(self, target, criteria, use_path, path, command):
        client = target["client"]
        descriptor = flight.FlightDescriptor.for_path(*path) if use_path else \
            flight.FlightDescriptor.for_command(command)
        _outcome(lambda: list(client.list_flights(criteria, CALL)))
        _outcome(lambda: client.get_flight_info(descriptor, CALL))
        _outcome(lambda: client.get_schema(descriptor, CALL), schema_verb=True)

    def test_the_server_still_serves_afterwards(self, target):
        server, store = target["server"], target["stores"]["cartpole"]
        assert server.wait_idle(timeout=60)
        remote = ab.connect(server.location, store="cartpole")
        try:
            n = len(store)
            remote.extend(_cartpole(2, start=10_000))
            assert len(store) == min(n + 2, store.capacity)
            assert len(remote.sample(3)) == 3
            assert remote.sql("SELECT count(*) AS n FROM experience").column("n")[0].as_py() == len(store)
        finally:
            remote.close()
