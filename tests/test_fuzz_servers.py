"""Bounded fuzzing of every protocol arrowbuf serves (issue 42): Flight (tickets, actions, DoPut and DoExchange
metadata), tq.v2 (actions, read tickets, put descriptors and batches), the inspector's and the metrics endpoint's
HTTP, the broadcast's relay wire and its payload.

Each request is a well-formed one with a few parts replaced, deleted or added, or raw junk (bounded: at most a few
hundred KiB). Every answer must be a success or an error with a code (never INTERNAL, a traceback or a server path),
no call may hang (every call has a deadline), and afterwards the server still serves correctly.

The slow tests send 10,000 requests to each server in its own process (tests/fuzz_targets.py) and check its
resident memory: after a warm-up of `WARMUP` requests it may grow by at most `RSS_BOUND` (docs/security.md,
"Fuzzing"); the growth measured is printed. The quick tests (the developer loop) send a few hundred to a server in
this process. All on 127.0.0.1, seeded (a failure names its seed and request number).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import fuzz_targets  # noqa: E402

SLOW_N = 10_000
QUICK_N = 300
WARMUP = 500
#: How much a server's resident memory may grow over the fuzzed requests after the warm-up (docs/security.md).
RSS_BOUND = 64 << 20
CALL = flight.FlightCallOptions(timeout=15)
CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "TIMED_OUT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
         "NOT_FOUND", "UNAVAILABLE", "UNIMPLEMENTED", "FAILED", "UNAUTHENTICATED", "PERMISSION_DENIED"}


# ---------------------------------------------------------------------------------------------------- requests
JUNK: list[Any] = [None, True, False, 0, -1, 1, 3, 2**31, 2**63, -2**63, 2**70, 1e308, -0.0, 0.5, float("nan"),
                   float("inf"), "", "x" * 300, "ä\u0000", "../..", "/etc/passwd", "'; DROP TABLE x; --", [], {},
                   [1, 2, 3], {"a": 1}, ["obs"], [None], {"": None}, "cartpole", "grpo", "ref", "train", "seq"]


def junk(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.1:
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and r < 0.2:
        keys = ["a", "v", "n", "store", "kind", ""]
        return {rng.choice(keys): junk(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if r < 0.25:
        return rng.randint(-2**64, 2**64)
    if r < 0.3:
        return "".join(rng.choice("abc./\\%\"'{}[]\x00é") for _ in range(rng.randint(0, 40)))
    return rng.choice(JUNK)


def mutate(rng: random.Random, obj: dict[str, Any]) -> bytes:
    """`obj` as JSON with up to three parts replaced, deleted or added; sometimes junk bytes, truncated or deeply
    nested JSON, or a long value instead."""
    r = rng.random()
    if r < 0.03:
        return rng.randbytes(rng.randint(0, 200))
    if r < 0.05:
        n = rng.choice([100, 1000, 50_000, 200_000])
        return b"[" * n + b"]" * n
    if r < 0.07:
        raw = json.dumps(obj).encode()
        return raw[: rng.randint(0, len(raw))]
    if r < 0.08:
        return json.dumps({**obj, rng.choice(list(obj) or ["x"]): "y" * rng.choice([4096, 65536, 300_000])}).encode()
    out = dict(obj)
    if r < 0.5:  # many requests stay well-formed, so that they reach the store
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            if op < 0.5 and out:
                out[rng.choice(list(out))] = junk(rng)
            elif op < 0.75 and out:
                out.pop(rng.choice(list(out)))
            else:
                out[rng.choice(["extra", "v", "n", "store", "kind", "columns", "timeout", "lease", "op"])] = junk(rng)
    return json.dumps(out).encode()


def _deadline_json(raw: bytes) -> dict[str, Any]:
    try:
        detail = json.loads(raw)
    except ValueError:
        raise AssertionError(f"an error detail that is not JSON: {raw[:300]!r}") from None
    assert isinstance(detail, dict), detail
    return detail


def check_flight_error(exc: BaseException, *, schema_verb: bool = False) -> str:
    """An error a fuzzed Flight call may end with: mapped, with a code, no traceback, no server path."""
    text = str(exc)
    assert "Traceback" not in text or "<arrowbuf>" in text, text[:800]
    assert str(ROOT) not in text and "site-packages" not in text, text[:800]
    if schema_verb:  # pyarrow's GetSchema carries no status detail (docs/security.md): the text is all there is
        assert "internal server error" not in text.lower(), text[:800]
        return "SCHEMA"
    assert isinstance(exc, flight.FlightError), repr(exc)[:300]
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return "UNAUTHENTICATED"
    detail = _deadline_json(exc.extra_info)
    assert detail.get("code") in CODES, detail
    return str(detail["code"])


# ---------------------------------------------------------------------------------------------------- Flight
SQL = ["SELECT count(*) FROM experience", "SELECT * FROM experience LIMIT 3", "SELECT * FROM duckdb_settings()",
       "COPY (SELECT 1) TO 'x.csv'", "SELECT * FROM read_text('/etc/passwd')", "SELECT sum(i) FROM range(1e13) t(i)",
       "ATTACH 'x.db'", "SET threads=8", "SELECT 1; SELECT 2", "", "SELECT * FROM range(100000000)",
       "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"]


def _cartpole_batch(rng: random.Random) -> pa.RecordBatch:
    rows = rng.choice([0, 1, 2, 3, 300])
    cols = fuzz_targets.cartpole(rows, start=rng.randint(0, 1000))
    arrays: dict[str, pa.Array] = {}
    for k, v in cols.items():
        if v.ndim > 1:
            arrays[k] = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(v)) if rows else \
                pa.array([], pa.fixed_shape_tensor(pa.float32(), [4]).storage_type)
        else:
            arrays[k] = pa.array(v)
    r = rng.random()
    if r < 0.15 and arrays:
        arrays.pop(rng.choice(list(arrays)))
    elif r < 0.3:
        arrays[rng.choice(["obs", "reward", "bogus", "seq"])] = pa.array([rng.choice([None, 1.5, "x"])] * rows)
    return pa.RecordBatch.from_pydict(arrays) if arrays else pa.RecordBatch.from_pydict({"x": pa.nulls(rows)})


def flight_request(rng: random.Random, client: flight.FlightClient) -> Callable[[], Any]:
    from arrowbuf.flight import protocol as P

    verb = rng.random()
    if verb < 0.3:
        kind = rng.choice(P.TICKET_KINDS)
        base: dict[str, Any] = {"v": 2 if kind == "consume" else 1, "kind": kind,
                                "store": "grpo" if kind in ("consume", "sql") else "cartpole"}
        if kind == "sample":
            base.update(n=rng.choice([1, 4, 64]), columns=rng.choice([None, ["obs"], ["reward", "seq"]]),
                        options=rng.choice([{}, {"n_step": 3, "gamma": 0.9}]))
        elif kind == "sql":
            base["query"] = rng.choice(SQL)
        elif kind == "consume":
            base.update(task=rng.choice(["ref", "train"]), n=rng.choice([1, 2, 8]), timeout=0,
                        lease=rng.choice([None, 0.05, 1.0]))
        ticket = mutate(rng, base)
        return lambda: client.do_get(flight.Ticket(ticket), CALL).read_all()
    if verb < 0.55:
        name = rng.choice(sorted(P.ACTIONS)) if rng.random() < 0.9 else str(junk(rng))[:40]
        body: dict[str, Any] = {"v": 2 if name in ("set_policy_version", "policy_version", "add_task", "ack",
                                                   "nack") else 1, "store": rng.choice(["cartpole", "grpo"])}
        if name == "update_priorities":
            body.update(indices=[rng.randint(0, 300) for _ in range(3)], priorities=[1.0, 2.0, 0.5])
        elif name == "checkpoint":
            body["path"] = rng.choice(["c1", "c2", "../x", "/abs", ".h", "a/b"])
        elif name == "set_policy_version":
            body["policy_version"] = rng.randint(0, 5)
        elif name == "add_task":
            body["task"] = rng.choice(["ref", "t1", "t2", "x" * 300])
        elif name in ("ack", "nack"):
            body["lease"] = rng.choice(["abc.1.ff", "", "x" * 200, "0/a.1+1/b.2"])
        raw = mutate(rng, body)
        return lambda: list(client.do_action(flight.Action(name, raw), CALL))
    if verb < 0.8:
        update = rng.random() < 0.2
        command = mutate(rng, {"v": 2, "kind": "update", "store": "grpo"} if update else
                         {"v": 1, "kind": "extend", "store": "cartpole", "timeout": 0.1})
        batch = _cartpole_batch(rng) if not update else pa.RecordBatch.from_pydict(
            {"id": pa.array([rng.randint(0, 400) for _ in range(2)], pa.int64()),
             "reward": pa.array([rng.random(), 1.0], pa.float32())})
        descriptor = flight.FlightDescriptor.for_command(command)

        def put() -> None:
            writer, reader = client.do_put(descriptor, batch.schema, CALL)
            try:
                writer.write_batch(batch)
                writer.done_writing()
            finally:
                writer.close()

        return put
    if verb < 0.93:
        command = mutate(rng, {"v": 1, "kind": "session", "store": "cartpole", "n": rng.choice([1, 8]),
                               "prefetch": rng.choice([0, 2])})
        messages = [mutate(rng, {"op": rng.choice(["sample", "update_priorities"]), "count": rng.choice([1, 2]),
                                 "indices": [1, 2], "priorities": [1.0, 2.0]}) for _ in range(rng.randint(1, 3))]

        def session() -> None:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), CALL)
            try:
                for m in messages:
                    writer.write_metadata(pa.py_buffer(m))
                writer.done_writing()
                for _ in reader:
                    pass
            finally:
                writer.close()

        return session
    path = [str(junk(rng))[:40] for _ in range(rng.randint(0, 2))] or ["cartpole"]
    which = rng.random()
    descriptor = flight.FlightDescriptor.for_path(*path)
    if which < 0.3:
        return lambda: list(client.list_flights(rng.randbytes(8), CALL))
    if which < 0.6:
        return lambda: client.get_flight_info(descriptor, CALL)
    return _schema_call(client, descriptor)


def _schema_call(client: flight.FlightClient, descriptor: flight.FlightDescriptor) -> Callable[[], Any]:
    def call() -> Any:
        try:
            return client.get_schema(descriptor, CALL)
        except pa.ArrowException as exc:
            check_flight_error(exc, schema_verb=True)
            return None

    return call


def run_flight(location: str, n: int, seed: int, on_each: Callable[[int], None] | None = None) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    client = flight.FlightClient(location)
    try:
        for i in range(n):
            call = flight_request(rng, client)
            try:
                call()
                key = "ok"
            except flight.FlightError as exc:
                try:
                    key = check_flight_error(exc)
                except AssertionError as e:
                    raise AssertionError(f"seed {seed}, request {i}: {e}") from None
            outcomes[key] = outcomes.get(key, 0) + 1
            if on_each is not None:
                on_each(i)
    finally:
        client.close()
    return outcomes


def flight_still_serves(location: str) -> None:
    import arrowbuf as ab

    with ab.connect(location, store="cartpole") as remote:
        n = len(remote)
        remote.extend(fuzz_targets.cartpole(2, start=50_000))
        assert len(remote) == min(n + 2, 2000)
        assert len(remote.sample(3)) == 3
        assert remote.sql("SELECT count(*) AS n FROM experience").column("n")[0].as_py() == len(remote)


# ---------------------------------------------------------------------------------------------------- tq.v2
TQ_OPS = ["get_meta", "kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "set_custom_meta", "production_status",
          "consumption_status", "reset_consumption", "clear_samples", "list_partitions", "snapshot", "field_kinds",
          "limits", "clear_partition", "nope"]


def tq_request(rng: random.Random, client: flight.FlightClient) -> Callable[[], Any]:
    pid = rng.choice(["p0", "p1", "p2", "p" + str(rng.randint(0, 40))])
    verb = rng.random()
    if verb < 0.45:
        op = rng.choice(TQ_OPS)
        op = op if op != "clear_partition" or rng.random() < 0.1 else "kv_list"
        body = {"partition_id": pid, "data_fields": ["x"], "batch_size": rng.choice([0, 1, 4]),
                "mode": rng.choice(["fetch", "force_fetch", "insert"]),
                "task_name": rng.choice(["t0", "t1", f"t{rng.randint(0, 20)}"]),
                "keys": [f"k{rng.randint(0, 50)}"], "gidx": [rng.randint(0, 60)], "create": rng.random() < 0.3,
                "partition_ids": [pid], "custom_meta": {pid: [[rng.randint(0, 60), {"s": rng.random()}]]},
                "sampler": rng.choice([None, {"name": "SequentialSampler", "args": {}}])}
        raw = mutate(rng, body)
        return lambda: list(client.do_action(flight.Action(f"tq.v2.{op}", raw), CALL))
    if verb < 0.55:  # the shared-memory actions: a plan and its commit (or abort), a locate, stray handles
        return tq_shm_request(rng, client, pid)
    if verb < 0.7:
        ids = [rng.randint(0, 60) for _ in range(rng.randint(1, 4))]
        ticket = mutate(rng, {"op": "read", "partition_id": pid, "gidx": ids, "fields": rng.choice([["y"], ["x"]])})
        return lambda: client.do_get(flight.Ticket(ticket), CALL).read_all()
    rows = rng.choice([1, 2, 4])
    keyed = rng.random() < 0.5
    kind = rng.choice([["tensor", "float32"], ["tensor", "int64"], ["tensor", "int32"], ["str", "uint8"]])
    shape = rng.choice([(), (3,), None])  # None: ragged
    command = {"op": "kv_put" if keyed else "put", "partition_id": pid,
               "keys": [f"k{rng.randint(0, 50)}" for _ in range(rows)] if keyed else None,
               "gidx": [rng.randint(0, 60) for _ in range(rows)], "tags": None, "kinds": {"x": kind}, "nested": []}
    if kind[0] == "str" or shape is None:
        dtype = {"float32": pa.float32(), "int64": pa.int64(), "int32": pa.int32(), "uint8": pa.uint8()}[kind[1]]
        col = pa.array([list(range(i % 3)) for i in range(rows)], pa.list_(dtype))
        if kind[0] == "tensor":
            command["shapes"] = {"x": [[i % 3] for i in range(rows)]}
    elif shape:
        col = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ones((rows, 3), np.dtype(kind[1])))
    else:
        col = pa.array(np.ones(rows, np.dtype(kind[1])))
    if rng.random() < 0.1:
        col = pa.array(np.ones(rows + 1, np.float64))
    raw_command = mutate(rng, command)
    batch = pa.record_batch({"x": col})

    def put() -> None:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(raw_command), batch.schema, CALL)
        try:
            writer.write_batch(batch)
            writer.done_writing()
            reader.read()
        finally:
            writer.close()

    return put


def tq_shm_request(rng: random.Random, client: flight.FlightClient, pid: str) -> Callable[[], Any]:
    """A fuzzed `shm_plan` followed by a fuzzed `shm_commit` or `shm_abort` of what it answered, a `shm_locate`, or a
    commit or abort of a made-up handle."""
    def act(op: str, raw: bytes) -> Any:
        out = list(client.do_action(flight.Action(f"tq.v2.{op}", raw), CALL))
        return json.loads(out[0].body.to_pybytes())["result"]

    pick = rng.random()
    if pick < 0.5:
        rows = rng.choice([1, 2, 4])
        keyed = rng.random() < 0.5
        plan = mutate(rng, {"op": "kv_put" if keyed else "put", "partition_id": pid,
                            "keys": [f"k{rng.randint(0, 50)}" for _ in range(rows)] if keyed else None,
                            "gidx": [rng.randint(0, 60) for _ in range(rows)], "tags": None,
                            "kinds": {"x": rng.choice([["tensor", "float32"], ["tensor", "int64"]])},
                            # large samples too: a plan reserves its group's store in /dev/shm (a one-sample plan
                            # of [2**26] floats reserved 4 GiB), which `Target.rss` counts
                            "dense": {"x": rng.choice([[3], [], [2, 2], [3], [], [2, 2], [1 << 16], [1 << 26],
                                                       [1 << 39]])}, "nested": []})
        commit = rng.random() < 0.7
        made = [rng.randint(-2, 70) for _ in range(rng.choice([rows, rows, rows + 1, 0]))]

        def plan_then_end() -> None:
            got = act("shm_plan", plan)
            if isinstance(got, dict) and got.get("plan"):
                body = {"plan": got["plan"], "rows": made} if commit else {"plan": got["plan"]}
                act("shm_commit" if commit else "shm_abort", mutate(rng, body))

        return plan_then_end
    if pick < 0.8:
        ids = [rng.randint(0, 60) for _ in range(rng.randint(0, 4))]
        raw = mutate(rng, {"partition_id": pid, "gidx": ids, "fields": rng.choice([["y"], ["x"], []])})
        return lambda: act("shm_locate", raw)
    raw = mutate(rng, {"plan": rng.choice([f"{rng.randint(0, 99)}.{rng.getrandbits(64):016x}", "", "1"]),
                       "rows": [rng.randint(0, 60)]})
    op = rng.choice(["shm_commit", "shm_abort"])
    return lambda: act(op, raw)


def check_tq_error(exc: BaseException) -> str:
    code = check_flight_error(exc)
    assert "tq.v2 error" in str(exc) or code == "UNAUTHENTICATED", str(exc)[:300]
    return code


def run_tq(location: str, n: int, seed: int, on_each: Callable[[int], None] | None = None) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    client = flight.FlightClient(location)
    try:
        for i in range(n):
            call = tq_request(rng, client)
            try:
                call()
                key = "ok"
            except flight.FlightError as exc:
                try:
                    key = check_tq_error(exc)
                except AssertionError as e:
                    raise AssertionError(f"seed {seed}, request {i}: {e}") from None
            outcomes[key] = outcomes.get(key, 0) + 1
            if on_each is not None:
                on_each(i)
    finally:
        client.close()
    return outcomes


def tq_still_serves(location: str) -> None:
    from arrowbuf.compat.transfer_queue.columns import FieldKind, FieldValues
    from arrowbuf.compat.transfer_queue.remote import RemoteBackend

    backend = RemoteBackend(location)
    try:
        for pid in backend.list_partitions():  # (the fuzzing may have filled every partition slot)
            backend.clear_partition(pid)
        gidx = backend.get_meta("final", ["y"], 3, "insert")["global_indexes"]
        backend.put("final", gidx, {"y": FieldValues(FieldKind("tensor", "float32"), 3,
                                                     dense=np.arange(3, dtype=np.float32))}, [])
        assert backend.read("final", gidx, ["y"])["y"].dense.tolist() == [0.0, 1.0, 2.0]
    finally:
        backend.close_client()


# ---------------------------------------------------------------------------------------------------- HTTP
HTTP_STATUSES = {200, 400, 401, 403, 404, 409, 413, 414, 415, 429, 431, 501, 503, 504, 505}


def http_request(rng: random.Random, port: int, token: str | None, paths: list[str]) -> bytes:
    method = rng.choice(["GET"] * 5 + ["POST"] * 4 + ["PUT", "OPTIONS", "HEAD", "DELETE", "G\x00T", "X" * 30])
    path = rng.choice(paths + ["/", "/nope", "/../etc/passwd", "*", "http://evil/", "/" + "a" * 3000,
                               "/api/" + str(junk(rng))[:30].replace(" ", "%20")])
    version = rng.choice(["HTTP/1.1"] * 8 + ["HTTP/1.0", "HTTP/2.0", "FOO"])
    host = rng.choice([f"127.0.0.1:{port}"] * 6 + [f"localhost:{port}", "evil.example", "", f"[::1]:{port}",
                                                    "a" * 300, "127.0.0.1.evil.example"])
    body = rng.choice([json.dumps({"query": rng.choice(SQL)}).encode(), mutate(rng, {"query": rng.choice(SQL)}),
                       rng.randbytes(rng.randint(0, 300)), b""])
    headers = [f"Host: {host}"] if rng.random() < 0.95 else []
    if rng.random() < 0.3:
        headers.append(f"Origin: {rng.choice(['http://evil.example', f'http://127.0.0.1:{port}', 'null', 'x'])}")
    if rng.random() < 0.1:
        headers.append(f"Sec-Fetch-Site: {rng.choice(['cross-site', 'same-origin', 'none'])}")
    if method == "POST" or rng.random() < 0.1:
        ctype = rng.choice(["application/json"] * 4 + ["text/plain", "", "application/json; x=1"])
        headers.append(f"Content-Type: {ctype}")
    if token is not None and rng.random() < 0.8:
        headers.append(f"Authorization: Bearer {token if rng.random() < 0.85 else 'wrong'}")
    length = rng.choice([len(body)] * 6 + [len(body) + 10, -1, 10**12, "abc"])
    if body or method == "POST":
        headers.append(f"Content-Length: {length}")
    for _ in range(rng.choice([0, 0, 0, 1, 120])):
        headers.append(f"X-{rng.randint(0, 9)}: {'v' * rng.randint(0, 100)}")
    return (f"{method} {path} {version}\r\n" + "\r\n".join(headers) + "\r\n\r\n").encode("utf-8", "replace") + body


def http_exchange(port: int, raw: bytes, timeout: float = 15.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = bytearray()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        else:
            raise AssertionError(f"no end of answer within {timeout} s to {raw[:200]!r}")
        return bytes(out)


def check_http_answer(raw: bytes, answer: bytes) -> int:
    if not answer:  # the server closed without an answer: only for a request it could not read at all
        return 0
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ")
    assert len(parts) >= 2 and parts[1].isdigit(), status_line
    status = int(parts[1])
    assert status in HTTP_STATUSES, (status, raw[:200], body[:300])
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text and str(ROOT) not in text and 'File "' not in text, text[:500]
    lower = head.lower()
    assert b"x-frame-options: deny" in lower or raw.startswith(b"HEAD"), head[:400]
    if b"text/html" in lower:
        assert status == 200
    elif b"application/json" in lower and body:
        detail = json.loads(body)
        if status != 200:
            assert set(detail) == {"error", "code", "message"} and detail["code"] != "INTERNAL", detail
    return status


def run_http(port: int, token: str | None, paths: list[str], n: int, seed: int,
             on_each: Callable[[int], None] | None = None) -> dict[int, int]:
    rng = random.Random(seed)
    out: dict[int, int] = {}
    for i in range(n):
        raw = http_request(rng, port, token, paths)
        try:
            if rng.random() < 0.01:  # half-sent, then gone
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(raw[: len(raw) // 2])
                status = -1
            else:
                status = check_http_answer(raw, http_exchange(port, raw))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, request {i}: {e}") from None
        out[status] = out.get(status, 0) + 1
        if on_each is not None:
            on_each(i)
    return out


# ---------------------------------------------------------------------------------------------------- relay wire
def relay_request(rng: random.Random, info: dict[str, Any]) -> bytes:
    from arrowbuf.ray.hoplite import wire

    secret = bytes.fromhex(info["secret"])
    nblocks = -(-info["size"] // info["block_size"])
    r = rng.random()
    if r < 0.1:
        return rng.randbytes(rng.randint(0, 200))
    hello = wire.hello(secret if rng.random() < 0.8 else rng.randbytes(16),
                       info["version"] if rng.random() < 0.8 else rng.randint(0, 2**64 - 1), "fuzz")
    if r < 0.2:
        hello = bytearray(hello)
        for _ in range(rng.randint(1, 4)):
            hello[rng.randrange(len(hello))] = rng.randrange(256)
        hello = bytes(hello)
    reqs = b"".join(wire.REQUEST.pack(rng.choice([rng.randrange(nblocks), nblocks, 2**64 - 1]),
                                      rng.choice([0, 0, 0, 100, info["block_size"], 2**63]))
                    for _ in range(rng.randint(0, 4)))
    tail = rng.randbytes(rng.randint(0, 15)) if rng.random() < 0.2 else b""
    return hello + reqs + tail


def relay_exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""
        out = bytearray()
        while True:
            ready, _, _ = select.select([s], [], [], 15)
            assert ready, f"the relay did not end the connection within 15 s after {raw[:80]!r}"
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)


def relay_still_serves(info: dict[str, Any]) -> None:
    from arrowbuf.ray.hoplite import wire

    size, bs = info["size"], info["block_size"]
    data = bytes((i * 7) % 251 for i in range(size))
    nblocks = -(-size // bs)

    async def fetch() -> bytes:
        sock = await wire.connect(("127.0.0.1", info["port"]), bytes.fromhex(info["secret"]), info["version"], "ok")
        try:
            await wire.request(sock, 0, nblocks)
            out = bytearray(size)
            for i in range(nblocks):
                a, b = i * bs, min((i + 1) * bs, size)
                await wire.read_bucket(sock, i, memoryview(out)[a:b])
            return bytes(out)
        finally:
            sock.close()

    assert asyncio.run(asyncio.wait_for(fetch(), 30)) == data


def run_relay(info: dict[str, Any], n: int, seed: int, on_each: Callable[[int], None] | None = None) -> int:
    rng = random.Random(seed)
    answered = 0
    for i in range(n):
        raw = relay_request(rng, info)
        answer = relay_exchange(info["port"], raw)
        answered += bool(answer)
        if on_each is not None:
            on_each(i)
    return answered


# ---------------------------------------------------------------------------------------------------- payload
def payload_cases(rng: random.Random, n: int) -> Iterator[bytes]:
    from arrowbuf.ray.hoplite import payload

    tree = {"w": np.arange(32, dtype=np.float32), "b": {"c": [1, "x", None]}, "t": pa.table({"y": [1.0, 2.0]}),
            "i": np.arange(6, dtype=np.int64).reshape(2, 3)}
    lay = payload.encode(tree)
    buf = bytearray(lay.size)
    lay.write(buf)
    base = bytes(buf)
    hlen = int.from_bytes(base[8:16], "little")
    head = json.loads(base[16:16 + hlen])
    for _ in range(n):
        r = rng.random()
        if r < 0.4:  # bytes flipped in the header or the body
            out = bytearray(base)
            for _ in range(rng.randint(1, 6)):
                out[rng.randrange(16 + hlen if rng.random() < 0.7 else len(out))] = rng.randrange(256)
            yield bytes(out[: rng.randint(0, len(out))] if rng.random() < 0.2 else out)
        else:  # a header with nodes replaced by junk, pointed elsewhere, or nested deeply
            h = json.loads(json.dumps(head))
            node = h["data"]["items"][rng.choice(sorted(h["data"]["items"]))]
            key = rng.choice(["k", "dtype", "shape", "offset", "nbytes", "type", "items", "v", "torch"])
            node[key] = junk(rng) if rng.random() < 0.7 else rng.choice([0, 64, 128, 2**40, -1, [[[[]]]], "arrow"])
            enc = json.dumps(h).encode() if rng.random() < 0.95 else b"[" * 100_000 + b"]" * 100_000
            start = -(-(16 + len(enc)) // 64) * 64
            data = base[-(-(16 + hlen) // 64) * 64:]
            yield (payload.MAGIC + len(enc).to_bytes(8, "little") + enc).ljust(start, b"\0") + data


def run_payload(n: int, seed: int) -> dict[str, int]:
    from arrowbuf.errors import BroadcastRefused
    from arrowbuf.ray.hoplite import payload

    out = {"decoded": 0, "refused": 0}
    for i, raw in enumerate(payload_cases(random.Random(seed), n)):
        try:
            payload.decode(memoryview(raw), torch_views=False)
            out["decoded"] += 1
        except BroadcastRefused:
            out["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the finding: anything but BroadcastRefused
            raise AssertionError(f"seed {seed}, payload {i}: {type(exc).__name__}: {exc}") from None
    return out


# ---------------------------------------------------------------------------------------------------- targets
class Target:
    """A fuzz target server in its own process (tests/fuzz_targets.py), its resident memory measured."""

    def __init__(self, kind: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fuzz_targets.py"), kind], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.proc.kill()
            raise AssertionError(f"the {kind} target did not start: {self.proc.stderr.read()[-3000:]!r}")
        self.info = json.loads(line)

    def rss(self) -> int:
        """Its resident memory, plus the /dev/shm it reserved (a tq.v2 system's shared stores, `tq-<pid>-*`:
        reserved when made, resident or not)."""
        with open(f"/proc/{self.proc.pid}/status") as fh:
            rss = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:")), None)
        assert rss is not None, "no VmRSS"
        from arrowbuf.tiers.shm import store_path

        root, tag = os.path.dirname(store_path("x")), f"tq-{self.proc.pid}-"
        for dirpath, _, files in os.walk(root):
            for f in files:
                if tag in dirpath or tag in f:
                    with contextlib.suppress(OSError):  # a store closed meanwhile
                        rss += os.stat(os.path.join(dirpath, f)).st_blocks * 512
        return rss

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("the target did not stop within 60 s of its stdin closing") from None
        assert self.proc.returncode == 0, self.proc.stderr.read()[-3000:]


@pytest.fixture
def target(request):
    t = Target(request.param)
    try:
        yield t
    finally:
        if t.alive():
            t.proc.kill()
            t.proc.wait()


class Memory:
    """RSS of a target after the warm-up and at the end (`on_each` records the warm-up point)."""

    def __init__(self, target: Target) -> None:
        self.target, self.base = target, 0

    def on_each(self, i: int) -> None:
        if i == WARMUP - 1:
            self.base = self.target.rss()

    def check(self, what: str) -> int:
        grown = self.target.rss() - self.base
        print(f"\n{what}: RSS {self.base / 2**20:.1f} MiB after {WARMUP} requests, grew {grown / 2**20:+.1f} MiB over "
              f"the next {SLOW_N - WARMUP}")
        assert grown <= RSS_BOUND, f"{what}: RSS grew {grown / 2**20:.1f} MiB (bound {RSS_BOUND >> 20} MiB)"
        return grown


# ---------------------------------------------------------------------------------------------------- slow: 10,000 each
@pytest.mark.slow
@pytest.mark.parametrize("target", ["flight"], indirect=True)
def test_flight_10k_fuzzed_requests(target):
    mem = Memory(target)
    outcomes = run_flight(target.info["location"], SLOW_N, seed=42, on_each=mem.on_each)
    assert sum(outcomes.values()) == SLOW_N and outcomes.get("ok", 0) > 0, outcomes
    assert target.alive()
    flight_still_serves(target.info["location"])
    mem.check("flight")
    target.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tq"], indirect=True)
def test_tq_10k_fuzzed_requests(target):
    mem = Memory(target)
    outcomes = run_tq(target.info["location"], SLOW_N, seed=42, on_each=mem.on_each)
    assert sum(outcomes.values()) == SLOW_N and outcomes.get("ok", 0) > 0, outcomes
    assert target.alive()
    tq_still_serves(target.info["location"])
    mem.check("tq.v2")
    target.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["inspector"], indirect=True)
def test_inspector_10k_fuzzed_requests(target):
    mem = Memory(target)
    paths = ["/api/overview", "/api/returns", "/api/lineage?seq=3", "/api/lineage?seq=x", "/api/sql", "/index.html"]
    statuses = run_http(target.info["port"], target.info["token"], paths, SLOW_N, seed=42, on_each=mem.on_each)
    assert statuses.get(200, 0) > 0 and statuses.get(403, 0) > 0, statuses
    assert target.alive()
    raw = (f"GET /api/overview HTTP/1.1\r\nHost: 127.0.0.1:{target.info['port']}\r\n"
           f"Authorization: Bearer tok\r\n\r\n").encode()
    assert check_http_answer(raw, http_exchange(target.info["port"], raw)) == 200
    mem.check("inspector")
    target.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["metrics"], indirect=True)
def test_metrics_10k_fuzzed_requests(target):
    mem = Memory(target)
    statuses = run_http(target.info["port"], None, ["/metrics"], SLOW_N, seed=42, on_each=mem.on_each)
    assert statuses.get(200, 0) > 0 and statuses.get(403, 0) > 0, statuses
    assert target.alive()
    raw = f"GET /metrics HTTP/1.1\r\nHost: localhost:{target.info['port']}\r\n\r\n".encode()
    assert check_http_answer(raw, http_exchange(target.info["port"], raw)) == 200
    mem.check("metrics")
    target.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["relay"], indirect=True)
def test_relay_wire_10k_fuzzed_connections(target):
    mem = Memory(target)
    answered = run_relay(target.info, SLOW_N, seed=42, on_each=mem.on_each)
    assert answered > 0
    assert target.alive()
    relay_still_serves(target.info)
    mem.check("relay wire")
    target.close()


@pytest.mark.slow
def test_payload_decode_10k_fuzzed_payloads():
    out = run_payload(SLOW_N, seed=42)
    assert out["refused"] > 0 and sum(out.values()) == SLOW_N, out


# ---------------------------------------------------------------------------------------------------- quick
def test_flight_quick_fuzz():
    import arrowbuf as ab

    stores = {}
    cp = ab.ExperienceStore(fuzz_targets.SCHEMAS / "cartpole.yaml", capacity=2000, seed=0)
    cp.extend(fuzz_targets.cartpole(100))
    llm = ab.ExperienceStore({"name": "grpo", "fields": fuzz_targets.GRPO_FIELDS}, capacity=2000, seed=0,
                             tasks=["ref", "train"])
    llm.extend(fuzz_targets.grpo(200))
    stores = {"cartpole": cp, "grpo": llm}
    with ab.serve(stores, max_batch_rows=256, max_batch_bytes=1 << 20, max_n_step=16, max_timeout=0.5,
                  shutdown_timeout=1.0, sql_limits=ab.SqlLimits(timeout=1.0, memory_limit=64 << 20,
                                                                max_result_bytes=1 << 20)) as server:
        outcomes = run_flight(server.location, QUICK_N, seed=7)
        assert outcomes.get("ok", 0) > 0, outcomes
        flight_still_serves(server.location)
    cp.close()
    llm.close()


def test_tq_quick_fuzz():
    from arrowbuf.compat.transfer_queue.server import TQServer
    from arrowbuf.compat.transfer_queue.state import TQState

    state = TQState(capacity=512, polling_mode=True, shared_memory=True)
    with TQServer(state, max_partitions=16, max_tasks=8, max_groups=8) as server:
        outcomes = run_tq(server.location, QUICK_N, seed=7)
        assert outcomes.get("ok", 0) > 0, outcomes
        tq_still_serves(server.location)
    state.close()


def test_inspector_and_metrics_quick_fuzz():
    import arrowbuf as ab
    from arrowbuf.observe.ui import Inspector
    from arrowbuf.serving.limits import NetLimits

    store = ab.ExperienceStore({"name": "grpo", "fields": fuzz_targets.GRPO_FIELDS}, capacity=500, tasks=["t"])
    store.extend(fuzz_targets.grpo(50))
    limits = NetLimits(max_request_bytes=64 << 10, idle_timeout=2.0, request_timeout=10.0)
    with Inspector(store, "127.0.0.1:0", token="tok", limits=limits) as ins:
        statuses = run_http(ins.port, "tok", ["/api/overview", "/api/sql", "/api/lineage?seq=1"], QUICK_N, seed=7)
        assert statuses.get(200, 0) > 0, statuses
    pytest.importorskip("prometheus_client")
    from arrowbuf.observe.metrics import MetricsEndpoint

    with MetricsEndpoint.start("127.0.0.1:0", stores={"grpo": store}, limits=limits) as endpoint:
        statuses = run_http(endpoint.port, None, ["/metrics"], QUICK_N // 2, seed=7)
        assert statuses.get(200, 0) > 0, statuses
    store.close()


def test_relay_wire_and_payload_quick_fuzz(tmp_path):
    out = run_payload(QUICK_N, seed=7)
    assert out["refused"] > 0, out
    t = Target("relay")
    try:
        run_relay(t.info, 100, seed=7)
        assert t.alive()
        relay_still_serves(t.info)
        t.close()
    finally:
        if t.alive():
            t.proc.kill()
            t.proc.wait()
