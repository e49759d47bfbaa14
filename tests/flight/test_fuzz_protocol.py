"""Protocol fuzzing: Hypothesis drives every Flight verb of a real server on 127.0.0.1:0 with malformed requests.

Every verb (DoGet tickets of each kind, DoPut descriptors, schemas and batches, DoExchange descriptors and
metadata, DoAction bodies of each action, ListFlights, GetFlightInfo, GetSchema) must answer with success or one
of the protocol's mapped errors: never INTERNAL, never a traceback, never a partial batch, never a file outside the
checkpoint root. Afterwards the server still serves and no call is left running.

The case count comes from a Hypothesis profile: `ci` (the default, bounded for .ci/run) or `long`
(`HYPOTHESIS_PROFILE=long pytest tests/flight/test_fuzz_protocol.py`, see docs/security.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import protocol as P

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci")
                            if os.environ.get("HYPOTHESIS_PROFILE") in ("ci", "long") else "ci")

#: the error classes a malformed request may produce (everything else is a server bug)
MAPPED = {"SchemaError", "InvalidArgument", "LeaseError", "StoreNotFound", "SampleTimeout", "QueryTimeout",
          "ResourceExhausted", "ValueError", "TypeError"}
CALL = flight.FlightCallOptions(timeout=60)  # a hung server fails the test instead of hanging it


def _cartpole(n: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([ids] * 4, axis=1), "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
            "terminated": (np.arange(n) % 10) == 9, "truncated": np.zeros(n, bool),
            "policy_version": np.zeros(n, np.int64), "next_obs": np.stack([ids + 0.5] * 4, axis=1)}


def _grpo(n: int, start: int = 0) -> dict:
    """Rows of schemas/grpo.yaml without the fields filled later (reward, ref_logprobs)."""
    k = np.arange(start, start + n)
    return {"prompt_id": k // 4, "prompt_tokens": [np.arange(3, dtype=np.int32)] * n,
            "response_tokens": [np.arange(1 + i % 5, dtype=np.int32) for i in range(n)],
            "logprobs": [np.zeros(1 + i % 5, np.float32) for i in range(n)],
            "policy_version": np.zeros(n, np.int64), "done": np.ones(n, bool)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Two stores behind one server with small limits; the checkpoint root sits in an otherwise empty folder."""
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "ckpt"
    root.mkdir()
    cartpole = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=500, seed=0)
    cartpole.extend(_cartpole(50))
    tokens = ab.ExperienceStore(SCHEMAS / "tokens.yaml", capacity=100, seed=0)
    grpo = ab.ExperienceStore(SCHEMAS / "grpo.yaml", capacity=200, seed=0, tasks=["ref", "train"])
    grpo.extend(_grpo(40))
    server = ab.serve({"cartpole": cartpole, "tokens": tokens, "grpo": grpo}, checkpoint_root=root, max_batch_rows=64,
                      max_batch_bytes=1 << 20, max_n_step=16, max_timeout=1.0, shutdown_timeout=1.0,
                      sql_limits=ab.SqlLimits(timeout=2.0, memory_limit=64 << 20, max_result_bytes=1 << 20))
    client = flight.FlightClient(server.location)
    try:
        yield {"stores": {"cartpole": cartpole, "tokens": tokens, "grpo": grpo}, "server": server, "client": client,
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
wheres = st.sampled_from([
    "reward > 0", "reward IS NULL", "policy_version >= 0 AND prompt_id % 2 = 0", "seq > 10", "1) UNION SELECT 1 (",
    "len(response_tokens) > 2", "read_text('/etc/passwd') IS NOT NULL", "current_setting('home_directory') <> ''",
    "true; COPY (SELECT 1) TO 'x.csv'", "x" * 5000, "", " ", "bogus_column = 1",
]) | st.text(max_size=30)
_DELETE = object()


def mutated(base: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """Well-formed requests from `base`, with up to two keys replaced, added or deleted (none in the simplest
    examples, so that many requests reach the store and the mutations probe every check on the way)."""
    values = numbers | json_values | wheres | st.just(_DELETE)

    def apply(pair):
        request, changes = pair
        out = dict(request)
        for key, value in changes:
            if value is _DELETE:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    return st.tuples(base, st.lists(st.tuples(st.sampled_from(keys) | texts, values), max_size=2)).map(apply)


CONSUME_KEYS = ["v", "kind", "store", "task", "n", "require", "timeout", "max_staleness", "where", "max_tokens",
                "lease", "admission"]
consume_tickets = mutated(st.fixed_dictionaries(
    {"v": st.just(2), "kind": st.just("consume"), "store": st.just("grpo"), "task": st.sampled_from(["ref", "train"]),
     "n": st.integers(1, 8)},
    optional={"require": st.lists(st.sampled_from(["reward", "ref_logprobs", "prompt_id"]), max_size=2, unique=True),
              "timeout": st.sampled_from([0, 0.01]), "max_staleness": st.integers(0, 3),
              "where": st.sampled_from(["reward > 0", "reward IS NULL", "prompt_id % 2 = 0", "seq > 10"]),
              "max_tokens": st.integers(1, 100),
              "lease": st.sampled_from([0.05, 0.5, 0, -1, 1e9, float("inf"), "1", True]),
              "admission": st.sampled_from(["oldest", "newest", "", 1, None, ["oldest"]]) | texts}), CONSUME_KEYS)
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
    | texts, "policy_version": numbers | json_values, "task": st.sampled_from(["ref", "new", "x" * 300, ""]) | texts
    | numbers})
#: the issue-16 actions (protocol version 2), well-formed before mutation
llm_actions = st.one_of(
    st.tuples(st.just("set_policy_version"), mutated(st.fixed_dictionaries(
        {"v": st.just(2), "store": st.just("grpo"), "policy_version": st.integers(0, 10)}),
        ["v", "store", "policy_version", "task"])),
    st.tuples(st.just("policy_version"), mutated(st.just({"v": 2, "store": "grpo"}), ["v", "store"])),
    st.tuples(st.just("add_task"), mutated(st.fixed_dictionaries(
        {"v": st.just(2), "store": st.just("grpo"), "task": st.text(min_size=1, max_size=8)}),
        ["v", "store", "task", "policy_version"])),
    # issue 25: leases; ids well-formed or not, open or not (the test may swap in a real one)
    st.tuples(st.sampled_from(["ack", "nack"]), mutated(st.fixed_dictionaries(
        {"v": st.just(2), "store": st.just("grpo"),
         "lease": st.sampled_from(["OPEN", "abc.1", "", "x" * 129, "a b", "../..", "0/abc.1+1/x.2"])
         | st.text(max_size=140)}), ["v", "store", "lease", "task"])),
)
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


# ---------------------------------------------------------------------------------------------------- leases
@FUZZ
@given(verb=st.sampled_from(["ack", "nack"]), body=st.fixed_dictionaries({}, optional={
    "v": st.sampled_from([1, 2, 3]) | numbers, "store": texts, "lease": texts | numbers | json_values
    | st.text(alphabet="abc.:/+-0", max_size=200), "extra": json_values}).map(lambda d: json.dumps(d).encode())
    | raw)
def test_ack_and_nack_bodies_decode_to_a_short_plain_id_or_are_refused(verb, body):
    """The lease messages (issue 25) are hostile input: decoded only into a bounded id of plain characters."""
    try:
        req = P.decode_action(flight.Action(verb, body))
    except ab.SchemaError:
        return
    assert req.type == verb and isinstance(req.lease, str) and 0 < len(req.lease) <= 128
    assert P.LEASE_ID.fullmatch(req.lease)


@FUZZ
@given(meta=json_values.map(lambda v: json.dumps({"v": 1, "indices": [], "lease": v}).encode()) | raw)
def test_a_consume_replys_lease_metadata_decodes_to_an_id_or_is_refused(meta):
    try:
        lease = P.decode_lease_meta(meta)
    except ab.SchemaError:
        return
    assert lease is None or (isinstance(lease, str) and P.LEASE_ID.fullmatch(lease))


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
    @given(ticket=consume_tickets.map(lambda d: json.dumps(d).encode()))
    def test_do_get_consume(self, target, ticket):
        """The consume ticket (issue 16): every option typed and bounded (n, timeout, max_tokens, where length,
        admission: issue 28)."""
        _outcome(lambda: event(f"consumed {target['client'].do_get(flight.Ticket(ticket), CALL).read_all().num_rows}"))

    @FUZZ
    @given(data=st.data(), command=mutated(st.just({"v": 2, "kind": "update", "store": "grpo"}),
                                           ["v", "kind", "store", "timeout"]).map(lambda d: json.dumps(d).encode()))
    def test_do_put_update(self, target, data, command):
        """DoPut kind "update" (issue 16): an `id` column and fields filled later; all of a batch or nothing."""
        store = target["stores"]["grpo"]
        client = target["client"]
        live = store.to_table(["seq"]).column("seq").to_numpy()
        rows = data.draw(st.integers(0, 3) | st.just(min(70, len(live))))
        ids = data.draw(st.lists(st.sampled_from(live.tolist()), min_size=rows, max_size=rows, unique=True))
        ids += data.draw(st.lists(st.integers(-5, 10**6) | st.just(2**62) | st.sampled_from(live.tolist()),
                                  max_size=2))  # ids never issued, or twice
        cols: dict[str, pa.Array] = {P.UPDATE_ID_COLUMN: pa.array(ids, pa.int64())}
        n = len(ids)
        cols["reward"] = pa.array(data.draw(st.lists(st.floats(-10, 10, width=32), min_size=n, max_size=n)),
                                  pa.float32())
        if data.draw(st.booleans()):
            cols["ref_logprobs"] = pa.array(data.draw(st.lists(st.lists(st.floats(-5, 0, width=32), max_size=3),
                                                               min_size=n, max_size=n)), pa.list_(pa.float32()))
        for name, typ in data.draw(st.lists(st.tuples(field_names | st.just(P.UPDATE_ID_COLUMN), arrow_types),
                                            max_size=2)):  # columns of other names and types, or None
            cols[name] = _column(data, typ, n)
        for name in data.draw(st.lists(st.sampled_from(sorted(cols)), max_size=1)):
            cols.pop(name, None)
        batch = pa.RecordBatch.from_pydict(cols) if cols else pa.RecordBatch.from_pydict({"x": pa.nulls(n)})
        before = store.to_table(["seq", "reward", "ref_logprobs"])
        done: list = []

        def put():
            writer, _ = client.do_put(flight.FlightDescriptor.for_command(command), batch.schema, CALL)
            try:
                writer.write_batch(batch)
            finally:
                writer.close()
            done.append(True)

        _outcome(put)
        event("update written" if done else "update refused")
        after = store.to_table(["seq", "reward", "ref_logprobs"])
        if not done:
            assert after.equals(before)  # a refused batch writes nothing
        assert after.num_rows == before.num_rows  # an update never adds or removes rows

    @FUZZ
    @given(action=llm_actions)
    def test_do_action_consume_verbs(self, target, action):
        """set_policy_version, policy_version and add_task (issue 16): bounded, never INTERNAL."""
        type_, body = action
        if body.get("lease") == "OPEN":  # a lease the server really has open: acked or nacked for real
            b = target["stores"]["grpo"].consume("train", 2, lease=30)
            body = {**body, "lease": b.lease or "none"}
        _outcome(lambda: event(f"{type_} done") or list(
            target["client"].do_action(flight.Action(type_, json.dumps(body).encode()), CALL)))
        store = target["stores"]["grpo"]
        assert 0 <= store.policy_version < 2**63
        assert len(store.tasks) <= target["server"].limits.max_tasks

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
