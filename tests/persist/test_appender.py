"""A journal segment written with direct I/O (`arrowbuf.persist.appender`): the bytes read back are exactly those
appended, in any mix of direct and page-cache writes and staging-buffer sizes; an open segment ends in zeros that
pyarrow reads as the end of the stream and a restore drops; a closed segment ends exactly with its last record; a
filesystem without O_DIRECT (tmpfs) gets the page cache. Real files on the disk under the test's temp directory."""

from __future__ import annotations

import errno
import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.persist import appender as ap
from arrowbuf.persist import journal as jr


def _direct_ok(directory) -> bool:
    """Whether this filesystem takes O_DIRECT (the disk under /tmp here and in CI; not tmpfs)."""
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    os.unlink(path)
    return True


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=12),
       split=st.lists(st.integers(1, 3), min_size=12, max_size=12),
       direct_min=st.sampled_from([0, 1, 5000, 1 << 20]), stage=st.sampled_from([4096, 8192, 65536]))
def test_what_is_appended_reads_back_exactly(tmp_path_factory, sizes, split, direct_min, stage):
    d = tmp_path_factory.mktemp("seg")
    path = os.path.join(d, "s.arrows")
    old = ap.DIRECT_MIN, ap.STAGE
    ap.DIRECT_MIN, ap.STAGE = direct_min, stage
    rng = np.random.default_rng(len(sizes))
    want = bytearray()
    f = ap.SegmentFile(path)
    try:
        assert f.direct == _direct_ok(d)
        for size, k in zip(sizes, split):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            cuts = sorted(rng.integers(0, size + 1, k - 1).tolist())
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size])]  # some empty
            f.write(pieces, None if k == 2 else size)
            want += data
            assert f.size == len(want)
            got = open(path, "rb").read()
            assert got[:len(want)] == want  # written (the page cache or the disk) ...
            assert got[len(want):] == bytes(len(got) - len(want)) and len(got) - len(want) < ap.BLOCK  # ... then zeros
        f.finish()
        os.fdatasync(f.fd)
        assert open(path, "rb").read() == want
    finally:
        f.close()
        ap.DIRECT_MIN, ap.STAGE = old


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_filesystem_that_refuses_o_direct_gets_the_page_cache(tmp_path, monkeypatch, refused_at):
    """EINVAL for O_DIRECT (some filesystems refuse it at the open, some at the first write; the fault is injected
    here, the disk under /tmp takes it): the segment is written through the page cache, nothing lost."""
    real_open = os.open

    def open_(path, flags, *a):
        if refused_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "injected")
        return real_open(path, flags, *a)

    def pwrite(fd, data, offset):
        raise OSError(errno.EINVAL, "injected")

    monkeypatch.setattr(os, "open", open_)
    if refused_at == "write":
        monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(ap, "DIRECT_MIN", 0)
    path = os.path.join(tmp_path, "s.arrows")
    f = ap.SegmentFile(path)
    try:
        assert f.direct == (refused_at == "write")
        f.write([b"x" * 3000, b"y" * 5000])
        f.write([b"z" * (2 << 20)])
        assert not f.direct
        f.finish()
        assert open(path, "rb").read() == b"x" * 3000 + b"y" * 5000 + b"z" * (2 << 20)
    finally:
        f.close()


FRAMES = {"name": "f", "fields": {"obs": {"dtype": "uint8", "shape": [64, 64]}, "action": "int64"}}


def test_a_journal_of_direct_records_reads_in_pyarrow_and_restores_exactly(tmp_path, monkeypatch):
    """Batches of 1 MiB and more (written direct), small ones between them (through the page cache), a rotation (a
    full segment): the open segment reads in pyarrow while the store is open (its zero padding reads as the end of the
    stream), the closed one ends exactly with its end record, and a restore gives back every row."""
    direct = _direct_ok(tmp_path)  # the disk under /tmp here and in CI; the page cache elsewhere, checked the same
    monkeypatch.setattr(jr, "SEGMENT_BYTES", 3 << 20)
    d = tmp_path / "run"
    rng = np.random.default_rng(0)
    s = ab.ExperienceStore(FRAMES, capacity=2000, seed=0, durable=d, durability="group")
    assert s.stats()["journal"]["direct_io"] == direct
    for i in range(7):  # the 5th fills the first segment; the open one ends with the 7th
        n = 300 if i % 2 == 0 else 3  # 1.2 MB (direct), then 12 KB
        s.extend({"obs": rng.integers(0, 256, (n, 64, 64), dtype=np.uint8), "action": np.full(n, i)})
    segs = jr.segments(str(d))
    assert len(segs) == 2
    closed, live = segs[0][1], segs[1][1]
    assert os.path.getsize(live) % ap.BLOCK == 0 or not direct  # open: padded to whole blocks
    t = pa.ipc.open_stream(live).read_all()
    assert t.column("kind").to_pylist() == ["batch", "batch"]
    raw = open(closed, "rb").read()
    recs, torn, _ = jr.read_segments(str(d), 0)
    assert (torn is not None and torn.path == live) or not direct  # the padding reads as a torn tail
    assert pa.ipc.open_stream(closed).read_all().column("kind").to_pylist()[-1] == "end"
    assert len(raw) % 8 == 0 and not raw.endswith(bytes(64))  # closed: no padding after its end record
    before = s.to_table()
    s.close()
    with ab.ExperienceStore.restore(d) as again:
        assert again.to_table().equals(before)


@pytest.mark.parametrize("direct", [True, False])
def test_a_failed_direct_write_fails_the_journal_and_leaves_no_partial_record(tmp_path, monkeypatch, direct):
    """A write that fails (here: EIO from the disk) fails the journal; a restore gets every record before it."""
    monkeypatch.setattr(ap, "DIRECT_MIN", 0 if direct else 1 << 30)
    j = jr.Journal(str(tmp_path), "group")
    assert j.direct_io == _direct_ok(tmp_path)
    j.wait(j.append("batch", {"i": 0}, b"a" * 10_000))
    direct = direct and j.direct_io
    real = os.pwrite if direct else os.pwritev

    def broken(fd, data, offset):
        real(fd, memoryview(data)[:4096] if direct else data[:1], offset)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "pwrite" if direct else "pwritev", broken)
    with pytest.raises(OSError):
        j.wait(j.append("batch", {"i": 1}, b"b" * 10_000))
    monkeypatch.undo()
    j.close()
    recs, torn, nxt = jr.read_segments(str(tmp_path), 0)
    assert [r.meta["i"] for r in recs] == [0] and nxt == 1


def test_a_direct_write_cut_by_a_crash_restores_to_the_record_before(tmp_path, monkeypatch):
    """What a machine crash can leave of the last direct write: the file cut at any of its blocks (the filesystem
    makes the size durable only with the blocks below it written; a record whose size is whole but whose bytes are
    not is damage, `StoreCorrupt`, as before). A restore gives every record before it, never the torn one."""
    monkeypatch.setattr(ap, "DIRECT_MIN", 0)  # every record direct
    d = tmp_path / "run"
    rng = np.random.default_rng(1)
    s = ab.ExperienceStore(FRAMES, capacity=2000, seed=0, durable=d, durability="group")
    for i in range(3):
        s.extend({"obs": rng.integers(0, 256, (20, 64, 64), dtype=np.uint8), "action": np.full(20, i)})
    before = s.to_table()
    obs = rng.integers(0, 256, (20, 64, 64), dtype=np.uint8)
    s.extend({"obs": obs, "action": np.full(20, 3)})
    s.close()
    path = jr.segments(str(d))[-1][1]
    data = open(path, "rb").read()
    at = data.find(obs.tobytes()[:4096])  # inside the last record (its rows are random: found once)
    assert at > 0 and data.find(obs.tobytes()[:4096], at + 1) == -1
    first_block = -(-at // ap.BLOCK) * ap.BLOCK  # a block of the last record only, and every one after it
    damaged = [data[:b] for b in range(first_block, len(data), ap.BLOCK)]  # cut at each block of the record
    assert len(damaged) >= 10
    for bad in damaged:
        with open(path, "wb") as f:
            f.write(bad)
        with ab.ExperienceStore.restore(d) as again:
            assert again.to_table().equals(before)
        with open(path, "wb") as f:  # the restore sealed the segment: put the damaged copy back for the next case
            f.write(data)
        for _, p in jr.segments(str(d))[1:]:
            os.unlink(p)
