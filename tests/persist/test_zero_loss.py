"""Zero loss where checkpoints meet the journal (issue 38): each finding of the independent review as a test that
failed on the code before the fix.

1. a checkpoint taken while a batch's rows are being copied kept neither the batch nor its journal record;
2. a checkpoint dropped a whole sealed chunk once its first row was evicted (its live rows were lost);
3. the `_journal` directory's entry was not fsynced until the next checkpoint (a power loss lost everything);
4. torn-tail classification: zeros at the end of the last record are a torn tail; a whole record with a flipped
   bit (its length field included) is StoreCorrupt, never dropped silently;
5. `update` applied its values before journaling them (a consumer could deliver a value whose record was not
   durable while its own consumption record was);
and the journal directory's hygiene: modes, a pre-created directory other users can write, a FIFO or a symbolic
link planted as the newest segment. Real stores, real files, real threads.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import journal as jr
from arrowbuf.persist import manifest as mf
from arrowbuf.store import durable as durable_mod

POLICIES = ["group", "batch", "os"]
FIXED = {"name": "fixed", "version": 1, "fields": {
    "rid": {"dtype": "int64"}, "vec": {"dtype": "float32", "shape": [4096]}, "done": {"dtype": "bool"}},
    "episode_end": ["done"]}
SMALL = {"name": "small", "version": 1, "fields": {"rid": {"dtype": "int64"}, "done": {"dtype": "bool"}},
         "episode_end": ["done"]}
LATER = {"name": "later", "version": 1, "fields": {"rid": {"dtype": "int64"},
         "reward": {"dtype": "float32", "later": True}, "done": {"dtype": "bool"}}, "episode_end": ["done"]}


def fixed_rows(rid0, n):
    vec = np.broadcast_to(np.arange(rid0, rid0 + n, dtype=np.float32)[:, None], (n, 4096))
    return {"rid": np.arange(rid0, rid0 + n), "vec": np.ascontiguousarray(vec), "done": np.ones(n, bool)}


def small_rows(rid0, n):
    return {"rid": np.arange(rid0, rid0 + n), "done": np.ones(n, bool)}


def rids(store):
    return store.to_table(columns=["rid"])["rid"].to_pylist()


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_while_a_batch_is_copied_keeps_it(tmp_path, policy):
    """A batch whose record went to the journal at its reservation, and whose rows (64 MiB: copied outside the write
    lock for tens of milliseconds) were still being copied when a checkpoint started: the checkpoint used to cut the
    journal below its record without holding its rows, so a clean close and restore lost it."""
    d = str(tmp_path / "run")
    n = 4096  # 4096 rows x 16 KiB
    store = ab.ExperienceStore(FIXED, capacity=4 * n, durable=d, durability=policy)
    store.extend(fixed_rows(0, n))
    lsn0 = store.stats()["journal"]["next_lsn"]
    acked: dict[str, np.ndarray] = {}
    batch = fixed_rows(n, n)
    writer = threading.Thread(target=lambda: acked.update(ids=store.extend(batch)))
    writer.start()
    while store.stats()["journal"]["next_lsn"] == lsn0 and writer.is_alive():
        pass  # its record is appended at its reservation: the copy is under way now
    store.checkpoint()
    writer.join()
    store.close()
    again = ab.ExperienceStore.restore(d)
    try:
        assert rids(again) == list(range(2 * n)), "an acknowledged batch is missing after restore"
        got = again.to_table(columns=["vec"])["vec"].combine_chunks().to_numpy_ndarray()
        np.testing.assert_array_equal(got[:, 0], np.arange(2 * n, dtype=np.float32))
    finally:
        again.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_while_a_consume_gathers_keeps_its_rows_consumed(tmp_path, policy):
    """A consume without a lease journals its rows' consumption when it marks them, then gathers them (64 MiB here:
    tens of milliseconds outside the store's lock). A checkpoint taken during that gather recorded the rows as not
    consumed (at least once, for a plain checkpoint) and cut the journal below their record: the consume returned
    them, and a restore delivered them again (the crash harness's "consumed row delivered again")."""
    d = str(tmp_path / "run")
    n = 4096  # 4096 rows x 16 KiB
    store = ab.ExperienceStore(FIXED, capacity=2 * n, durable=d, durability=policy, tasks=["train"])
    store.extend(fixed_rows(0, n))
    store.checkpoint()
    lsn0 = store.stats()["journal"]["next_lsn"]
    got: dict[str, list[int]] = {}
    consumer = threading.Thread(target=lambda: got.update(ids=store.consume("train", n).indices.tolist()))
    consumer.start()
    while store.stats()["journal"]["next_lsn"] == lsn0 and consumer.is_alive():
        pass  # its record is appended when it marks the rows: the gather is under way now
    store.checkpoint()
    consumer.join()
    assert got["ids"] == list(range(n))
    store.close()
    again = ab.ExperienceStore.restore(d)
    try:
        assert again.consume("train", n, timeout=0).indices.tolist() == [], \
            "rows a returned consume delivered came back after the checkpoint and restore"
    finally:
        again.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_keeps_the_live_rows_of_a_chunk_whose_head_was_evicted(tmp_path, policy, monkeypatch):
    """A writer evicts the first rows of a sealed chunk while a checkpoint copies the store: the chunk's other rows
    (here rows no task has consumed yet, held back from eviction) are live and acknowledged; they used to be left
    out of the checkpoint with the whole chunk, and the journal that held them was cut."""
    d = str(tmp_path / "run")
    store = ab.ExperienceStore(SMALL, capacity=16, chunk_rows=8, durable=d, durability=policy, tasks=["t"])
    store.extend(small_rows(0, 16))  # chunks [0, 8) and [8, 16)
    assert store.consume("t", 9).indices.tolist() == list(range(9))  # rows 9..15 wait for task t
    real = durable_mod.write_checkpoint

    def with_writer(*args, **kwargs):
        def after_read(i):  # the checkpoint's test hook: a write while it reads its chunks, as a concurrent writer
            if i == 0:
                store.extend(small_rows(100, 9))  # evicts rows 0..8 (consumed): row 8 is the head of chunk 1
        return real(*args, _after_read=after_read, **kwargs)

    monkeypatch.setattr(durable_mod, "write_checkpoint", with_writer)
    store.checkpoint()
    live = rids(store)
    assert live == [*range(9, 16), *range(100, 109)]
    store.close()
    again = ab.ExperienceStore.restore(d)
    try:
        assert rids(again) == live
        assert again.consume("t", 100).indices.tolist() == list(range(9, 25))  # unconsumed rows come back once
    finally:
        again.close()


def test_checkpoint_still_drops_rows_overwritten_while_it_copied(tmp_path):
    """The other side of the rule: rows a writer overwrote while a (non-durable) checkpoint copied them are left out
    (a torn row is never written), and what survives is a contiguous range up to the snapshot point."""
    store = ab.ExperienceStore(SMALL, capacity=16, chunk_rows=8)
    store.extend(small_rows(0, 16))
    from arrowbuf.persist.checkpoint import checkpoint as write_checkpoint

    def after_read(i):
        if i == 0:
            store.extend(small_rows(100, 12))  # arena of 24 rows: positions 0..3 (rows 0..3) are overwritten

    info = write_checkpoint(store._core, str(tmp_path / "ck"), _after_read=after_read)
    assert info["first_seq"] == 4 and info["next_seq"] == 16 and info["dropped_rows"] == 4
    again = ab.ExperienceStore.restore(str(tmp_path / "ck"))
    try:
        assert rids(again) == list(range(4, 16))
    finally:
        again.close()
        store.close()


class _DirEvents:
    """Every directory the library creates and every directory it fsyncs, in order (os functions wrapped)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        self.paths: dict[int, str] = {}
        real_open, real_mkdir, real_fsync, real_close = os.open, os.mkdir, os.fsync, os.close

        def _open(path, flags, mode=0o777, *, dir_fd=None):
            fd = real_open(path, flags, mode) if dir_fd is None else real_open(path, flags, mode, dir_fd=dir_fd)
            self.paths[fd] = os.path.abspath(path)
            return fd

        def _mkdir(path, mode=0o777, *a, **k):
            real_mkdir(path, mode, *a, **k)
            self.events.append(("mkdir", os.path.abspath(path)))

        def _fsync(fd):
            real_fsync(fd)
            p = self.paths.get(fd)
            if p is not None and os.path.isdir(p):
                self.events.append(("fsync", p))

        def _close(fd):
            self.paths.pop(fd, None)
            return real_close(fd)

        for name, f in (("open", _open), ("mkdir", _mkdir), ("fsync", _fsync), ("close", _close)):
            monkeypatch.setattr(os, name, f)


@pytest.mark.parametrize("policy", ["group", "batch"])
def test_every_new_directory_entry_is_synced_before_an_acknowledgement(tmp_path, policy, monkeypatch):
    """A directory entry survives a power loss only once its parent directory is fsynced: `_journal` (and the durable
    directory itself, and the checkpoint's `_state` ...) were created without it, so everything acknowledged before
    the first checkpoint could vanish with the `_journal` entry."""
    ev = _DirEvents(monkeypatch)
    root = str(tmp_path / "a" / "run")
    store = ab.ExperienceStore(SMALL, capacity=64, durable=root, durability=policy)
    store.extend(small_rows(0, 4))  # acknowledged: everything it needs is durable now
    monkeypatch.undo()
    made = [p for kind, p in ev.events if kind == "mkdir"]
    assert os.path.join(root, jr.JOURNAL) in made
    for i, (kind, path) in enumerate(ev.events):
        if kind == "mkdir":
            parent = os.path.dirname(path)
            assert ("fsync", parent) in ev.events[i + 1:], f"{path} was created but {parent} never fsynced after it"
    store.close()


def _segment_with_records(tmp_path, n=5):
    base = str(tmp_path / "base")
    st = ab.ExperienceStore(SMALL, 1000, durable=base, durability="batch")
    for i in range(n):
        st.extend(small_rows(i * 10, 10))
    st.close()
    _, seg = jr.segments(base)[-1]
    data = open(seg, "rb").read()
    view = memoryview(data)
    off, starts = len(jr._SCHEMA_BYTES), []
    while off < len(data):
        starts.append(off)
        off += jr._frame_size(view, off)
    return base, seg, starts


def _damaged_copy(tmp_path, base, seg, name, mutate):
    d = str(tmp_path / name)
    shutil.copytree(base, d)
    p = os.path.join(d, jr.JOURNAL, os.path.basename(seg))
    b = bytearray(open(p, "rb").read())
    mutate(b)
    with open(p, "wb") as f:
        f.write(bytes(b))
    return d


def test_zeros_at_the_end_of_the_last_record_are_a_torn_tail(tmp_path):
    """Data the machine never wrote reads as zeros at an unchanged file size (a lost page cache, an unwritten extent
    after a direct write): the last record is dropped as a torn tail, as docs/format.md says (it raised)."""
    base, seg, starts = _segment_with_records(tmp_path)
    last = starts[-1]

    def zero_tail(b):
        k = (len(b) - last) // 2
        b[len(b) - k:] = bytes(k)

    d = _damaged_copy(tmp_path, base, seg, "zeros", zero_tail)
    again = ab.ExperienceStore.restore(d)
    try:
        assert rids(again) == list(range(40))
        assert again.stats()["journal"]["replayed"]["torn_bytes"] > 0
    finally:
        again.close()


@pytest.mark.parametrize("where", ["length", "body", "crc"])
def test_a_flipped_bit_in_a_whole_last_record_is_corrupt(tmp_path, where):
    """A whole record (its trailer chained to the record before it, nothing but the end of the file after it) with
    a flipped bit is StoreCorrupt, never a torn tail: a flipped bit of its metadata length used to make it look cut
    short, and an acknowledged, fsynced record was dropped silently."""
    base, seg, starts = _segment_with_records(tmp_path)
    last = starts[-1]
    at = {"length": last + 7, "body": last + (os.path.getsize(seg) - last) // 2, "crc": os.path.getsize(seg) - 6}

    def flip(b):
        b[at[where]] ^= 0x10

    d = _damaged_copy(tmp_path, base, seg, where, flip)
    with pytest.raises(ab.StoreCorrupt, match="not a torn tail"):
        ab.ExperienceStore.restore(d)


def test_a_record_cut_short_is_a_torn_tail(tmp_path):
    """A write cut short (the file ends inside the last record) is a torn tail: dropped, the store journals on."""
    base, seg, starts = _segment_with_records(tmp_path)
    d = _damaged_copy(tmp_path, base, seg, "cut", lambda b: b.__delitem__(slice(starts[-1] + 100, None)))
    again = ab.ExperienceStore.restore(d)
    try:
        assert rids(again) == list(range(40))
        again.extend(small_rows(1000, 2))
    finally:
        again.close()
    again = ab.ExperienceStore.restore(d)
    try:
        assert rids(again) == [*range(40), 1000, 1001]
    finally:
        again.close()


def test_update_is_journaled_before_a_consumer_can_see_it(tmp_path, monkeypatch):
    """`update` applied its values, then journaled them: a `consume(require=["reward"])` in between delivered the
    reward and journaled its consumption first, so after a crash the row stayed consumed without the reward it was
    delivered with. Now the update's record comes first: a consumer that sees the value has a later record."""
    d = str(tmp_path / "run")
    st = ab.ExperienceStore(LATER, 100, durable=d, durability="group", tasks=["train"])
    ids = st.extend(small_rows(0, 4))
    journal = st._durable.journal
    appended = threading.Event()
    release = threading.Event()
    real = journal.append

    def slow_append(kind, meta, payload=b""):  # the updater is preempted right at its journal append
        if kind == "update":
            appended.set()
            release.wait(5)
        return real(kind, meta, payload)

    monkeypatch.setattr(journal, "append", slow_append)
    t = threading.Thread(target=lambda: st.update(ids, {"reward": np.ones(4, np.float32)}))
    t.start()
    appended.wait(5)
    early = st.consume("train", 4, require=["reward"], timeout=0.3)
    release.set()
    t.join()
    assert len(early.indices) == 0, "a consumer saw an update before its journal record existed"
    got = st.consume("train", 4, require=["reward"], timeout=5)
    assert got.indices.tolist() == [0, 1, 2, 3]
    st.close()
    records, _, _ = jr.read_segments(d, 0)
    kinds = [r.kind for r in records]
    assert kinds.index("update") < kinds.index("consumed")


def test_journal_files_are_private(tmp_path):
    d = str(tmp_path / "run")
    st = ab.ExperienceStore(SMALL, 64, durable=d)
    st.extend(small_rows(0, 2))
    st.checkpoint()
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(d, jr.JOURNAL)).st_mode) == 0o700
        for _, seg in jr.segments(d):
            assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
        for dirpath, dirnames, filenames in os.walk(d):
            for n in dirnames:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, n)).st_mode) == 0o700, n
            for n in filenames:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, n)).st_mode) == 0o600, n
    finally:
        st.close()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_journal_directory_others_can_write_is_refused(tmp_path, mode):
    """A `_journal` directory another local user can write (pre-created, world- or group-writable) could hold forged
    segments (checksummed, not signed): a new durable store and a restore refuse it, naming the directory."""
    d = str(tmp_path / "run")
    os.makedirs(os.path.join(d, jr.JOURNAL))
    os.chmod(os.path.join(d, jr.JOURNAL), mode)
    with pytest.raises(ab.InvalidArgument, match="not writable by group or others"):
        ab.ExperienceStore(SMALL, 64, durable=d)
    os.chmod(os.path.join(d, jr.JOURNAL), 0o700)
    st = ab.ExperienceStore(SMALL, 64, durable=d)
    st.extend(small_rows(0, 2))
    st.close()
    os.chmod(os.path.join(d, jr.JOURNAL), mode)
    with pytest.raises(ab.InvalidArgument, match="not writable by group or others"):
        ab.ExperienceStore.restore(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_journal_directory_of_another_user_is_refused(tmp_path):
    d = str(tmp_path / "run")
    os.makedirs(os.path.join(d, jr.JOURNAL), mode=0o700)
    os.chown(os.path.join(d, jr.JOURNAL), 65534, 65534)
    with pytest.raises(ab.InvalidArgument, match="owned by uid 65534"):
        ab.ExperienceStore(SMALL, 64, durable=d)


def _restore_in_child(d, timeout=60):
    code = textwrap.dedent(f"""
        import arrowbuf as ab
        try:
            ab.ExperienceStore.restore({d!r}).close()
            print("RESTORED")
        except ab.StoreCorrupt as exc:
            print("CORRUPT", exc)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_fifo_planted_as_the_newest_segment_does_not_hang_restore(tmp_path):
    d = str(tmp_path / "run")
    st = ab.ExperienceStore(SMALL, 64, durable=d)
    st.extend(small_rows(0, 2))
    st.close()
    _, newest = jr.segments(d)[-1]
    os.unlink(newest)
    os.mkfifo(newest)
    out = _restore_in_child(d)  # a hang would fail the subprocess timeout
    assert "CORRUPT" in out.stdout and "not a regular file" in out.stdout, out.stdout + out.stderr


def test_a_symlink_planted_as_the_newest_segment_is_refused_and_not_written(tmp_path):
    d = str(tmp_path / "run")
    st = ab.ExperienceStore(SMALL, 64, durable=d)
    st.extend(small_rows(0, 2))
    st.close()
    _, newest = jr.segments(d)[-1]
    os.unlink(newest)
    target = tmp_path / "victim"
    target.write_bytes(b"")
    os.symlink(str(target), newest)
    with pytest.raises(ab.StoreCorrupt, match="symbolic link"):
        ab.ExperienceStore.restore(d)
    assert target.read_bytes() == b""


def test_private_helpers_refuse_links(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ab.InvalidArgument, match="symbolic link"):
        mf.check_private(str(link))
