"""One relay per node for block-wise broadcasts: receive blocks, forward them while receiving, serve the node's copy.

A relay (an async Ray actor) keeps the newest version of one broadcast in a file under /dev/shm that it fills block by
block. It pulls blocks from the holder the directory (`directory.py`) picks for it, and serves the blocks it already
has to the receivers downstream of it at once (pipelining): `get_block(v, i)` waits until block `i` is here, not until
the whole object is. Consumers on the node map the file read-only (`Broadcast.get`): one copy per node, zero-copy reads.

Why a /dev/shm file rather than Ray's object store: a Ray object is sealed whole by one `put`, so a relay could not
forward block 3 of an object it is still writing, nor resume a half-received object after its upstream died; a file
is written in place block by block, and a consumer maps it like an object-store buffer.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import pickle
import struct
import time
from collections import deque
from typing import Any

import numpy as np

from ...errors import ArrowbufError, InvalidArgument

SHM_DIR = "/dev/shm"
MAGIC = b"ABBCAST1"
_ALIGN = 64


class Superseded(ArrowbufError, RuntimeError):
    """The requested broadcast version was replaced by a newer one; take the newer one."""


def shm_prefix(uid: str) -> str:
    """The path prefix of every /dev/shm file of broadcast `uid` (used to clean up after killed relays)."""
    return os.path.join(SHM_DIR, f"arrowbuf-bc-{uid}-")


def shm_path(uid: str, key: str, version: int) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in key)[:64]
    return f"{shm_prefix(uid)}{safe}-v{int(version)}"


def digest_of(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


# -- payload format: MAGIC, u64 header_len, u32 nbufs, nbufs x (u64 off, u64 len), pickle header, 64-aligned buffers --

def pack_to_file(obj: Any, path: str) -> int:
    """Write `obj` (pickle protocol 5, its buffers out of band and 64-byte aligned) to `path`; return the size.

    numpy arrays and Arrow buffers travel out of band, so `unpack` returns views on the mapped file (zero-copy).
    """
    bufs: list[pickle.PickleBuffer] = []
    header = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    views = [b.raw() for b in bufs]
    pos = len(MAGIC) + 12 + 16 * len(views) + len(header)
    table = []
    for v in views:
        pos = -(-pos // _ALIGN) * _ALIGN
        table.append((pos, v.nbytes))
        pos += v.nbytes
    size = max(pos, 1)
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QI", len(header), len(views)))
        f.write(b"".join(struct.pack("<QQ", o, n) for o, n in table))
        f.write(header)
        for (off, _), v in zip(table, views):
            f.seek(off)
            f.write(v)
        f.truncate(size)
    return size


def unpack(buf: memoryview) -> Any:
    """The object `pack_to_file` wrote, its arrays viewing `buf` (no copy)."""
    if bytes(buf[:len(MAGIC)]) != MAGIC:
        raise InvalidArgument("not an arrowbuf broadcast payload (bad magic); was the file replaced?")
    hlen, nbufs = struct.unpack_from("<QI", buf, len(MAGIC))
    pos = len(MAGIC) + 12
    table = [struct.unpack_from("<QQ", buf, pos + 16 * k) for k in range(nbufs)]
    pos += 16 * nbufs
    header = buf[pos:pos + hlen]
    return pickle.loads(header, buffers=[buf[o:o + n] for o, n in table])


class TokenBucket:
    """Egress bandwidth emulation: every send of `n` bytes finishes no earlier than `n / rate` after the previous one.

    One bucket per relay, shared by all its uploads, so a relay serving two receivers gives each half its rate.
    `rate=None` is unlimited.
    """

    def __init__(self, rate: float | None) -> None:
        self.rate = None if not rate else float(rate)
        self._free_at = 0.0

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + n / self.rate
        await asyncio.sleep(self._free_at - now)


class _Copy:
    """One version held by a relay: its file, mapping, and how many leading blocks are here."""

    def __init__(self, meta: dict, path: str, have: int, create: bool) -> None:
        self.meta, self.path, self.have = meta, path, have
        self.cond = asyncio.Condition()
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o600)
        try:
            if create:
                os.ftruncate(fd, meta["size"])
            self.mm = mmap.mmap(fd, meta["size"], access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.task: asyncio.Task | None = None
        # the digest is computed block by block as blocks land (they land in order), so checking a complete copy
        # costs one block's hashing at the end, not a pass over the whole object
        self.hasher = hashlib.blake2b(digest_size=16)
        self.error: str | None = None
        self.verified = not create  # the producer's own file needs no check

    @property
    def complete(self) -> bool:
        return self.have >= self.meta["nblocks"]

    def span(self, i: int) -> tuple[int, int]:
        b = self.meta["block_size"]
        return i * b, min((i + 1) * b, self.meta["size"])

    def drop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        try:
            self.mm.close()
        except BufferError:  # a local view is still alive; the mapping goes with it
            pass
        try:
            os.unlink(self.path)  # consumers that mapped it keep their mapping
        except FileNotFoundError:
            pass


class Relay:
    """The receiver and forwarder of one node for one broadcast (an async Ray actor; see the module docstring).

    Args:
        uid: the broadcast's id (names its directory actor and its /dev/shm files).
        key: this relay's node key (a Ray node id, or any name in a benchmark that emulates nodes).
        egress_bytes_per_s: emulated upload bandwidth of this node (a token bucket), or None.
        window: blocks requested ahead from the upstream holder.
    """

    def __init__(self, uid: str, key: str, egress_bytes_per_s: float | None = None, window: int = 4) -> None:
        self.uid, self.key, self.window = uid, key, max(1, int(window))
        self.bucket = TokenBucket(egress_bytes_per_s)
        self.cur: _Copy | None = None
        self.changed = asyncio.Condition()
        self._directory: Any = None

    def _dir(self) -> Any:
        if self._directory is None:
            import ray

            self._directory = ray.get_actor(f"arrowbuf-bc-{self.uid}-directory")
        return self._directory

    async def ping(self) -> str:
        return self.key

    async def _replace(self, copy: _Copy) -> None:
        old, self.cur = self.cur, copy
        if old is not None:
            async with old.cond:
                old.cond.notify_all()
            old.drop()
        async with self.changed:
            self.changed.notify_all()

    async def seed(self, meta: dict, path: str) -> bool:
        """Adopt the producer's file `path` (version `meta["version"]`, complete) as this node's copy."""
        if self.cur is not None and self.cur.meta["version"] >= meta["version"]:
            return False
        await self._replace(_Copy(meta, path, meta["nblocks"], create=False))
        return True

    async def start(self, meta: dict) -> bool:
        """Begin receiving version `meta["version"]` (superseding an older one in flight); False if not newer."""
        if self.cur is not None and self.cur.meta["version"] >= meta["version"]:
            return False
        copy = _Copy(meta, shm_path(self.uid, self.key, meta["version"]), 0, create=True)
        await self._replace(copy)
        copy.task = asyncio.get_running_loop().create_task(self._pull(copy))
        return True

    async def _pull(self, copy: _Copy) -> None:
        d, meta = self._dir(), copy.meta
        version, n = meta["version"], meta["nblocks"]
        reattach = False
        while copy.have < n and self.cur is copy:
            got = await d.choose.remote(version, self.key, copy.have, reattach)
            if got is None:  # superseded
                return
            src_key, src = got
            pending: deque = deque()
            try:
                nxt = copy.have
                while copy.have < n:
                    while nxt < n and len(pending) < self.window:
                        pending.append(src.get_block.remote(version, nxt))
                        nxt += 1
                    data = await pending.popleft()
                    a, b = copy.span(copy.have)
                    copy.mm[a:b] = data
                    with memoryview(copy.mm) as whole, whole[a:b] as part:
                        copy.hasher.update(part)  # what the file now holds
                    async with copy.cond:
                        copy.have += 1
                        copy.cond.notify_all()
                    d.progress.remote(version, self.key, copy.have)
                d.release.remote(version, self.key, src_key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the upstream died or moved on: re-attach and resume from `have`
                await d.lost.remote(version, self.key, src_key)
                reattach = True
        if self.cur is copy:
            got_digest = copy.hasher.hexdigest()
            if got_digest != meta["digest"]:
                copy.error = f"digest mismatch: got {got_digest}, expected {meta['digest']}"
            copy.verified = True
            async with self.changed:
                self.changed.notify_all()

    async def get_block(self, version: int, i: int) -> Any:
        """Block `i` of `version`, as soon as it is here (pipelining), after this node's egress allows it."""
        copy = self.cur
        if copy is None or copy.meta["version"] != version:
            raise Superseded(f"relay {self.key} holds no version {version}")
        async with copy.cond:
            await copy.cond.wait_for(lambda: copy.have > i or self.cur is not copy)
        if self.cur is not copy:
            raise Superseded(f"relay {self.key}: version {version} was superseded")
        a, b = copy.span(i)
        await self.bucket.take(b - a)
        # a view of the node's file, not a copy: Ray pickles numpy out of band (one copy into the object store,
        # then the receiver maps it); blocks are immutable once written, and a dropped version's mapping lives on
        # in the view
        return np.frombuffer(copy.mm, dtype=np.uint8, count=b - a, offset=a)

    async def wait(self, min_version: int = 0) -> tuple[int, str, dict]:
        """Wait until this node holds a complete version >= `min_version`; return (version, path, meta)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.cur is not None and self.cur.meta["version"] >= min_version
                                        and self.cur.verified)
        cur = self.cur
        assert cur is not None
        if cur.error:
            raise ArrowbufError(f"relay {self.key}, version {cur.meta['version']}: {cur.error}")
        return cur.meta["version"], cur.path, cur.meta

    async def current(self) -> tuple[int, str, dict] | None:
        """(version, path, meta) of the verified copy this node holds now, or None (none yet, or one in flight);
        never waits (`Broadcast.poll`)."""
        cur = self.cur
        if cur is None or not cur.verified:
            return None
        if cur.error:
            raise ArrowbufError(f"relay {self.key}, version {cur.meta['version']}: {cur.error}")
        return cur.meta["version"], cur.path, cur.meta

    async def progress(self) -> tuple[int, int]:
        """(version, blocks held) of this node's copy; (-1, 0) when it holds none."""
        return (-1, 0) if self.cur is None else (self.cur.meta["version"], self.cur.have)

    async def close(self) -> None:
        """Stop receiving and remove this node's file."""
        if self.cur is not None:
            self.cur.drop()
            self.cur = None
