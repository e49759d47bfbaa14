"""Pipelined acknowledgements (issue 25, speed): `extend(batch, wait=False)` returns a `PendingWrite` at once; its
rows are visible at once, `.wait()` / `.durable` say when they are durable, and a kill -9 of the writing process
loses no row whose handle reported durable. Real files, real processes."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import arrowbuf as ab

SCHEMA = {"name": "p", "fields": {"x": "int64", "tokens": {"dtype": "int32", "ragged": True}, "done": "bool"}}


def batch(i, n=8):
    return {"x": np.arange(n, dtype=np.int64) + 1000 * i, "done": np.ones(n, bool),
            "tokens": [np.full(k % 5 + 1, i, np.int32) for k in range(n)]}


@pytest.mark.parametrize("policy", ["batch", "group", "os"])
def test_a_pending_write_is_visible_at_once_and_durable_once_waited(tmp_path, policy):
    s = ab.ExperienceStore(SCHEMA, capacity=1000, durable=str(tmp_path / "run"), durability=policy)
    try:
        handles = [s.extend(batch(i), wait=False) for i in range(10)]
        assert all(isinstance(h, ab.PendingWrite) for h in handles)
        assert len(s) == 80  # visible before anyone waited
        assert s.to_table().column("x").to_pylist()[:8] == list(range(8))
        if policy == "os":
            assert all(h.durable for h in handles)  # in the page cache: durable under "os" at once
        ids = handles[-1].wait(timeout=30)
        assert handles[-1].durable
        assert all(h.durable for h in handles)  # records become durable in commit order
        assert np.array_equal(ids, np.arange(72, 80))
        assert [h.wait().tolist() for h in handles] == [list(range(8 * i, 8 * i + 8)) for i in range(10)]
    finally:
        s.close()


def test_without_a_journal_a_pending_write_is_durable_at_once():
    s = ab.ExperienceStore(SCHEMA, capacity=100)
    try:
        h = s.extend(batch(0), wait=False)
        assert h.durable and np.array_equal(h.wait(timeout=0), np.arange(8)) and len(s) == 8
        assert "durable=True" in repr(h)
    finally:
        s.close()


def test_a_pending_write_after_a_failed_batch_is_unaffected(tmp_path):
    s = ab.ExperienceStore(SCHEMA, capacity=100, durable=str(tmp_path / "run"), durability="group")
    try:
        with pytest.raises(ab.SchemaError):
            s.extend({"x": np.zeros(2)}, wait=False)  # validated before anything is stored or journaled
        h = s.extend(batch(1), wait=False)
        assert np.array_equal(h.wait(timeout=30), np.arange(8))
    finally:
        s.close()
    with ab.ExperienceStore.restore(str(tmp_path / "run")) as again:
        assert again.to_table().column("x").to_pylist() == list(range(1000, 1008))


_CHILD = textwrap.dedent("""
    import collections, sys
    import numpy as np
    import arrowbuf as ab
    from test_journal_pipelined import SCHEMA, batch
    s = ab.ExperienceStore(SCHEMA, capacity=100000, durable=sys.argv[1], durability=sys.argv[2])
    window = collections.deque()
    i = 0
    while True:
        window.append((i, s.extend(batch(i), wait=False)))
        i += 1
        while window and (len(window) > 4 or window[0][1].durable):
            k, h = window.popleft()
            ids = h.wait()
            print("durable", k, int(ids[0]), flush=True)
""")


@pytest.mark.parametrize("policy", ["group", "batch"])
def test_kill_9_loses_no_row_whose_pending_write_reported_durable(tmp_path, policy):
    d = tmp_path / "run"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests])}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(d), policy], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        while len(lines) < 120:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line.split())
        os.kill(p.pid, signal.SIGKILL)  # with writes in flight: stored, journaled, not yet reported durable
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert len(lines) >= 120, "the child stopped early"
    durable = {int(x[1]): int(x[2]) for x in lines}
    assert sorted(durable) == list(range(len(durable)))  # reported in order
    with ab.ExperienceStore.restore(str(d)) as again:
        t = again.to_table()
        by_seq = {s: r for r, s in enumerate(t["seq"].to_pylist())}
        xs, toks = t["x"].to_pylist(), t["tokens"].to_pylist()
        for i, first in durable.items():
            for k in range(8):
                row = by_seq[first + k]  # every row of a durable handle is there, under its id, exactly
                assert xs[row] == 1000 * i + k
                assert toks[row] == [i] * (k % 5 + 1)
        assert len(again) >= 8 * len(durable)
        new = again.extend(batch(10 ** 5))
        assert new.min() > max(durable.values())  # ids are never reused


def test_a_window_of_pending_writes_restores_exactly(tmp_path):
    """A writer that keeps a window of 4 unacknowledged writes, then closes: everything is restored."""
    s = ab.ExperienceStore(SCHEMA, capacity=10000, durable=str(tmp_path / "run"), durability="group")
    window: collections.deque = collections.deque()
    for i in range(50):
        window.append(s.extend(batch(i), wait=False))
        if len(window) > 4:
            window.popleft().wait()
    while window:
        window.popleft().wait()
    before = s.to_table()
    s.close()
    with ab.ExperienceStore.restore(str(tmp_path / "run")) as again:
        assert again.to_table().equals(before)


def test_a_remote_store_takes_wait_false_and_its_handle_is_durable(tmp_path):
    """Over Flight the server acknowledges a DoPut once durable: the handle is durable when it comes back."""
    root = str(tmp_path / "run")
    s = ab.ExperienceStore(SCHEMA, capacity=1000, durable=root, durability="group")
    try:
        with ab.serve(s, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as c:
            handles = [c.extend(batch(i), wait=False) for i in range(3)]
            assert all(isinstance(h, ab.PendingWrite) and h.durable for h in handles)
            assert [h.wait(timeout=0).tolist() for h in handles] == [list(range(8 * i, 8 * i + 8)) for i in range(3)]
            assert np.array_equal(c.extend(batch(3)), np.arange(24, 32))  # the default still returns the ids
    finally:
        s.close()
    with ab.ExperienceStore.restore(root) as again:
        assert len(again) == 32
