"""The shared-memory path of the TransferQueue-compatible system (issue 40): a system whose field groups live in
/dev/shm lets the processes of its node put and read values themselves (`RemoteBackend` with the `shm_*` actions of
`TQServer`); only plans, commits and locations go over Flight. Real servers on 127.0.0.1:0, real processes sharing
/dev/shm. What a client writes this way reads back the same through Flight and through shared memory; a client that
cannot open the stores (another node, another /dev/shm) goes over Flight; every `shm_*` request is bounded and
checked before anything is registered."""

from __future__ import annotations

import json
import os
import queue
import time
from typing import Any

import numpy as np
import pyarrow.flight as flight
import pytest
from conftest import process_context

from arrowbuf.compat.transfer_queue.columns import FieldValues, field_values
from arrowbuf.compat.transfer_queue.remote import RemoteBackend
from arrowbuf.compat.transfer_queue.server import TQServer
from arrowbuf.compat.transfer_queue.state import TQState

CTX = process_context()


def _values(n: int, seed: int) -> dict[str, FieldValues]:
    """Dense fields (the forms a shared store holds): float32 rows of a shape, bfloat16, int64 scalars."""
    import torch

    rng = np.random.default_rng(seed)
    return {
        "obs": field_values("obs", rng.standard_normal((n, 3, 4)).astype(np.float32)),
        "logp": field_values("logp", torch.arange(n * 2, dtype=torch.float32).reshape(n, 2).to(torch.bfloat16) + seed),
        "step": field_values("step", np.arange(n, dtype=np.int64) * 10 + seed),
    }


def _mixed(n: int, seed: int) -> dict[str, FieldValues]:
    """A dense field with ragged int64 tensors (nested), strings and JSON values: a group with a JSON field stays in
    the system's memory, its values go over Flight."""
    return {
        "obs": field_values("obs", np.full((n, 2), seed, np.float32)),
        "tokens": field_values("tokens", [np.arange(i % 5 + 1, dtype=np.int64) + seed for i in range(n)]),
        "text": field_values("text", [f"sample {seed}-{i}" * (i % 3) for i in range(n)]),
        "info": field_values("info", [{"i": i, "tags": ["a"] * (i % 2)} for i in range(n)]),
    }


def _plain(values: dict[str, FieldValues]) -> dict[str, list[Any]]:
    """Values as comparable Python lists (bfloat16 read as float32)."""
    out = {}
    for f, v in values.items():
        items = v.components()
        out[f] = [x.astype(np.float32).tolist() if isinstance(x, np.ndarray) and x.dtype.kind == "V"
                  else (x.tolist() if isinstance(x, np.ndarray) else x) for x in items]
    return out


def _writer(location: str, shm_dir: str | None, out: Any) -> None:
    """A process of the node: a kv_put and an insert + put through its own client; reports what it wrote and how."""
    if shm_dir is not None:  # another /dev/shm (a container of its own, another node): the stores cannot be opened
        os.environ["ARROWBUF_SHM_DIR"] = shm_dir
    backend = RemoteBackend(location)
    try:
        kv = backend.kv_put("p", [f"k{i}" for i in range(6)], _values(6, 1), [], [{"i": i} for i in range(6)])
        gidx = backend.get_meta("q", list(_values(1, 0)), 5, "insert")["global_indexes"]
        backend.put("q", gidx, _values(5, 2), [])
        mixed = backend.kv_put("m", ["a", "b", "c"], _mixed(3, 3), ["tokens"], None)
        got = backend.read("p", [5, 0, 3], list(_values(1, 0)))
        out.put({"kv": kv, "gidx": gidx, "shm": backend.through_shared_memory, "read": _plain(got),
                 "mixed": mixed, "read_mixed": _plain(backend.read(
                     "m", backend.kv_retrieve_meta("m", ["c", "a"])["global_indexes"], list(_mixed(1, 0))))})
    finally:
        backend.close_client()


@pytest.fixture
def shm_system():
    state = TQState(capacity=64, shared_memory=True)
    server = TQServer(state)
    try:
        yield state, server
    finally:
        server.close()
        state.close()


def _run_writer(location: str, shm_dir: str | None = None) -> dict[str, Any]:
    out = CTX.Queue()
    child = CTX.Process(target=_writer, args=(location, shm_dir, out))
    child.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # a writer that died says so at once (its traceback is on stderr)
            try:
                got = out.get(timeout=1)
                break
            except queue.Empty:
                assert child.is_alive() and time.monotonic() < deadline, f"the writer ended: {child.exitcode}"
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    return got


def _sub(values: dict[str, list[Any]], rows: list[int]) -> dict[str, list[Any]]:
    return {f: [v[r] for r in rows] for f, v in values.items()}


def test_a_process_of_the_node_puts_and_reads_through_shared_memory_what_flight_clients_see(shm_system):
    state, server = shm_system
    got = _run_writer(server.location)
    assert got["shm"] is True  # the writer's puts and read went through the shared stores
    assert got["kv"]["fields"] == sorted(_values(1, 0)) and got["kv"]["tags"] == [{"i": i} for i in range(6)]
    kv_written = _plain(_values(6, 1))
    assert got["read"] == _sub(kv_written, [5, 0, 3])
    assert [g.shm is not None for pid in ("p", "q", "m") for g in state.partitions[pid].stores] == [True, True, False]
    assert got["mixed"]["fields"] == sorted(_mixed(1, 0)) and got["read_mixed"] == _sub(_plain(_mixed(3, 3)), [2, 0])
    # the same values through a Flight-only client and through a shared-memory client of this process
    flight_only = RemoteBackend(server.location, shared_memory=False)
    shm_client = RemoteBackend(server.location)
    try:
        keys = state.partitions["p"].keys
        order = [keys[f"k{i}"] for i in (2, 4, 1)]
        fields = list(kv_written)
        a, b = flight_only.read("p", order, fields), shm_client.read("p", order, fields)
        assert _plain(a) == _plain(b) == _sub(kv_written, [2, 4, 1])
        assert flight_only.through_shared_memory is False and shm_client.through_shared_memory is True
        put_written = _plain(_values(5, 2))
        assert _plain(flight_only.read("q", got["gidx"][::-1], fields)) == _sub(put_written, [4, 3, 2, 1, 0])
        assert _plain(shm_client.read("q", got["gidx"], ["obs"])) == {"obs": put_written["obs"]}
        # a group of ragged values goes over Flight without turning the client's shared memory off
        fresh = RemoteBackend(server.location)
        try:
            fresh.kv_put("m2", ["a"], _mixed(1, 4), ["tokens"], None)
            assert fresh.through_shared_memory is None
            assert _plain(fresh.read("p", order, ["obs"])) == {"obs": _sub(kv_written, [2, 4, 1])["obs"]}
            assert fresh.through_shared_memory is True
        finally:
            fresh.close_client()
        # a Flight client's put reads back through shared memory
        flight_only.kv_put("p", ["z"], _values(1, 7), [], None)
        assert _plain(shm_client.read("p", [state.partitions["p"].keys["z"]], fields)) == _plain(_values(1, 7))
        # no samples: each field's empty values, through shared memory too
        assert {f: v.n for f, v in shm_client.read("p", [], fields).items()} == {f: 0 for f in fields}
    finally:
        flight_only.close_client()
        shm_client.close_client()


def test_a_client_that_cannot_open_the_stores_goes_over_flight(shm_system, tmp_path):
    """A process whose /dev/shm is another (ARROWBUF_SHM_DIR elsewhere: a container of its own, another node) finds
    no store of the name the system answers: it aborts the plan and puts and reads over Flight, with the same
    values."""
    state, server = shm_system
    got = _run_writer(server.location, shm_dir=str(tmp_path))
    assert got["shm"] is False
    assert got["read"] == _sub(_plain(_values(6, 1)), [5, 0, 3])
    assert got["read_mixed"] == _sub(_plain(_mixed(3, 3)), [2, 0])
    assert state.partitions["p"].stores[0].pending == 0  # the aborted plan left nothing planned
    reader = RemoteBackend(server.location)
    try:
        written = _plain(_values(5, 2))
        assert _plain(reader.read("q", got["gidx"], ["step", "obs"])) == {"step": written["step"],
                                                                           "obs": written["obs"]}
        assert reader.through_shared_memory is True
    finally:
        reader.close_client()


def test_a_system_without_shared_memory_answers_none_and_its_clients_use_flight():
    state = TQState(capacity=64)
    with TQServer(state) as server:
        client = flight.FlightClient(server.location)
        backend = RemoteBackend(server.location)
        try:
            body = {"op": "kv_put", "partition_id": "p", "keys": ["a"], "kinds": {"x": ["tensor", "float32"]},
                    "dense": {"x": [2]}}
            reply = list(client.do_action(flight.Action("tq.v2.shm_plan", json.dumps(body).encode())))
            assert json.loads(reply[0].body.to_pybytes())["result"] == {"shm": None, "off": True}
            backend.kv_put("p", ["a"], {"x": field_values("x", np.ones((1, 2), np.float32))}, [], None)
            assert backend.through_shared_memory is False
            assert backend.read("p", [0], ["x"])["x"].dense.tolist() == [[1.0, 1.0]]
        finally:
            backend.close_client()
            client.close()
    state.close()


def _act(client: flight.FlightClient, op: str, /, **body: Any) -> Any:
    out = list(client.do_action(flight.Action(f"tq.v2.{op}", json.dumps(body).encode())))
    return json.loads(out[0].body.to_pybytes())["result"]


def _plan_body(pid: str, keys: list[str]) -> dict[str, Any]:
    return {"op": "kv_put", "partition_id": pid, "keys": keys, "kinds": {"x": ["tensor", "float32"]},
            "dense": {"x": [4]}}


def test_shared_memory_puts_are_bounded_and_checked_before_anything_is_registered():
    """Open plans are bounded (`max_concurrent_streams`); a commit of another number of rows, of rows outside the
    group, of an unknown or aborted handle, or into a partition cleared meanwhile registers nothing; a plan's
    fields must say dense or ragged."""
    state = TQState(capacity=64, shared_memory=True)
    with TQServer(state, max_concurrent_streams=2) as server:
        client = flight.FlightClient(server.location)
        try:
            plans = [_act(client, "shm_plan", **_plan_body("p", [f"k{i}"])) for i in range(2)]
            assert all(p["shm"]["shm"] for p in plans)
            # no slot left: no plan, the put is told to go over DoPut (a fuzzer's abandoned plans made a client's
            # put fail until they expired)
            assert _act(client, "shm_plan", **_plan_body("p", ["k9"])) == {"shm": None, "busy": 2}
            assert state.partitions["p"].stores[0].pending == 2  # the two open plans only
            with pytest.raises(flight.FlightError, match="rows for 1 samples"):
                _act(client, "shm_commit", plan=plans[0]["plan"], rows=[0, 1])
            with pytest.raises(flight.FlightError, match="no such put plan"):  # the refused commit ended the plan
                _act(client, "shm_commit", plan=plans[0]["plan"], rows=[0])
            with pytest.raises(flight.FlightError, match="outside"):
                _act(client, "shm_commit", plan=plans[1]["plan"], rows=[10_000])
            assert _act(client, "kv_list", partition_id="p") == {"p": {}}  # nothing was registered
            with pytest.raises(flight.FlightError, match="no such put plan"):
                _act(client, "shm_commit", plan="1.deadbeef", rows=[0])
            # a real put through shared memory: write the rows, commit
            plan = _act(client, "shm_plan", **_plan_body("p", ["a", "b"]))
            assert _act(client, "shm_abort", plan=plan["plan"]) is None
            with pytest.raises(flight.FlightError, match="no such put plan"):
                _act(client, "shm_commit", plan=plan["plan"], rows=[0, 1])
            backend = RemoteBackend(server.location)
            try:
                backend.kv_put("p", ["a", "b"], {"x": field_values("x", np.arange(8, dtype=np.float32).reshape(2, 4))},
                               [], None)
                assert backend.through_shared_memory is True
                assert backend.read("p", [state.partitions["p"].keys["b"]], ["x"])["x"].dense.tolist() == \
                    [[4.0, 5.0, 6.0, 7.0]]
                plan = _act(client, "shm_plan", **_plan_body("p", ["c"]))
                _act(client, "clear_partition", partition_id="p")
                with pytest.raises(flight.FlightError, match="cleared while the put was written"):
                    _act(client, "shm_commit", plan=plan["plan"], rows=[2])
                assert _act(client, "list_partitions") == []
            finally:
                backend.close_client()
            with pytest.raises(flight.FlightError, match="needs one shape"):
                _act(client, "shm_plan", **{**_plan_body("p", ["a"]), "dense": {}})
            with pytest.raises(flight.FlightError, match="dense shape"):
                _act(client, "shm_plan", **{**_plan_body("p", ["a"]), "dense": {"x": ["4"]}})
        finally:
            client.close()
    state.close()


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


def test_a_client_lets_go_of_the_stores_the_system_removed(shm_system):
    """A cleared partition's store is removed by the system, but its memory stays allocated while a client maps it:
    the client closes such attachments when it opens the next store (a run that makes a partition per step would
    otherwise hold every step's memory)."""
    state, server = shm_system
    backend = RemoteBackend(server.location)
    try:
        x = {"x": field_values("x", np.ones((4, 1024), np.float32))}
        backend.kv_put("step0", list("abcd"), x, [], None)
        old = state.partitions["step0"].stores[0].shm
        assert backend.read("step0", [0], ["x"])["x"].dense.shape == (1, 1024)
        assert old is not None and _mapped(old)
        backend.clear_partition("step0")
        backend.kv_put("step1", list("abcd"), x, [], None)
        assert backend.through_shared_memory is True
        assert not _mapped(old)  # neither the system (it closed the store) nor the client maps it any more
        assert _mapped(state.partitions["step1"].stores[0].shm)
    finally:
        backend.close_client()


def _shm_files(state: TQState) -> int:
    """Bytes of /dev/shm files of the system's stores (by their name prefix)."""
    from arrowbuf.tiers.shm import store_path

    root = os.path.dirname(store_path("x"))
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs
               if state.shm_budget.prefix in dp or state.shm_budget.prefix in f)


def test_a_plan_reserves_no_more_shared_memory_than_a_put_could_carry_and_all_plans_stay_in_a_budget():
    """A plan carries no values, yet its group's store is reserved in /dev/shm at once (posix_fallocate): a 200-byte
    `shm_plan` of one sample of shape [2**26] float32 made the system reserve 4 GiB (16 rows of 256 MiB), a few more
    would fill /dev/shm. A plan's samples may take at most `max_upload_bytes` (what a DoPut of them could carry), and
    the stores of every group together at most the system's `shm_budget`: past it a new store is made in the
    system's memory and its puts and reads go over Flight (the values still arrive); clearing gives the bytes back."""
    state = TQState(capacity=64, shared_memory=True)
    with TQServer(state, max_upload_bytes=16 << 20) as server:
        client = flight.FlightClient(server.location)
        try:
            huge = {"op": "kv_put", "partition_id": "big", "keys": ["a"], "kinds": {"x": ["tensor", "float32"]},
                    "dense": {"x": [1 << 26]}}
            with pytest.raises(flight.FlightError, match="max_upload_bytes"):
                _act(client, "shm_plan", **huge)
            assert _act(client, "list_partitions") == [] and _shm_files(state) == 0  # nothing reserved
            # one sample of 4 MiB: a store of its rows (2 here), not of 16 (a new group's first size for small samples)
            one = _act(client, "shm_plan", op="kv_put", partition_id="one", keys=["a"],
                       kinds={"x": ["tensor", "float32"]}, dense={"x": [1 << 20]})
            assert one["shm"] is not None and _shm_files(state) <= 10 << 20
            _act(client, "shm_abort", plan=one["plan"])
            assert _shm_files(state) == 0 and state.shm_budget.used == 0
            row = {"kinds": {"x": ["tensor", "float32"]}, "dense": {"x": [1 << 16]}}  # 256 KiB a sample
            plans = [_act(client, "shm_plan", op="kv_put", partition_id="p0", keys=["a"], **row)]
            one_store = state.shm_budget.used  # what the store of one such plan reserves (its index and flags too)
            assert plans[0]["shm"] is not None and 0 < one_store <= _shm_files(state) + 4096
            state.shm_budget.limit = 2 * one_store + one_store // 2  # room for two
            plans += [_act(client, "shm_plan", op="kv_put", partition_id=f"p{i}", keys=["a"], **row) for i in (1, 2)]
            assert [p["shm"] is not None for p in plans] == [True, True, False]  # the third in the system's memory
            assert _shm_files(state) <= state.shm_budget.limit
            backend = RemoteBackend(server.location)
            try:  # a put past the budget goes over Flight and reads back the same
                backend.kv_put("p2", ["a"], {"x": field_values("x", np.arange(1 << 16, dtype=np.float32)[None])}, [],
                               None)
                got = backend.read("p2", [state.partitions["p2"].keys["a"]], ["x"])["x"].dense
                assert got.shape == (1, 1 << 16) and got[0, -1] == (1 << 16) - 1
            finally:
                backend.close_client()
            for p in plans[:2]:
                _act(client, "shm_abort", plan=p["plan"])  # the partitions they made, left empty, go
            plan = _act(client, "shm_plan", op="kv_put", partition_id="p9", keys=["a"], **row)
            assert plan["shm"] is not None  # the bytes came back
            _act(client, "shm_abort", plan=plan["plan"])
        finally:
            client.close()
    state.close()
    assert _shm_files(state) == 0


def _nested_and_text(n: int, seed: int, longest: int) -> dict[str, FieldValues]:
    """Dense floats, nested int64 tensors of 1..`longest` values (2-d ones too) and strings of up to `longest`
    characters (UTF-8 of more bytes among them): a group of these is in shared memory."""
    return {
        "obs": field_values("obs", np.full((n, 2), seed, np.float32)),
        "tokens": field_values("tokens", [np.arange(1 + (i * 7 + seed) % longest, dtype=np.int64) + seed
                                          for i in range(n)]),
        "grid": field_values("grid", [np.full((1 + i % 3, 2), i + seed, np.float32) for i in range(n)]),
        "text": field_values("text", [("é" if i % 2 else "a") * (1 + (i * 5 + seed) % longest) for i in range(n)]),
    }


def test_nested_tensors_and_strings_go_through_shared_memory_and_a_larger_sample_gets_a_new_group(shm_system):
    """Nested tensors and strings are in the shared stores too (TransferQueue's complex case): each ragged arena is
    sized for the largest sample the plan announced (a store in /dev/shm cannot grow), a later put with a larger one
    goes to a new group (and the old rows stay readable), and a text put over Flight, whose lengths the system cannot
    know when it plans, goes to a group in the system's memory. Every read, through shared memory or Flight, returns
    what was written; a JSON field keeps its group in the system's memory (`_mixed`, test above)."""
    state, server = shm_system
    shm_client = RemoteBackend(server.location)
    flight_only = RemoteBackend(server.location, shared_memory=False)
    try:
        first = _nested_and_text(12, 1, 6)
        shm_client.kv_put("n", [f"a{i}" for i in range(12)], first, ["tokens", "grid"], None)
        assert shm_client.through_shared_memory is True
        groups = state.partitions["n"].stores
        longest = int(np.diff(first["text"].offsets).max())  # bytes (UTF-8): "é" takes two
        assert len(groups) == 1 and groups[0].shm is not None and groups[0].need["text"] == (longest, 0)
        assert groups[0].need["tokens"] == (6, 1) and groups[0].need["grid"] == (6, 2)
        # wrap the ring of the shared store a few times with samples as large as the first put's largest
        for r in range(3):
            shm_client.kv_put("n", [f"w{r}.{i}" for i in range(12)], _nested_and_text(12, 2 + r, 5),
                              ["tokens", "grid"], None)
            shm_client.clear_samples(["n"] * 12, [state.partitions["n"].keys[f"w{r}.{i}"] for i in range(12)])
        longer = _nested_and_text(3, 9, 40)
        shm_client.kv_put("n", ["b0", "b1", "b2"], longer, ["tokens", "grid"], None)
        assert len(groups) == 2 and groups[1].shm is not None
        assert groups[1].need["text"][0] == int(np.diff(longer["text"].offsets).max()) > longest
        keys = state.partitions["n"].keys
        fields = list(first)
        want = _sub(_plain(first), [11, 0, 5])
        for client in (shm_client, flight_only):
            assert _plain(client.read("n", [keys["a11"], keys["a0"], keys["a5"]], fields)) == want
            assert _plain(client.read("n", [keys["b2"], keys["b0"]], fields)) == _sub(_plain(longer), [2, 0])
        # strings put over Flight: their lengths are not known at the plan, their group is in the system's memory
        flight_only.kv_put("n", ["c0", "c1"], _nested_and_text(2, 11, 60), ["tokens", "grid"], None)
        assert groups[-1].shm is None
        assert _plain(shm_client.read("n", [keys["c1"]], fields)) == _sub(_plain(_nested_and_text(2, 11, 60)), [1])
        assert shm_client.through_shared_memory is True
    finally:
        shm_client.close_client()
        flight_only.close_client()


def test_a_shared_groups_arenas_hold_any_rows_of_the_largest_sample_as_the_ring_wraps():
    """The sizing rule: a ragged arena in /dev/shm cannot grow, so it holds (rows + 1) of the largest sample (the
    rows in the ring plus the padding where a sample does not fit before the arena's end). Writes of samples of
    every length up to the largest, the ring wrapping many times, never run out of space, and read back."""
    from arrowbuf.compat.transfer_queue.columns import FieldKind
    from arrowbuf.compat.transfer_queue.partition import FieldGroup, SharedMemoryBudget

    budget = SharedMemoryBudget(f"tq-{os.getpid()}-sizing", 1 << 30)
    forms = {"tokens": (FieldKind("tensor", "int64"), "ragged"), "text": (FieldKind("str", "uint8"), "ragged")}
    group = FieldGroup("sizing", forms, 16, rows=16, shm=budget, need={"tokens": (50, 2), "text": (37, 0)})
    try:
        assert group.shm is not None and group.store.capacity == 16
        rng = np.random.default_rng(0)
        # the worst case first: one short sample, then the largest ones one at a time: the ring full of them, each
        # next one does not fit before the arena's end and starts at 0 (padding) while the oldest is still there
        sizes = [1] + [None] * 40 + [int(k) for k in rng.integers(1, 9, size=30)]
        for step, n in enumerate(sizes):
            worst = n is None or n == 1 and step == 0
            n = 1 if n is None else n
            lens = [(1 if step == 0 else 50) if worst else int(rng.integers(0, 51)) for _ in range(n)]
            tl = [(1 if step == 0 else 37) if worst else int(rng.integers(0, 38)) for _ in range(n)]
            values = {"tokens": field_values("tokens", [np.arange(k, dtype=np.int64).reshape(-1, 1 if k % 2 else
                                                                                            (2 if k else 1))
                                                        for k in lens]),
                      "text": field_values("text", ["x" * k for k in tl])}
            assert group.make_room(n, None)  # every earlier row is dead: overwritten in place
            rows = group.write(values)
            got = group.read(["tokens", "text"], rows)
            assert got is not None and _plain(got) == _plain(values)
        assert group.store.capacity == 16  # it never had to grow: the ring wrapped
    finally:
        group.close()
    assert budget.used == 0
