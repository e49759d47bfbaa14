"""How the journal writes: records in lsn order from many writers, rotation of a full segment queued in order,
`wait` never returns before the record is durable, a failed write fails every later record instead of writing after
a partial one, `extend(wait=False)` returns written records, and a synchronous extend makes its own record durable
(the journal's sync thread serves pipelined extends)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from arrowbuf.persist import journal as jr

POLICIES = ["os", "group", "batch"]


@pytest.mark.parametrize("policy", ["os", "group"])
def test_full_segments_rotate_in_order_under_many_writers(tmp_path, monkeypatch, policy):
    monkeypatch.setattr(jr, "SEGMENT_BYTES", 20_000)
    j = jr.Journal(str(tmp_path), policy)
    got: dict[int, list[int]] = {w: [] for w in range(4)}

    def writer(w: int) -> None:
        for k in range(30):
            payload = np.full(700, w * 1000 + k, np.int64).tobytes()
            if k % 2:
                t = j.append_prepared(jr.prepare("batch", {"w": w, "k": k}, payload))
                j.sync_soon(t)
            else:
                t = j.append("batch", {"w": w, "k": k}, payload)
            j.wait(t)
            got[w].append(t)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mid = j.rotate()  # a checkpoint's rotation, queued behind everything appended
    j.append("task", {"name": "after"})
    j.close()
    segs = jr.segments(str(tmp_path))
    assert len(segs) > 5 and segs[-1][0] == mid
    recs, torn, _ = jr.read_segments(str(tmp_path), 0)
    assert torn is None and recs[-1].kind == "task" and recs[-1].lsn == mid
    batches = [r for r in recs if r.kind == "batch"]
    assert len(batches) == 120
    for w in range(4):  # each writer's records in its order, each payload intact
        mine = [r for r in batches if r.meta["w"] == w]
        assert [r.meta["k"] for r in mine] == list(range(30))
        assert [r.lsn for r in mine] == got[w]
        assert all((np.frombuffer(r.payload, np.int64) == w * 1000 + r.meta["k"]).all() for r in mine)
    for _, path in segs:  # every segment is an Arrow stream pyarrow reads
        assert pa.ipc.open_stream(path).read_all().num_rows >= 1


def test_a_failed_write_fails_every_later_record(tmp_path):
    """A real write failure (the file-size limit: EFBIG): the writer's append raises, later appends raise, and the
    segment holds no record written after the partial one (a restore drops the torn tail)."""
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        import numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from arrowbuf.persist import journal as jr
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        j = jr.Journal({str(tmp_path)!r}, "group")
        ok = j.append("batch", {{"i": 0}}, b"x" * 1000)
        j.wait(ok)
        size = os.path.getsize(jr.segments({str(tmp_path)!r})[0][1])
        # a limit in whole 4 KiB blocks: a direct write (arrowbuf.persist.appender) stops at it, then gets EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 12 * 4096, resource.RLIM_INFINITY))
        try:
            t = j.append_prepared(jr.prepare("batch", {{"i": 1}}, b"y" * 200_000))
            j.wait(t)
            print("NO ERROR")
        except OSError as e:
            print("WAIT", e.errno)
        try:
            j.append("batch", {{"i": 2}}, b"z")
            print("NO ERROR")
        except OSError as e:
            print("APPEND", e.errno)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import errno
    assert out.stdout.split() == ["WAIT", str(errno.EFBIG), "APPEND", str(errno.EFBIG)]
    recs, torn, nxt = jr.read_segments(str(tmp_path), 0)
    assert [r.meta["i"] for r in recs] == [0] and nxt == 1
    assert torn is not None  # the partial record, dropped


def test_wait_false_returns_written_records(tmp_path):
    """`extend(wait=False)` returns once the batch's record is written (a kill of the process loses nothing it
    returned), under every policy."""
    for policy in POLICIES:
        run = os.path.join(tmp_path, policy)
        s = ab.ExperienceStore({"name": "t", "fields": {"x": "int64"}}, capacity=1000, durable=run,
                               durability=policy)
        handles = [s.extend({"x": np.arange(i * 10, i * 10 + 10)}, wait=False) for i in range(20)]
        jdir = os.path.join(run, "_journal")
        seg = os.path.join(jdir, sorted(n for n in os.listdir(jdir) if n.endswith(".arrows"))[-1])
        recs, _, _ = jr.read_segments(run, 0)  # read while the store is open: every returned batch is there
        batches = [r for r in recs if r.kind == "batch"]
        assert [r.meta["first"] for r in batches] == [int(h.ids[0]) for h in handles]
        for h in handles:
            h.wait()
        assert os.path.getsize(seg) > 0
        s.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_many_writers_records_restore_exactly(tmp_path, policy):
    """4 writers' batches (ragged and fixed columns), synchronous and pipelined (made durable by the writer, or by
    the journal's sync thread), restore exactly, in seq order."""
    schema = {"name": "t", "fields": {"x": "int64", "r": {"dtype": "int32", "ragged": True},
                                      "o": {"dtype": "float32", "shape": [3]}}}
    run = os.path.join(tmp_path, "run")
    s = ab.ExperienceStore(schema, capacity=10_000, durable=run, durability=policy)

    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        for k in range(25):
            n = int(rng.integers(1, 9))
            s.extend({"x": np.full(n, w * 1000 + k), "r": [np.arange(rng.integers(0, 5), dtype=np.int32)] * n,
                      "o": np.full((n, 3), k, np.float32)}, wait=bool(k % 2))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = s.to_table()
    s.close()
    again = ab.ExperienceStore.restore(run)
    try:
        assert again.to_table().equals(before)
    finally:
        again.close()


def test_start_writeback_starts_the_disk_write_without_waiting(tmp_path):
    """`record.start_writeback` (sync_file_range) succeeds on a journal-like file on Linux and leaves nothing for the
    caller to wait for; an fd that is not open is refused (False), never raised."""
    from arrowbuf.persist import record

    fd = os.open(os.path.join(tmp_path, "f"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"\1" * (1 << 20))
        assert record.start_writeback(fd) is (sys.platform == "linux")
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert record.start_writeback(fd) is False


def test_a_synchronous_extend_syncs_on_its_own_thread(tmp_path):
    """A synchronous extend under "group" makes its record durable itself: no journal sync thread is started, and
    each extend returns durable. A pipelined extend (wait=False) uses the sync thread."""

    def syncers() -> int:
        return sum(t.name == "arrowbuf-journal-sync" and t.is_alive() for t in threading.enumerate())

    before = syncers()
    s = ab.ExperienceStore({"name": "t", "fields": {"x": "int64"}}, capacity=1000, durable=str(tmp_path / "run"),
                           durability="group")
    try:
        for i in range(10):
            s.extend({"x": np.arange(i * 5, i * 5 + 5)})
            st = s.stats()["journal"]
            assert st["durable_lsn"] == st["next_lsn"] - 1
        assert st["fsyncs"] >= 10
        assert syncers() == before
        s.extend({"x": np.arange(3)}, wait=False).wait()
        assert syncers() > before
    finally:
        s.close()
    with ab.ExperienceStore.restore(str(tmp_path / "run")) as again:
        assert len(again) == 53
