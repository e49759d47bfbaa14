"""The crash harness's oracle on its own (`crash.oracle`): a store that holds exactly what the side log says passes,
and each kind of damage a crash could do is reported as its kind, with the row. A real store, no processes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from crash import oracle as orc
from crash import workload as wl

V = wl.VARIANTS["ragged"]
RID0 = wl.rid_base(0, 0)


def _log() -> list[dict]:
    """Side-log lines of one generation: 10 rows acked, an update and a priority acked, the train task consuming
    rows 0-3 for good, the ref task leasing rows 0-1 (acked) and 2-3 (abandoned), a policy version."""
    lines = []

    def call(k, op, args, result=None, th="t"):
        lines.append({"g": 0, "th": th, "k": k, "op": op, "ph": "s", **args})
        if result is not None:
            lines.append({"g": 0, "th": th, "k": k, "op": op, "ph": "d", **result})

    call(1, "extend", {"rid0": RID0, "n": 10}, {"first": 0, "n": 10})
    call(2, "update", {"ids": [1, 2], "v": 7.0}, {"n": 2}, th="u")
    call(3, "prio", {"ids": [3], "v": 5.0}, {"n": 1}, th="u")
    call(4, "pv", {"v": 9}, {}, th="u")
    call(5, "consume", {"task": "train", "n": 4, "lease": None}, {"ids": [0, 1, 2, 3], "rw": [[1, 7.0], [2, 7.0]]})
    call(6, "consume", {"task": "ref", "n": 2, "lease": 1.0}, {"ids": [0, 1], "lease_id": "a", "rw": []}, th="r")
    call(7, "ack", {"task": "ref", "lease_id": "a", "ids": [0, 1]}, {}, th="r")
    call(8, "consume", {"task": "ref", "n": 2, "lease": 1.0}, {"ids": [2, 3], "lease_id": "b", "rw": []}, th="r")
    call(9, "abandon", {"task": "ref", "lease_id": "b", "ids": [2, 3]}, {}, th="r")
    call(10, "extend", {"rid0": RID0 + 10, "n": 5}, th="w")  # in flight at the kill: may or may not be there
    return lines


@pytest.fixture
def restored():
    """A store as a correct restore of `_log()` leaves it (the in-flight extend did not make it)."""
    store = ab.ExperienceStore(V.schema, capacity=V.capacity, sampler=wl.sampler(), chunk_rows=V.chunk_rows,
                               tasks=list(V.tasks))
    try:
        ids = store.extend(wl.rows(RID0, 10, V))
        store.update(ids[1:3], {"reward": np.full(2, 7.0, np.float32)})
        store.update_priorities(ids[3:4], [5.0])
        store.policy_version = 9
        store.consume("train", 4)
        store.consume("ref", 2)
        yield store
    finally:
        store.close()


def _check(got: orc.Restored) -> dict[str, list[orc.Violation]]:
    o = orc.Oracle(V, {"mode": "test"})
    assert o.ingest(_log()) == []
    out: dict[str, list[orc.Violation]] = {}
    for v in o.check(got):
        out.setdefault(v.kind, []).append(v)
    return out


def test_a_faithful_restore_passes(restored):
    assert _check(orc.snapshot(restored, V.tasks)) == {}


def _without_row(got: orc.Restored, seq: int) -> orc.Restored:
    keep = pa.array(np.asarray(got.table["seq"]) != seq)
    got.table = got.table.filter(keep)
    return got


def test_each_damage_is_reported_with_its_row(restored):
    got = orc.snapshot(restored, V.tasks)
    got = _without_row(got, 5)  # an acknowledged row lost
    i6 = int(np.flatnonzero(np.asarray(got.table["seq"]) == 6)[0])
    vec6 = np.stack(got.table["vec"].to_numpy(zero_copy_only=False)).copy()
    vec6[i6, 0] += 1  # a byte that differs
    got.table = got.table.set_column(got.table.schema.get_field_index("vec"), "vec",
                                     pa.FixedShapeTensorArray.from_numpy_ndarray(vec6))
    rewards = got.table["reward"].to_pylist()
    rewards[got.table["seq"].to_pylist().index(2)] = None  # an acknowledged update (and a delivered value) lost
    got.table = got.table.set_column(got.table.schema.get_field_index("reward"), "reward",
                                     pa.array(rewards, pa.float32()))
    got.unconsumed["train"].add(0)  # a row consumed for good, delivered again
    got.unconsumed["ref"].discard(2)  # a row of an abandoned lease that did not come back
    got.policy_version = 8
    found = _check(got)
    assert {k: sorted(v.seq for v in vs if v.seq is not None) for k, vs in found.items()} == {
        "acked row lost": [5], "content differs": [6], "update lost": [2], "delivered value lost": [2],
        "consumed row delivered again": [0], "leased row did not come back": [2], "policy_version lost": []}
    assert found["consumed row delivered again"][0].task == "train"
    assert found["acked row lost"][0].rid == RID0 + 5


def test_a_row_nobody_sent_and_a_reused_id_are_reported(restored):
    other = ab.ExperienceStore(V.schema, capacity=V.capacity, sampler=wl.sampler(), chunk_rows=V.chunk_rows,
                               tasks=list(V.tasks))
    try:
        other.extend(wl.rows(RID0 + 100, 12, V))  # the same seqs, other rids: ids given to rows nobody sent
        found = _check(orc.snapshot(other, V.tasks))
    finally:
        other.close()
    assert [v.seq for v in found["phantom row"]] == list(range(12))
    assert [v.seq for v in found["id reused"]] == list(range(10))
