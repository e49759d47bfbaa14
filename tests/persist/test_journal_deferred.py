"""Deferred journal writes (`Journal.append_prepared(..., defer=True)`): a batch's record takes its place in commit
order at the reservation and is written by the journal's thread while the writer copies its rows. Records stay in
lsn order whoever writes them, rotation of a full segment is queued in order, `wait`/`flush` never return before
the record is written, and a failed write fails every later record instead of writing after a partial one."""

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


@pytest.mark.parametrize("policy", POLICIES)
def test_deferred_and_inline_records_keep_commit_order(tmp_path, policy):
    j = jr.Journal(str(tmp_path), policy)
    tickets = []
    for i in range(40):
        payload = np.full(1000 + i, i, np.int32).tobytes()
        if i % 3:
            t = j.append_prepared(jr.prepare("batch", {"i": i}, payload), defer=True)
            j.sync_soon(t)
        else:
            t = j.append("update", {"i": i}, payload)  # inline: writes the deferred records before it first
            assert j.durable_lsn >= t or policy != "os"
        tickets.append(t)
    assert tickets == list(range(40))
    assert j.wait(tickets[-1]) and j.is_durable(tickets[-1])
    j.close()
    recs, torn, nxt = jr.read_segments(str(tmp_path), 0)
    assert torn is None and nxt == 40
    assert [r.meta["i"] for r in recs] == list(range(40))
    assert all(np.array_equal(np.frombuffer(r.payload, np.int32), np.full(1000 + i, i, np.int32))
               for i, r in enumerate(recs))


def test_flush_writes_a_deferred_record_without_the_thread(tmp_path):
    j = jr.Journal(str(tmp_path), "group")
    t = j.append_prepared(jr.prepare("batch", {"n": 1}, b"abc"), defer=True)  # nobody kicked the thread
    assert jr.read_segments(str(tmp_path), 0)[0] == []
    j.flush(t)
    assert [r.payload for r in jr.read_segments(str(tmp_path), 0)[0]] == [b"abc"]  # in the file now
    assert not j.is_durable(t)  # but not synced: "group" waits for that
    assert j.wait(t) and j.is_durable(t)
    j.close()


@pytest.mark.parametrize("policy", ["os", "group"])
def test_full_segments_rotate_in_order_under_many_writers(tmp_path, monkeypatch, policy):
    monkeypatch.setattr(jr, "SEGMENT_BYTES", 20_000)
    j = jr.Journal(str(tmp_path), policy)
    got: dict[int, list[int]] = {w: [] for w in range(4)}

    def writer(w: int) -> None:
        for k in range(30):
            payload = np.full(700, w * 1000 + k, np.int64).tobytes()
            if k % 2:
                t = j.append_prepared(jr.prepare("batch", {"w": w, "k": k}, payload), defer=True)
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
    """A real write failure (the file-size limit: EFBIG) in the journal's thread: the writer's wait raises, later
    appends raise, and the segment holds no record written after the partial one (a restore drops the torn tail)."""
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
        t = j.append_prepared(jr.prepare("batch", {{"i": 1}}, b"y" * 200_000), defer=True)
        j.sync_soon(t)
        try:
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


@pytest.mark.parametrize("mode", ["writer", "offload", "defer_write"])
def test_wait_false_returns_written_records(tmp_path, monkeypatch, mode):
    """`extend(wait=False)` returns once the batch's record is written (a kill of the process loses nothing it
    returned), under every policy, whether the writer or the journal's thread (offload: encoded there too;
    defer_write: encoded by the writer) writes it."""
    from arrowbuf.store import durable

    monkeypatch.setattr(durable, "OFFLOAD", mode == "offload")
    monkeypatch.setattr(durable, "DEFER_WRITE", mode == "defer_write")
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


def test_a_record_that_cannot_be_encoded_fails_the_journal_not_the_file(tmp_path):
    """A `Deferred` record is encoded when it is written; if that fails, its waiter gets OSError, nothing more is
    written (never an ill-formed record), and what was written before reads back intact."""
    j = jr.Journal(str(tmp_path), "group")
    j.wait(j.append("batch", {"i": 0}, b"ok"))

    def broken() -> jr.Prepared:
        raise ValueError("boom")

    t = j.append_prepared(jr.Deferred(broken, 100, 0), defer=True)
    with pytest.raises(OSError, match="could not be encoded"):
        j.wait(t)
    with pytest.raises(OSError):
        j.append("batch", {"i": 2}, b"late")
    j.close()
    recs, torn, nxt = jr.read_segments(str(tmp_path), 0)
    assert [r.meta["i"] for r in recs] == [0] and torn is None and nxt == 1


@pytest.mark.parametrize("mode", ["offload", "defer_write", "writer_sync", "sync_thread"])
@pytest.mark.parametrize("policy", POLICIES)
def test_offloaded_records_restore_exactly(tmp_path, monkeypatch, policy, mode):
    """With the records written on the journal's thread (offload: encoded there too; defer_write: encoded by the
    writer), or by the writer and made durable by it (writer_sync) or by the sync thread (sync_thread), 4 writers'
    batches (ragged and fixed columns) restore exactly, in seq order."""
    from arrowbuf.store import durable

    monkeypatch.setattr(durable, "OFFLOAD", mode == "offload")
    monkeypatch.setattr(durable, "DEFER_WRITE", mode == "defer_write")
    monkeypatch.setattr(durable, "WRITER_SYNC", mode == "writer_sync")
    schema = {"name": "t", "fields": {"x": "int64", "r": {"dtype": "int32", "ragged": True},
                                      "o": {"dtype": "float32", "shape": [3]}}}
    run = os.path.join(tmp_path, "run")
    s = ab.ExperienceStore(schema, capacity=10_000, durable=run, durability=policy)
    assert s.stats()["journal"]["offload"] is (mode == "offload")
    assert s.stats()["journal"]["defer_write"] is (mode == "defer_write")

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


@pytest.mark.parametrize("writer_sync", [True, False])
def test_a_synchronous_extend_syncs_on_its_own_thread(tmp_path, monkeypatch, writer_sync):
    """With `WRITER_SYNC` (the default) a synchronous extend under "group" makes its record durable itself: no
    journal sync thread is started, and each extend returns durable; without it the sync thread does the
    fdatasync. A pipelined extend (wait=False) still uses the sync thread either way."""
    from arrowbuf.store import durable

    monkeypatch.setattr(durable, "WRITER_SYNC", writer_sync)

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
        assert st["writer_sync"] is writer_sync and st["fsyncs"] >= 10
        assert (syncers() > before) is (not writer_sync)
        s.extend({"x": np.arange(3)}, wait=False).wait()
        assert syncers() > before
    finally:
        s.close()
    with ab.ExperienceStore.restore(str(tmp_path / "run")) as again:
        assert len(again) == 53
