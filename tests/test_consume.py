"""Consumption per task (arrowbuf/consume.py): once per task, blocking, eviction hold, staleness, filters, budgets."""

from __future__ import annotations

import json
import pathlib
import sys
import threading

import numpy as np
import pytest

import arrowbuf as ab

from conftest import LLM

ROOT = pathlib.Path(__file__).resolve().parent.parent


def rows(n, start=0, pv=0, group=4):
    """`n` completions: row i has prompt i // group, i % 5 + 1 tokens, reward i."""
    i = np.arange(start, start + n)
    return {"prompt_id": i // group, "response_tokens": [[int(k)] * (int(k) % 5 + 1) for k in i],
            "reward": i.astype(np.float32), "done": np.ones(n, bool), "policy_version": np.full(n, pv)}


def store(capacity=64, **kw):
    return ab.ExperienceStore(LLM, capacity=capacity, **kw)


def test_two_tasks_each_see_every_row_once_with_all_columns():
    s = store(tasks=["ref", "train"])
    ids = s.extend(rows(10))
    a = s.consume("ref", 4)
    b = s.consume("ref", 100)
    c = s.consume("train", 100)
    np.testing.assert_array_equal(np.concatenate([a.indices, b.indices]), ids)
    np.testing.assert_array_equal(c.indices, ids)
    assert len(s.consume("ref", 5)) == 0 and len(s.consume("train", 5)) == 0
    d = c.to_numpy()
    assert set(c.columns) == set(LLM["fields"])
    np.testing.assert_array_equal(d["reward"], np.arange(10, dtype=np.float32))
    assert [list(r) for r in d["response_tokens"]] == rows(10)["response_tokens"]
    st = s.stats()
    assert st["consumed"] == {"ref": 10, "train": 10} and st["tasks"] == ["ref", "train"]


def test_concurrent_consumers_and_a_writer_get_each_row_exactly_once():
    s = store(capacity=4096, tasks=["a", "b"])
    total, got, errors = 600, {"a": [], "b": []}, []
    lock = threading.Lock()

    def writer():
        for k in range(0, total, 20):
            s.extend(rows(20, start=k))

    def consumer(task):
        try:
            seen = 0
            while True:
                with lock:
                    if sum(map(len, got[task])) >= total:
                        return
                b = s.consume(task, 7, timeout=0.2)
                with lock:
                    got[task].append(b.indices)
                    seen += len(b)
                r = b.to_numpy()["reward"]
                np.testing.assert_array_equal(r, b.indices.astype(np.float32))  # the rows' own data
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=consumer, args=(t,))
                                                   for t in ("a", "a", "a", "b", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for task in ("a", "b"):
        ids = np.concatenate(got[task])
        assert len(ids) == total and len(np.unique(ids)) == total  # no row twice, none missing


def test_consume_blocks_until_rows_arrive_then_returns_what_is_ready_at_the_deadline():
    s = store(tasks=["t"])
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", s.consume("t", 5, timeout=60)))
    t.start()
    s.extend(rows(3))
    s.extend(rows(2, start=3))  # the waiting consumer is woken by the commits, not by its deadline
    t.join(60)
    np.testing.assert_array_equal(out["b"].indices, np.arange(5))
    s.extend(rows(2, start=5))
    part = s.consume("t", 10, timeout=0.05)  # only 2 ready: they come back at the deadline
    np.testing.assert_array_equal(part.indices, [5, 6])
    assert len(s.consume("t", 3)) == 0


def test_a_new_row_in_a_recycled_slot_is_unconsumed():
    s = store(capacity=8, tasks=["t"])
    s.extend(rows(8))
    assert len(s.consume("t", 8)) == 8
    s.extend(rows(8, start=8))  # same ring positions, new generation
    np.testing.assert_array_equal(s.consume("t", 100).indices, np.arange(8, 16))


def test_eviction_waits_for_every_task_then_times_out_and_changes_nothing():
    s = store(capacity=8, tasks=["ref", "train"])
    s.extend(rows(8))
    s.consume("ref", 8)
    before = s.to_table()
    with pytest.raises(ab.InsertTimeout, match="train"):
        s.extend(rows(2, start=8), timeout=0.05)
    with pytest.raises(ab.InsertTimeout):
        s.append({k: v[0] for k, v in rows(1, start=8).items()})  # timeout=None: no wait
    assert s.to_table().equals(before)
    done = {}
    w = threading.Thread(target=lambda: done.setdefault("ids", s.extend(rows(2, start=8), timeout=60)))
    w.start()
    assert len(s.consume("train", 2)) == 2  # releases rows 0 and 1: the held writer goes on
    w.join(60)
    np.testing.assert_array_equal(done["ids"], [8, 9])
    assert s.stats()["first_seq"] == 2 and len(s) == 8


def test_stale_rows_are_dropped_and_counted_never_delivered():
    s = store(tasks=["t"])
    s.extend(rows(4, pv=1))
    s.extend(rows(4, start=4, pv=3))
    s.policy_version = 4
    b = s.consume("t", 100, max_staleness=1)
    np.testing.assert_array_equal(b.indices, np.arange(4, 8))
    assert s.stats()["stale_dropped"] == 4
    assert (b.to_numpy()["policy_version"] >= 3).all()
    assert len(s.consume("t", 100)) == 0  # dropped rows count as consumed for the task


def test_admission_control_refuses_old_rows_and_holds_rows_ahead_of_the_window():
    s = store(tasks=["t"], max_staleness=1)
    s.policy_version = 5
    with pytest.raises(ab.InvalidArgument, match="staleness window"):
        s.extend(rows(2, pv=3))
    assert len(s) == 0
    s.extend(rows(2, pv=4))
    with pytest.raises(ab.InsertTimeout, match="ahead"):
        s.extend(rows(2, start=2, pv=7), timeout=0.05)
    assert len(s) == 2
    done = {}
    w = threading.Thread(target=lambda: done.setdefault("ids", s.extend(rows(2, start=2, pv=7), timeout=60)))
    w.start()
    s.policy_version = 6  # the version advances: the writer is admitted
    w.join(60)
    np.testing.assert_array_equal(done["ids"], [2, 3])


def test_stale_rows_may_be_evicted_unconsumed_under_store_max_staleness():
    s = store(capacity=4, tasks=["t"], max_staleness=0)
    s.extend(rows(4, pv=0))
    s.policy_version = 1
    s.extend(rows(2, start=4, pv=1), timeout=0)  # rows 0, 1 are stale: no wait
    np.testing.assert_array_equal(s.consume("t", 100, max_staleness=0).indices, [4, 5])


def test_where_filters_on_scalar_columns_and_leaves_the_rest_unconsumed():
    s = store(tasks=["t"])
    s.extend(rows(10))
    b = s.consume("t", 100, where="reward >= 6 AND prompt_id < 9")
    np.testing.assert_array_equal(b.indices, [6, 7, 8, 9])
    np.testing.assert_array_equal(s.consume("t", 100).indices, np.arange(6))


def test_a_where_that_escapes_its_parentheses_cannot_add_rows():
    s = store(tasks=["t"])
    s.extend(rows(4))
    b = s.consume("t", 100, where="reward > 100) UNION SELECT 2 UNION SELECT 99 --")
    np.testing.assert_array_equal(b.indices, [2])  # only candidate rows can pass: the sandbox result filters them


@pytest.mark.parametrize("where", ["len(response_tokens) > 2", "reward >", "reward > (SELECT version())",
                                   "1; DROP TABLE experience", ""])
def test_a_bad_or_non_scalar_where_is_a_clear_error_that_consumes_nothing(where):
    s = store(tasks=["t"])
    s.extend(rows(4))
    with pytest.raises(ab.InvalidArgument):
        s.consume("t", 100, where=where)
    assert len(s.consume("t", 100)) == 4


def test_where_never_reads_ragged_columns():
    s = store(tasks=["t"])
    s.extend(rows(4))
    with pytest.raises(ab.InvalidArgument, match="scalar columns") as e:
        s.consume("t", 10, where="response_tokens IS NOT NULL")
    assert "'response_tokens'" not in e.value.args[0].split("columns")[1].split("(")[0]  # not among the columns
    table = s._consume.filters.table(np.arange(4))
    assert set(table.column_names) == {"prompt_id", "reward", "done", "policy_version", "episode_id", "step", "seq"}


def test_max_tokens_budget():
    s = store(tasks=["t"])
    s.extend(rows(10))  # tokens per row: 1 2 3 4 5 1 2 3 4 5
    b = s.consume("t", 100, max_tokens=7)
    np.testing.assert_array_equal(b.indices, [0, 1, 2])
    assert sum(len(r) for r in b.to_numpy()["response_tokens"]) <= 7
    b = s.consume("t", 100, max_tokens=2)  # row 3 alone is over budget: delivered alone, never stuck
    np.testing.assert_array_equal(b.indices, [3])


@pytest.mark.parametrize("kwargs", [{"task": "nope"}, {"n": 0}, {"n": 2.5}, {"timeout": -1},
                                    {"timeout": float("nan")}, {"max_staleness": -1}, {"require": ["nope"]},
                                    {"where": 3}, {"max_tokens": 0}, {"where": "x" * 5000}])
def test_bad_requests_raise_invalid_argument_and_change_nothing(kwargs):
    s = store(tasks=["t"])
    s.extend(rows(4))
    args = {"task": "t", "n": 2, **kwargs}
    with pytest.raises(ab.InvalidArgument):
        s.consume(args.pop("task"), args.pop("n"), **args)
    assert s.stats()["consumed"] == {"t": 0}
    assert len(s.consume("t", 100)) == 4


def test_tasks_declared_later_and_bad_declarations():
    s = store(tasks=["ref"])
    s.extend(rows(3))
    s.add_task("train")
    assert s.tasks == ["ref", "train"]
    assert len(s.consume("train", 10)) == 3
    with pytest.raises(ab.InvalidArgument):
        s.add_task("train")
    with pytest.raises(ab.InvalidArgument):
        store(tasks=["a", "a"])
    with pytest.raises(ab.InvalidArgument):
        store(tasks="ab")
    with pytest.raises(ab.SchemaError):
        ab.ExperienceStore(ab.load_schema("atari"), capacity=8, max_staleness=1)  # no policy_version field
    with pytest.raises(ab.InvalidArgument):
        s.policy_version = -1


def test_closing_wakes_a_waiting_consumer():
    s = store(tasks=["t"])
    err = []

    def wait():
        try:
            s.consume("t", 5, timeout=60)
        except ab.StoreClosed as exc:
            err.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    s.close()  # before or while it waits: either way StoreClosed, never a hang
    t.join(60)
    assert not t.is_alive() and len(err) == 1


# ---------------------------------------------------------------------------------------------------- over Flight
CONSUMER = r"""
import json, sys
import arrowbuf as ab
location, task, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
got = []
with ab.connect(location) as remote:
    while True:
        done = remote.policy_version == 1  # the writer sets it once every row is written
        b = remote.consume(task, n, timeout=0.2)
        got += b.indices.tolist()
        if len(b) == 0 and done:
            break
print(json.dumps(got))
"""


@pytest.fixture
def served():
    s = store(capacity=4096, tasks=["ref", "train"])
    server = ab.serve(s)
    remote = ab.connect(server.location)
    try:
        yield s, remote
    finally:
        remote.close()
        server.close()
        s.close()


def test_each_task_consumes_each_row_once_across_processes_and_threads_over_flight(served, procs):
    s, remote = served
    location = remote.location
    total = 400
    workers = [procs([sys.executable, "-c", CONSUMER, location, "train", "9"]) for _ in range(2)]
    got, errors = [], []

    def thread_consumer():
        try:
            with ab.connect(location) as mine:
                while True:
                    done = mine.policy_version == 1
                    b = mine.consume("ref", 11, timeout=0.2)
                    got.append(b.indices)
                    if len(b) == 0 and done:
                        return
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=thread_consumer) for _ in range(2)]
    for t in threads:
        t.start()
    with ab.connect(location) as writer:
        for k in range(0, total, 25):
            writer.extend(rows(25, start=k))
        writer.policy_version = 1
    for t in threads:
        t.join(120)
    assert not errors
    train = []
    for p in workers:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        train += json.loads(out)
    ref = np.concatenate(got)
    assert sorted(train) == list(range(total))  # every row once for "train", split between two processes
    assert sorted(ref.tolist()) == list(range(total))  # and once for "ref", between two threads


def test_every_store_like_class_offers_the_consume_surface(served):
    from arrowbuf.engine.consume import ConsumeSurface
    from arrowbuf.ray import ShardedStore

    s, remote = served
    assert isinstance(s, ConsumeSurface) and isinstance(remote, ConsumeSurface)
    for name in ("consume", "add_task", "tasks", "policy_version"):
        assert hasattr(ShardedStore, name)


def test_the_same_calls_over_flight(served):
    s, remote = served
    remote.extend(rows(10, pv=2))
    remote.policy_version = 3
    assert remote.policy_version == 3 == s.policy_version
    b = remote.consume("train", 100, max_staleness=1, where="reward < 8", max_tokens=12, timeout=0)
    np.testing.assert_array_equal(b.indices, [0, 1, 2, 3])  # 1+2+3+4 tokens
    assert [list(r) for r in b.to_numpy()["response_tokens"]] == rows(4)["response_tokens"]
    remote.add_task("extra")
    assert "extra" in remote.tasks and len(remote.consume("extra", 100)) == 10
    assert remote.stats()["consumed"]["extra"] == 10
    empty = remote.consume("extra", 5)
    assert len(empty) == 0 and "response_tokens" in empty.columns


@pytest.mark.parametrize("kwargs", [{"task": "nope"}, {"require": ["nope"]}, {"where": "len(response_tokens) > 1"},
                                    {"max_staleness": -1}, {"where": "x" * 5000}, {"timeout": -1},
                                    {"max_tokens": 0}, {"n": 10**9}])
def test_bad_consume_requests_over_flight_are_invalid_argument_and_change_nothing(served, kwargs):
    s, remote = served
    remote.extend(rows(4))
    args = {"task": "train", "n": 2, **kwargs}
    with pytest.raises(ab.InvalidArgument):
        remote.consume(args.pop("task"), args.pop("n"), **args)
    assert s.stats()["consumed"]["train"] == 0
    with pytest.raises(ab.InvalidArgument):
        remote.policy_version = -1
    assert len(remote.consume("train", 100)) == 4


def test_a_raw_flight_consume_ticket_is_validated_before_any_work(served):
    import pyarrow.flight as flight

    s, remote = served
    s.extend(rows(4))
    client = flight.connect(remote.location)
    ok = {"v": 2, "kind": "consume", "task": "train", "n": 2}
    for body in ({**ok, "v": 1}, {"v": 2, "kind": "consume", "task": "train"}, {**ok, "bogus": 1}, {**ok, "task": ""},
                 {**ok, "max_tokens": 2**50}, {**ok, "require": "reward"}, {**ok, "where": 3}):
        with pytest.raises(flight.FlightServerError):
            client.do_get(flight.Ticket(json.dumps(body).encode())).read_all()
    with pytest.raises(flight.FlightServerError, match="version 2"):
        list(client.do_action(flight.Action("set_policy_version", json.dumps({"policy_version": 3}).encode())))
    client.close()
    assert s.stats()["consumed"]["train"] == 0 and s.policy_version == 0


# ---------------------------------------------------------------------------------------------- fields filled later
GRPO = {**LLM, "fields": {**LLM["fields"], "reward": {"dtype": "float32", "later": True},
                          "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True}}}


def rollouts(n, start=0):
    r = rows(n, start=start)
    del r["reward"]
    return r


def test_rows_are_delivered_only_once_their_required_fields_are_written():
    s = ab.ExperienceStore(GRPO, capacity=64, tasks=["ref", "train"])
    ids = s.extend(rollouts(6))
    assert len(s.consume("train", 10, require=["reward", "ref_logprobs"])) == 0
    ref = s.consume("ref", 10)  # no requirement: every row at once
    np.testing.assert_array_equal(ref.indices, ids)
    s.update(ids[:4], {"ref_logprobs": [[0.5] * 2] * 4})
    s.update(ids[2:], {"reward": np.ones(4, np.float32)})
    b = s.consume("train", 10, require=["reward", "ref_logprobs"])
    np.testing.assert_array_equal(b.indices, ids[2:4])  # only the rows with both fields
    assert (b.to_numpy()["reward"] == 1).all()
    s.update(ids[4:], {"ref_logprobs": [[0.1]] * 2})
    np.testing.assert_array_equal(s.consume("train", 10, require=["reward", "ref_logprobs"]).indices, ids[4:])


def test_an_update_wakes_a_consumer_waiting_for_a_field():
    s = ab.ExperienceStore(GRPO, capacity=64, tasks=["train"])
    ids = s.extend(rollouts(3))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", s.consume("train", 3, require=["reward"], timeout=60)))
    t.start()
    s.update(ids, {"reward": np.arange(3, dtype=np.float32)})
    t.join(60)
    np.testing.assert_array_equal(out["b"].indices, ids)


def test_where_sees_unwritten_later_fields_as_null():
    s = ab.ExperienceStore(GRPO, capacity=64, tasks=["t"])
    ids = s.extend(rollouts(4))
    s.update(ids[:2], {"reward": np.array([1.0, -1.0], np.float32)})
    np.testing.assert_array_equal(s.consume("t", 10, where="reward IS NULL").indices, ids[2:])
    np.testing.assert_array_equal(s.consume("t", 10, where="reward > 0").indices, ids[:1])


WRITER = r"""
import sys
import numpy as np
import arrowbuf as ab
location, total = sys.argv[1], int(sys.argv[2])
with ab.connect(location) as remote:
    for k in range(0, total, 20):
        i = np.arange(k, k + 20)
        remote.extend({"prompt_id": i // 4, "response_tokens": [[int(x)] for x in i], "done": np.ones(20, bool),
                       "policy_version": np.zeros(20, np.int64)})
    remote.policy_version = 1  # every row is written
"""

REWARDER = r"""
import sys
import numpy as np
import arrowbuf as ab
with ab.connect(sys.argv[1]) as remote:
    while True:
        done = remote.policy_version == 1
        b = remote.consume("reward", 16, timeout=0.2)
        if len(b):
            remote.update(b.indices, {"reward": (b.to_numpy()["prompt_id"] * 2).astype(np.float32)})
        elif done:
            break
"""


def test_fields_filled_across_processes_reach_the_trainer_once_and_only_when_complete(procs):
    s = ab.ExperienceStore(GRPO, capacity=4096, tasks=["reward", "train"])
    server = ab.serve(s)
    try:
        total = 200
        writer = procs([sys.executable, "-c", WRITER, server.location, str(total)])
        rewarder = procs([sys.executable, "-c", REWARDER, server.location])
        got, rewards, prompts = [], [], []
        with ab.connect(server.location) as trainer:
            while sum(map(len, got)) < total:
                b = trainer.consume("train", 32, require=["reward"], timeout=0.2)
                if not len(b) and rewarder.poll() is not None:  # it has written every reward it will
                    break
                d = b.to_numpy()
                got.append(b.indices)
                rewards.append(d["reward"])
                prompts.append(d["prompt_id"])
        for p in (writer, rewarder):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
        ids = np.concatenate(got)
        assert sorted(ids.tolist()) == list(range(total))  # each row once
        np.testing.assert_array_equal(np.concatenate(rewards), np.concatenate(prompts) * 2)  # always complete
    finally:
        server.close()
        s.close()


def test_where_judges_a_row_again_after_its_fields_change():
    s = ab.ExperienceStore(GRPO, capacity=64, tasks=["t"])
    ids = s.extend(rollouts(3))
    assert len(s.consume("t", 10, where="reward > 0")) == 0  # NULL rewards fail (and that result is cached)
    s.update(ids[:2], {"reward": np.array([-1.0, 1.0], np.float32)})  # written: judged again
    np.testing.assert_array_equal(s.consume("t", 10, where="reward > 0").indices, ids[1:2])
    s.update(ids[:1], {"reward": np.array([5.0], np.float32)})  # rewritten: judged again
    np.testing.assert_array_equal(s.consume("t", 10, where="reward > 0").indices, ids[:1])
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", s.consume("t", 1, where="reward > 0", timeout=60)))
    t.start()
    s.update(ids[2:], {"reward": np.array([3.0], np.float32)})  # wakes the waiting consumer
    t.join(60)
    np.testing.assert_array_equal(out["b"].indices, ids[2:])


def test_a_small_ring_under_pressure_delivers_every_row_once_per_task_never_torn():
    s = store(capacity=16, tasks=["a", "b"])
    total, got, errors = 400, {"a": [], "b": []}, []
    lock = threading.Lock()

    def writer():
        try:
            for k in range(0, total, 5):
                s.extend(rows(5, start=k), timeout=60)  # held until both tasks consumed what it evicts
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def consumer(task):
        try:
            while True:
                with lock:
                    if sum(map(len, got[task])) >= total:
                        return
                b = s.consume(task, 3, timeout=0.2)
                d = b.to_numpy()
                np.testing.assert_array_equal(d["reward"], b.indices.astype(np.float32))  # the row, not its successor
                assert [list(r) for r in d["response_tokens"]] == [[int(i)] * (int(i) % 5 + 1) for i in b.indices]
                with lock:
                    got[task].append(b.indices)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=consumer, args=(t,))
                                                   for t in ("a", "a", "b", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for task in ("a", "b"):
        ids = np.concatenate(got[task])
        assert sorted(ids.tolist()) == list(range(total)), task
    assert s.stats()["inserts"] == total


# ---------------------------------------------------------------------- checkpoints (issue 15 x 16)
def test_a_restored_store_keeps_each_tasks_consumption_policy_version_and_counters(tmp_path):
    s = store(capacity=64, tasks=["ref", "train"], max_staleness=3)
    again = None
    try:
        ids = np.concatenate([s.extend(rows(12, pv=0)), s.extend(rows(8, start=12, pv=2))])
        s.policy_version = 2
        np.testing.assert_array_equal(s.consume("train", 4).indices, ids[:4])
        # rows 4..11 (version 0) are stale for max_staleness=1: dropped for "train", then rows 12, 13 delivered
        np.testing.assert_array_equal(s.consume("train", 2, max_staleness=1).indices, ids[12:14])
        before = s.stats()
        assert before["stale_dropped"] == 8 and before["consumed"] == {"ref": 0, "train": 6}
        s.checkpoint(tmp_path / "ckpt")
        s.consume("ref", 3)  # after the snapshot point: not in the checkpoint
        again = ab.ExperienceStore.restore(tmp_path / "ckpt")
        assert again.tasks == ["ref", "train"] and again.policy_version == 2
        st = again.stats()
        assert st["stale_dropped"] == 8 and st["consumed"] == {"ref": 0, "train": 6}
        np.testing.assert_array_equal(again.consume("train", 100).indices, ids[14:])  # only the unconsumed rows
        np.testing.assert_array_equal(again.consume("ref", 100).indices, ids)          # every row
        assert len(again.consume("train", 100)) == 0 and len(again.consume("ref", 100)) == 0
        new = again.extend(rows(2, start=20, pv=2))  # rows written after the restore are unconsumed for both
        np.testing.assert_array_equal(again.consume("train", 100).indices, new)
        np.testing.assert_array_equal(again.consume("ref", 100).indices, new)
        with pytest.raises(ab.InsertTimeout):  # the store's max_staleness (admission control) came back too
            again.extend(rows(1, start=22, pv=6), timeout=None)
    finally:
        s.close()
        if again is not None:
            again.close()


def test_a_checkpoint_of_a_store_without_tasks_restores_none_and_keeps_the_policy_version(tmp_path):
    s = store()
    try:
        s.extend(rows(5))
        s.policy_version = 4
        s.checkpoint(tmp_path / "ckpt")
    finally:
        s.close()
    with ab.ExperienceStore.restore(tmp_path / "ckpt") as again:
        assert again.tasks == [] and again.policy_version == 4 and len(again) == 5


def test_a_restored_group_store_delivers_only_the_groups_a_task_had_not_consumed(tmp_path):
    s = store(capacity=64, tasks=["ref", "train"], sampler=ab.samplers.Group(key="prompt_id", size=4))
    try:
        ids = s.extend(rows(16))
        np.testing.assert_array_equal(s.consume("train", 8).indices, ids[:8])
        s.checkpoint(tmp_path / "ckpt")
    finally:
        s.close()
    with ab.ExperienceStore.restore(tmp_path / "ckpt") as again:
        np.testing.assert_array_equal(again.consume("train", 100).indices, ids[8:])
        np.testing.assert_array_equal(again.consume("ref", 100).indices, ids)
