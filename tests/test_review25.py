"""Issue 25, found by a semantic review of the LLM path: each test failed on the code before its fix.

- a Flight consumer cancelled while its `consume(timeout=...)` waits must consume nothing;
- a multi-field `update` is atomic for readers (consume with require=, to_table);
- stale rows evicted before any task consumed them are counted (per task) in stats().
"""

from __future__ import annotations

import sys
import threading

import numpy as np

import arrowbuf as ab

GRPO = {"name": "g", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"},
}}


def grpo_rows(n, start=0):
    return {"prompt_id": np.arange(start, start + n), "done": np.ones(n, bool),
            "response": [np.arange(k % 5 + 1, dtype=np.int32) for k in range(start, start + n)]}


def test_a_multi_field_update_is_all_or_none_for_consume_and_to_table():
    """Rows get reward and ref_logprobs in one update call; no reader may see one without the other."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as the interpreter allows
    torn: list[str] = []
    stop = threading.Event()
    try:
        with ab.ExperienceStore(GRPO, capacity=1 << 14, chunk_rows=256, tasks=["train"]) as s:
            def reader_consume():
                while not stop.is_set():
                    b = s.consume("train", 64, require=["reward"], timeout=0.01)
                    if len(b):
                        lp = b.data.column("ref_logprobs")
                        if lp.null_count:
                            torn.append(f"consume: {lp.null_count} rows with reward but no ref_logprobs")

            def reader_table():
                while not stop.is_set():
                    t = s.to_table(columns=["reward", "ref_logprobs"])
                    r = np.asarray(t.column("reward").is_null())
                    lp = np.asarray(t.column("ref_logprobs").is_null())
                    if (r != lp).any():
                        torn.append(f"to_table: {int((r != lp).sum())} rows with one field of the update only")

            readers = [threading.Thread(target=reader_consume), threading.Thread(target=reader_table)]
            for t in readers:
                t.start()
            try:
                for k in range(0, 6000, 200):
                    ids = s.extend(grpo_rows(200, k))
                    for part in np.array_split(ids, 20):
                        s.update(part, {"reward": np.ones(len(part), np.float32),
                                        "ref_logprobs": [np.full(50, 0.5, np.float32)] * len(part)})
                    if torn:
                        break
            finally:
                stop.set()
                for t in readers:
                    t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not torn, torn[:3]


LLM_PV = {"name": "llm", "fields": {"prompt_id": "int64", "reward": "float32", "policy_version": "int64"}}


def pv_rows(n, start=0, pv=0):
    i = np.arange(start, start + n)
    return {"prompt_id": i, "reward": i.astype(np.float32), "policy_version": np.full(n, pv)}


def test_stale_rows_evicted_before_a_task_consumed_them_are_counted_per_task():
    with ab.ExperienceStore(LLM_PV, capacity=4, chunk_rows=2, tasks=["a", "b"], max_staleness=0) as s:
        s.extend(pv_rows(4))
        assert len(s.consume("a", 2)) == 2  # "a" took rows 0, 1; "b" nothing
        s.policy_version = 1
        s.extend(pv_rows(2, 4, pv=1), timeout=0)  # evicts rows 0, 1: stale, so not held; "b" never saw them
        st = s.stats()
        assert st["stale_dropped_by_task"] == {"a": 0, "b": 2}
        assert st["stale_dropped"] == 2
        s.extend(pv_rows(2, 6, pv=1), timeout=0)  # evicts rows 2, 3: neither task consumed them
        st = s.stats()
        assert st["stale_dropped_by_task"] == {"a": 2, "b": 4}
        assert st["stale_dropped"] == 6
        # every row is accounted for, per task: delivered + dropped as stale + still unconsumed in the ring
        for task in ("a", "b"):
            left = len(s.consume(task, 100))
            assert st["consumed"][task] + st["stale_dropped_by_task"][task] + left == 8


# ---------------------------------------------------------------------------------------------------- over Flight
WAITER = r"""
import sys
import arrowbuf as ab
with ab.connect(sys.argv[1]) as remote:
    print("ready", flush=True)
    remote.consume("t", 4, timeout=float(sys.argv[2]))
"""


def test_a_flight_consumer_killed_while_it_waits_takes_no_rows(procs):
    """A child's consume(timeout=3) is killed while it waits; rows written afterwards stay for the next consumer."""
    import os
    import signal
    import time

    with ab.ExperienceStore(LLM_PV, capacity=64, tasks=["t"]) as s, ab.serve(s) as server:
        child = procs([sys.executable, "-c", WAITER, server.location, "3"])
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(0.5)  # the child's call is waiting on the server now
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        time.sleep(0.5)  # the server notices the connection is gone
        s.extend(pv_rows(4))  # the dead call must take none of these
        time.sleep(3)  # past the dead call's timeout: it has finished either way
        with ab.connect(server.location) as remote:
            b = remote.consume("t", 4, timeout=5)
        assert sorted(b.indices.tolist()) == [0, 1, 2, 3]
        assert s.stats()["consumed"]["t"] == 4


def test_a_flight_consume_whose_client_died_stops_waiting(procs):
    """The server's call polls whether its client is still there: it ends long before its 30 s timeout."""
    import os
    import signal
    import time

    with ab.ExperienceStore(LLM_PV, capacity=64, tasks=["t"]) as s, ab.serve(s) as server:
        child = procs([sys.executable, "-c", WAITER, server.location, "30"])
        assert child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while server.calls.running()["call"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.calls.running()["call"] == 1  # the child's consume waits on the server
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 20  # well before the call's own 30 s (it polls every 0.2 s; a loaded machine)
        while server.calls.running()["call"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.calls.running()["call"] == 0
        s.extend(pv_rows(4))
        assert s.consume("t", 4).indices.tolist() == [0, 1, 2, 3] and s.stats()["in_flight"] == {"t": 0}


def test_batches_keep_the_schemas_column_order_with_fields_filled_later():
    with ab.ExperienceStore(GRPO, capacity=16, tasks=["t"]) as s:
        ids = s.extend(grpo_rows(4))
        s.update(ids, {"reward": np.ones(4, np.float32), "ref_logprobs": [[0.5]] * 4})
        names = list(GRPO["fields"])
        assert s.consume("t", 4).columns[:len(names)] == names
        assert s.sample(2).columns[:len(names)] == names
        assert s.to_table().column_names[:len(names)] == names
