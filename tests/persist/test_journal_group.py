"""Group commit of the journal (issue 25, speed): an fdatasync waits only for records other writers announced and
have not appended yet, never a blind window; writers that all wait already share one fdatasync. Real files."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import journal as jr

LONG = 5.0  # a window no test may wait out


def test_a_lone_writer_never_waits_the_group_window(tmp_path):
    j = jr.Journal(str(tmp_path), "group", window_s=LONG)
    try:
        t0 = time.monotonic()
        for i in range(5):
            j.wait(j.append("issued", {"next": i}))
        assert time.monotonic() - t0 < LONG / 2
        assert j.stats["fsyncs"] >= 5
    finally:
        j.close()


def test_writers_that_all_wait_already_do_not_wait_the_window(tmp_path):
    """The old rule (sleep a window whenever two callers wait) made writers queued behind a running fdatasync sleep
    the window after it, holding the sync lock, although all their records were in the file already."""
    j = jr.Journal(str(tmp_path), "group", window_s=LONG)
    try:
        big = j.append("batch", {"first": 0, "n": 1}, b"\1" * (16 << 20))
        j.sync_soon(big)  # a long fdatasync on the sync thread: the writers below queue behind it
        time.sleep(0.05)  # (it has started)
        tickets = [j.append("issued", {"next": i}) for i in range(4)]
        done: list[float] = []
        together = threading.Barrier(4)
        t0 = time.monotonic()

        def waiter(t: int) -> None:
            together.wait()  # all four wait at once, as writers that finished their copies
            j.wait(t)
            done.append(time.monotonic() - t0)

        threads = [threading.Thread(target=waiter, args=(t,)) for t in tickets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * LONG)
        assert len(done) == 4 and max(done) < LONG / 2, done
    finally:
        j.close()


def test_a_group_commit_waits_for_an_announced_record_and_shares_its_fdatasync(tmp_path):
    j = jr.Journal(str(tmp_path), "group", window_s=LONG)
    try:
        j.expect()  # another writer is encoding its batch
        mine = j.append("issued", {"next": 1})
        appended = threading.Event()

        def other() -> None:
            time.sleep(0.3)
            j.wait(j.append_prepared(jr.prepare("issued", {"next": 2}), expected=True))
            appended.set()

        t = threading.Thread(target=other)
        t0 = time.monotonic()
        t.start()
        j.wait(mine)
        waited = time.monotonic() - t0
        t.join(2 * LONG)
        assert appended.is_set()
        assert 0.25 < waited < LONG / 2, waited  # waited for the announced record, not the whole window
        assert j.stats["fsyncs"] == 1  # both records in one fdatasync (the segment header's is not counted)
    finally:
        j.close()


def test_a_withdrawn_announcement_stops_the_wait(tmp_path):
    j = jr.Journal(str(tmp_path), "group", window_s=LONG)
    try:
        j.expect()
        threading.Timer(0.2, j.unexpect).start()
        t0 = time.monotonic()
        j.wait(j.append("issued", {"next": 1}))
        assert time.monotonic() - t0 < LONG / 2
    finally:
        j.close()


def test_a_failed_extend_withdraws_its_announcement(tmp_path):
    """A batch refused by validation must not leave a phantom writer that every later group commit waits for."""
    s = ab.ExperienceStore({"name": "g", "fields": {"x": "float32"}}, capacity=64, durable=str(tmp_path / "run"),
                           durability="group")
    try:
        s._durable.journal.window_s = LONG
        for bad in ({"x": np.zeros((2, 3), np.float32)}, {"y": np.zeros(2)}):
            try:
                s.extend(bad)
            except ab.SchemaError:
                pass
        s.extend({"x": np.zeros(0, np.float32)})  # empty: nothing recorded
        t0 = time.monotonic()
        for _ in range(3):
            s.extend({"x": np.ones(4, np.float32)})
        assert time.monotonic() - t0 < LONG / 2
        assert len(s) == 12
    finally:
        s.close()


def test_a_lazy_request_waits_the_window_and_a_waiter_does_not(tmp_path):
    """`sync_soon(lazy=True)` (a pipelined extend nobody waits for yet) leaves the record un-synced for up to the
    window, so later records share its fdatasync; a `wait` meanwhile makes it durable at once, and an eager
    request after a lazy one starts the sync thread at once."""
    j = jr.Journal(str(tmp_path), "group", window_s=LONG)
    try:
        t = j.append("issued", {"next": 0})
        j.sync_soon(t, lazy=True)
        time.sleep(0.2)
        assert not j.is_durable(t) and j.stats["fsyncs"] == 0  # the sync thread holds it for the window
        t0 = time.monotonic()
        j.wait(t)
        assert j.is_durable(t) and time.monotonic() - t0 < LONG / 2
        t2 = j.append("issued", {"next": 1})
        j.sync_soon(t2, lazy=True)
        t3 = j.append("issued", {"next": 2})
        j.sync_soon(t3)  # eager: the sync thread starts now, covering both
        deadline = time.monotonic() + LONG / 2
        while not j.is_durable(t3) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert j.is_durable(t2) and j.is_durable(t3)
    finally:
        j.close()
    recs, torn, _ = jr.read_segments(str(tmp_path), 0)
    assert [r.meta["next"] for r in recs] == [0, 1, 2] and torn is None


def test_a_lazy_request_is_synced_after_the_window_without_a_waiter(tmp_path):
    j = jr.Journal(str(tmp_path), "group", window_s=0.05)
    try:
        t = j.append("issued", {"next": 0})
        j.sync_soon(t, lazy=True)
        deadline = time.monotonic() + LONG
        while not j.is_durable(t) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert j.is_durable(t) and j.stats["fsyncs"] == 1
    finally:
        j.close()


def test_pipelined_extends_share_fdatasyncs(tmp_path):
    """`extend(wait=False)` batches of one writer share fdatasyncs under "group" (at most one per window while
    nobody waits), and every handle reports durable once waited for; a writer acknowledging each batch still gets
    its fdatasync started at once (no window in its latency)."""
    s = ab.ExperienceStore({"name": "t", "fields": {"x": "int64"}}, capacity=10_000, durable=str(tmp_path / "run"),
                           durability="group")
    try:
        handles = [s.extend({"x": np.arange(i * 10, i * 10 + 10)}, wait=False) for i in range(40)]
        for h in handles:
            h.wait()
            assert h.durable
        st = s.stats()["journal"]
        assert st["fsyncs"] < 40, st
        before = st["fsyncs"]
        for _ in range(5):
            s.extend({"x": np.arange(5)})
        assert s.stats()["journal"]["fsyncs"] >= before + 1
    finally:
        s.close()
    with ab.ExperienceStore.restore(str(tmp_path / "run")) as again:
        assert len(again) == 40 * 10 + 25


def test_a_failed_fdatasync_fails_that_record_and_every_later_one(tmp_path, monkeypatch):
    """After an fdatasync fails (EIO: the kernel may have dropped the dirty pages and marks them clean, so a second
    fdatasync can return success without the data on disk), the journal acknowledges nothing more: the record's
    `wait` raises, and so does every later `wait` and `append`, whoever calls the fdatasync. (The failure is
    injected into `os.fdatasync` once: a real disk error needs a device this test cannot make.)"""
    import errno

    real = jr.os.fdatasync
    failed: list[int] = []

    def once(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "injected I/O error")
        real(fd)

    j = jr.Journal(str(tmp_path), "group")
    try:
        j.wait(j.append("issued", {"next": 0}))
        monkeypatch.setattr(jr.os, "fdatasync", once)
        t1 = j.append("issued", {"next": 1})
        with pytest.raises(OSError):
            j.wait(t1)
        assert failed
        with pytest.raises(OSError):
            j.wait(t1)  # a retry must not "succeed" on pages the kernel marked clean
        with pytest.raises(OSError):
            j.wait(j.append("issued", {"next": 2}))
        assert not j.is_durable(t1)
    finally:
        monkeypatch.setattr(jr.os, "fdatasync", real)
        j.close()
