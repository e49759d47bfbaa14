"""The file a journal segment is appended to: through the page cache, or with direct I/O.

`SegmentFile(path, direct=True)` opens the segment with `O_DIRECT` where the filesystem supports it, and falls back
to the page cache where it does not (tmpfs, some network filesystems: `direct` then reads False). Direct I/O is
what a durable journal wants: every byte goes to the disk before the acknowledgement anyway, and through the page
cache it is copied twice (into the cache, then by writeback) and takes fresh pages for every new byte of the journal
(on a virtual machine whose free memory the host reclaims, a fresh page costs far more than the copy: ~0.3 GB/s
against ~5 GB/s for pages reused). Measured on the 2-core machine of benchmarks/README.md, a 7 MB append plus
`fdatasync`: 300 us of CPU direct against 2-22 ms buffered, at 1.9 GB/s against 0.3-1.8 GB/s.

Writes of fewer than `DIRECT_MIN` bytes (a GRPO batch of 64 rows is 186 KB) still go through the page cache when
direct I/O is on: a direct write waits for the device while the journal's write lock is held, a buffered one is a
copy, and for small records the copy is not what costs (benchmarks/README.md). The file descriptor's O_DIRECT flag
is switched per write (`fcntl`); the kernel writes back and drops cached pages a direct write overlaps.

How a direct write is done: the records are copied into an aligned staging buffer (`STAGE` bytes, reused) and
written in whole blocks of `BLOCK` bytes. The last block of a write is padded with zeros; the next write starts by
writing that block again, with its first bytes (the ones already written) unchanged, so a crash in the middle of it
can tear only bytes that were never acknowledged. The file therefore ends in up to `BLOCK - 1` zero bytes after
its last record while it is open: readers take zeros where a record would start as the end of the stream (pyarrow
reads four zero bytes as the end-of-stream marker; `arrowbuf.persist.journal` reads them as a torn tail, dropped).
`finish()` cuts them before the segment is closed, so a closed segment ends exactly with its `end` record.

Not thread-safe: the journal writes one segment from one thread at a time (its `_io` lock); `fdatasync` from
another thread at the same time is fine.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Any

import numpy as np

from .manifest import FILE_MODE
from .record import start_writeback

#: The alignment of direct writes (offsets, lengths and the buffer's address): 4 KiB covers disks of 512-byte and
#: 4 KiB logical blocks.
BLOCK = 4096
#: Writes smaller than this go through the page cache even when direct I/O is in use: a direct write waits for the
#: device (~200 us for 186 KB here), under the journal's write lock, where a buffered one is a copy (~50 us).
DIRECT_MIN = 1 << 20
#: The staging buffer of a direct segment: a record larger than this is written in several writes of this size.
STAGE = 4 << 20


class SegmentFile:
    """One journal segment, opened for appending (module docstring). `size`: the bytes written (its logical
    size: the file may be up to `BLOCK - 1` bytes longer until `finish`). `direct`: whether direct I/O is in use
    for writes of at least `DIRECT_MIN` bytes."""

    def __init__(self, path: str, direct: bool = True) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        self.direct = False
        self.size = 0
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, FILE_MODE)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # the filesystem refuses O_DIRECT: the page cache below
                    raise
        if self.fd < 0:
            self.fd = os.open(path, flags, FILE_MODE)
        self._on = self.direct  # whether the fd has O_DIRECT now
        self._stage: mmap.mmap | None = None
        self._arr: np.ndarray | None = None
        self._wrote = False  # a direct write succeeded (no falling back to the page cache after that)
        self._stale = False  # written through the page cache since the staging buffer's partial block was kept

    # Invariant while `direct` and not `_stale`: the staging buffer's first `size % BLOCK` bytes are the file's
    # last, partial block.
    def write(self, pieces: list[Any], total: int | None = None) -> None:
        """Append `pieces` (bytes-like) in order. `total`: their size, when the caller knows it."""
        if total is None:
            total = sum(memoryview(p).nbytes for p in pieces)
        if self.direct and total >= DIRECT_MIN:
            try:
                self._write_direct(pieces)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._wrote:
                    raise
                self.direct = False  # the filesystem took the O_DIRECT open but not the write: the page cache
        self._set_direct(False)
        self._stale = True
        pwritev_all(self.fd, pieces, self.size, total)
        self.size += total

    def _set_direct(self, on: bool) -> None:
        if self._on != on:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
            self._on = on

    def _staging(self) -> np.ndarray:
        if self._arr is None:
            self._stage = mmap.mmap(-1, STAGE)  # page-aligned
            self._arr = np.frombuffer(self._stage, dtype=np.uint8)
        return self._arr

    def _write_direct(self, pieces: list[Any]) -> None:
        arr = self._staging()
        base = self.size - self.size % BLOCK  # the file offset of the staging buffer's first byte
        fill = self.size % BLOCK
        if self._stale and fill:  # written through the page cache since: read the partial block back (cached)
            assert self._stage is not None
            got = os.preadv(self.fd, [memoryview(self._stage)[:fill]], base)  # (the fd is not O_DIRECT yet)
            if got != fill:
                raise OSError(errno.EIO, f"the segment's last block could not be read back ({got} of {fill} bytes)")
        self._stale = False
        self._set_direct(True)
        added = 0
        for p in pieces:
            src = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)
            at = 0
            while at < len(src):
                k = min(len(src) - at, STAGE - fill)
                arr[fill:fill + k] = src[at:at + k]
                fill += k
                at += k
                added += k
                if fill == STAGE:  # full: write it whole and start the buffer again
                    self._pwrite(STAGE, base)
                    base += STAGE
                    fill = 0
        if fill:
            whole = -(-fill // BLOCK) * BLOCK
            arr[fill:whole] = 0
            self._pwrite(whole, base)
            keep = fill % BLOCK
            if keep:
                arr[:keep] = arr[fill - keep:fill]  # the partial block, written again (unchanged) with the next
        self.size += added

    def _pwrite(self, n: int, offset: int) -> None:
        assert self._stage is not None
        view = memoryview(self._stage)[:n]
        done = 0
        while done < n:
            k = os.pwrite(self.fd, view[done:], offset + done)
            if k <= 0 or k % BLOCK:  # a short direct write leaves the offsets unaligned: fail, never go on
                raise OSError(errno.EIO, f"a direct write of {n - done} bytes wrote {k}")
            done += k
        self._wrote = True

    def start_writeback(self) -> None:
        """Start the disk's write of what is in the page cache (`arrowbuf.persist.record.start_writeback`)."""
        start_writeback(self.fd)

    def finish(self) -> None:
        """Cut a direct segment's zero padding after its last byte (before its last `fdatasync`), and what a failed
        write left past it."""
        if self.fd >= 0 and os.fstat(self.fd).st_size != self.size:
            os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._arr = None
        if self._stage is not None:
            try:
                self._stage.close()
            except BufferError:  # pragma: no cover - a view still held: the mapping goes with its last reference
                pass
            self._stage = None


def pwritev_all(fd: int, pieces: list[Any], offset: int, total: int) -> None:
    """Write `pieces` in order at `offset` (as few `pwritev` calls as the kernel allows)."""
    n = os.pwritev(fd, pieces, offset) if pieces else 0
    if n == total:
        return
    views = [memoryview(p).cast("B") for p in pieces]
    while True:
        while views and n >= len(views[0]):
            n -= len(views[0])
            offset += len(views.pop(0))
        if not views:
            return
        if n:
            views[0] = views[0][n:]
            offset += n
        n = os.pwritev(fd, views, offset)
