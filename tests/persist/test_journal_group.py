"""Group commit of the journal (issue 25, speed): an fdatasync waits only for records other writers announced and
have not appended yet, never a blind window; writers that all wait already share one fdatasync. Real files."""

from __future__ import annotations

import threading
import time

import numpy as np

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
        s._core.journal.journal.window_s = LONG
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
