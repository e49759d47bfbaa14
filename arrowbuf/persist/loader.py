"""Reading a journal segment file into memory for `arrowbuf.persist.journal`'s checks: on a thread, in large
sequential reads, while the caller checks the records already read."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading

import numpy as np
import pyarrow as pa

from ..errors import StoreCorrupt


class SegmentLoader:
    """Reads a segment file into memory on a thread, in large sequential reads, while the caller checks the records
    already read (reading and checksumming overlap: the CRC and the reads release the GIL). `upto(k)` waits until
    the first k bytes (at most the file's size) are in `buf`."""

    CHUNK = 8 << 20

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_segment(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self.arr = np.empty(self.size, dtype=np.uint8)
        self.buf = pa.py_buffer(self.arr)  # zero-copy: payloads are views of it
        self._avail = 0
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if self.size <= self.CHUNK:  # one read: no thread
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="arrowbuf-journal-read", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            fd = self._fd
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                view = self.arr.data
                while self._avail < self.size:
                    n = os.readv(fd, [view[self._avail:self._avail + self.CHUNK]])
                    if n <= 0:
                        raise StoreCorrupt(f"journal segment {self.path} shrank while it was read")
                    with self._cond:
                        self._avail += n
                        self._cond.notify_all()
            finally:
                os.close(fd)
        except BaseException as exc:  # handed to the reading thread
            self._error = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def upto(self, k: int) -> None:
        k = min(k, self.size)
        if self._avail >= k:
            return
        with self._cond:
            while self._avail < k and not self._done:
                self._cond.wait()
        if self._avail < k:
            if isinstance(self._error, StoreCorrupt):
                raise self._error
            raise StoreCorrupt(f"journal segment {self.path} cannot be read: {self._error}")

    def join(self) -> None:
        """Wait for the reading thread to end (whatever happened)."""
        if self._thread is not None:
            self._thread.join()


def open_segment(path: str, flags: int) -> int:
    """Open an existing journal segment: never through a symbolic link, never blocking (a FIFO planted there), and
    only a regular file.

    Raises:
        StoreCorrupt: something else than a regular file sits where the segment should be.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreCorrupt(f"journal segment {path} is a symbolic link; a journal never follows links (someone "
                               "planted it: remove it)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StoreCorrupt(f"journal segment {path} is not a regular file (mode {stat.filemode(st.st_mode)}); "
                           "remove it")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd
