"""One relay per node for block-wise broadcasts: receive blocks, forward them while receiving, serve the node's copy.

A relay (an async Ray actor) keeps the newest version of one broadcast in a private file (0600, created
O_EXCL|O_NOFOLLOW in this user's 0700 directory under /dev/shm; see `arrowbuf.tiers.shm.private`) that it fills block
by block, checking each block's digest from the mapping before it counts it as held, so a tampered block never reaches
a consumer or a downstream relay. It pulls blocks from the holder the directory (`directory.py`) picks for it, over
one TCP connection to that holder's bucket server (`wire.py`: a hello with the broadcast's secret, then bucket
requests), and serves the blocks it already has to the receivers downstream of it at once (pipelining): a request for
block `i` is answered as soon as block `i` is here, not when the whole object is. Consumers on the node map the file
(`Broadcast.get`, `tensors`, `load_into`): one copy per node, zero-copy reads.

Memory: a block moves from the sender's mapped file into the socket and from the socket into the receiver's mapped
file (`sock_sendall` of a view of the mapping, `sock_recv_into` a view of the mapping): no user-space buffer, no Ray
object. A receiver keeps at most `window` (k) blocks requested ahead, so at most k blocks per connection sit in the
kernel's socket buffers (not in any process's RSS). A relay's resident memory beyond its node's copy is its fixed
Python/Ray baseline plus the headers of the frames in flight.

Why a /dev/shm file rather than Ray's object store: a Ray object is sealed whole by one `put`, so a relay could not
forward block 3 of an object it is still writing, nor resume a half-received object after its upstream died; a file
is written in place block by block, and a consumer maps it like an object-store buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import ArrowbufError, BroadcastRefused
from ...tiers.shm import private
from . import wire
from .payload import combine, digest_of

__all__ = ["Relay", "Superseded", "TokenBucket", "digest_of", "file_name", "shm_prefix"]


#: a relay reports its progress to the directory on its first and last bucket and otherwise at most this often (the
#: directory needs counts only to pick holders for late joiners and re-attaching receivers; pipelining between relays
#: does not wait for it)
PROGRESS_S = 0.05
#: bucket requests a relay reads ahead of the one it serves, per connection (the rest wait in TCP's buffers)
MAX_QUEUED = 64
#: seconds a bucket may take before the receiver asks Ray whether its upstream relay is still alive
STALL_S = 1.0
#: bytes an emulated link (`TokenBucket.transmit`) sends at a time: a bucket streams in pieces as on a real link, so a
#: receiver whose upstream dies mid-bucket keeps what arrived (the cost of a loss is at most one piece, not a bucket)
LINK_PIECE = 128 << 10


class Superseded(ArrowbufError, RuntimeError):
    """The requested broadcast version was replaced by a newer one; take the newer one."""


def shm_prefix(uid: str, root: str | None = None) -> str:
    """The path prefix of every file of broadcast `uid` (in this user's private directory; see `tiers.shm.private`)."""
    return os.path.join(private.user_dir(root), f"{private.FILE_PREFIX}{uid}-")


def file_name(uid: str, key: str, version: int, incarnation: int = 0) -> str:
    """The name (in the private directory) of node `key`'s copy of `version` held by its relay number `incarnation`
    (a replaced relay never meets the file of the one it replaces); "~src" is the producer's file."""
    safe = "".join(c if c.isalnum() else "_" for c in key)[:64]
    return f"{private.FILE_PREFIX}{uid}-{safe}-v{int(version)}-r{int(incarnation)}"


class TokenBucket:
    """Egress bandwidth emulation: the link sends one block at a time, in the order asked, `n` bytes taking
    `n / rate` seconds.

    One bucket per relay, shared by all its uploads, so a relay serving two receivers gives each half its rate.
    A send takes the link when the sends asked before it are done (back to back: no idle gap on a backlogged link),
    and only if its receiver is still `alive` then: blocks queued for a receiver that died meanwhile cost the link
    nothing, so failover does not wait behind them. `rate=None` is unlimited.

    `transmit` streams a block as a link does: piece by piece (`LINK_PIECE` bytes), each piece leaving when the link
    has had the time to carry it, so a receiver whose upstream dies mid-block holds the pieces that arrived (and
    resumes after them), and a link whose receiver dies mid-block is free at once (its remaining time goes to the
    next send, as a real link's does when the peer resets the connection).
    """

    def __init__(self, rate: float | None) -> None:
        self.rate = None if not rate else float(rate)
        self._free_at = 0.0
        self._tail: asyncio.Future | None = None  # done when the last send asked so far has left the link

    async def take(self, n: int, alive: Callable[[], bool] | None = None, since: float | None = None) -> bool:
        """Hold the link for a send of `n` bytes that leaves whole when the link has carried it: `transmit` with
        nothing to send per piece. True once carried; False if `alive()` turned False first (the link then free).

        `since`: as in `transmit` (when this send became possible; default now)."""

        async def nothing(_off: int, _length: int) -> None:
            return None

        return await self.transmit(n, nothing, alive, since) == n

    async def transmit(self, n: int, send: Callable[[int, int], Awaitable[None]],
                       alive: Callable[[], bool] | None = None, since: float | None = None,
                       abort: asyncio.Future | None = None) -> int:
        """Carry `n` bytes over the link: `await send(offset, length)` for consecutive pieces, each when the link
        has carried it; returns the bytes sent: `n`, or fewer when the receiver died (`alive()` turned False before
        a piece, or `abort` finished meanwhile): the link is then free from that moment. `rate=None`: one piece at
        once.

        `since`: when this send became possible (`time.monotonic()`: the request had arrived and the block was
        here; default now). Its slot on the link starts then, or when the link's previous slot ends if later, and
        lasts n / rate. So the time the caller spends copying a piece into the socket overlaps the link's time (as
        on a real link) instead of adding to every block, and the link never carries more than `rate` (slots never
        overlap)."""
        if self.rate is None:
            if (alive is not None and not alive()) or (abort is not None and abort.done()):
                return 0
            await send(0, n)
            return n
        prev, mine = self._tail, asyncio.get_running_loop().create_future()
        self._tail = mine
        try:
            backlogged = prev is not None and not prev.done()
            if backlogged:
                assert prev is not None
                await asyncio.wait({prev})
            if (alive is not None and not alive()) or (abort is not None and abort.done()):
                return 0
            now = time.monotonic()
            start = self._free_at if backlogged else max(self._free_at, now if since is None else min(since, now))
            end = self._free_at = start + n / self.rate
            off = 0
            while off < n:
                step = min(LINK_PIECE, n - off)
                delay = start + (off + step) / self.rate - time.monotonic()
                if abort is None:
                    await asyncio.sleep(max(0.0, delay))
                elif delay > 0:
                    await asyncio.wait({abort}, timeout=delay)
                if (abort is not None and abort.done()) or (alive is not None and not alive()):
                    # the receiver is gone: the link is free now (the successors wait on `mine`, none has booked)
                    self._free_at = max(start, min(end, time.monotonic()))
                    return off
                await send(off, step)
                off += step
            return n
        finally:
            mine.set_result(None)


class _Copy:
    """One version held by a relay: its private file (descriptor kept open and share-locked while held, so the
    janitor leaves it alone), its mapping, and how many leading buckets are here and verified.

    `create`: a new file to fill (O_EXCL|O_NOFOLLOW, 0600; a name that exists is refused). Else the producer's file,
    opened by name once and accepted only if it is the producer's very inode (`meta["ident"]`), 0600, ours; its
    buckets are then verified from the mapping (`verify_all`) before anything is served.
    """

    def __init__(self, meta: dict, name: str, create: bool, root: str | None) -> None:
        self.meta, self.name, self.root = meta, name, root
        self.have = 0
        self.at = [0.0] * int(meta["nblocks"])  # time.monotonic() when each bucket was here and verified
        self.cond = asyncio.Condition()
        self.task: asyncio.Task | None = None
        self.error: str | None = None
        self.verified = False
        self.fd = -1
        self.mm: Any = None
        self.ident: tuple[int, int] = (0, 0)
        size = meta["size"]
        try:
            if create:
                self.fd = private.create_file(name, size, root)
            else:
                self.fd = private.open_verified(name, size, tuple(meta["ident"]), root)
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.mm = mmap.mmap(self.fd, size, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
            self.ident = private.identity(self.fd)
        except BroadcastRefused as exc:
            self.error = str(exc)
            self.verified = True

    @property
    def complete(self) -> bool:
        return self.have >= self.meta["nblocks"]

    def span(self, i: int) -> tuple[int, int]:
        b = self.meta["block_size"]
        return i * b, min((i + 1) * b, self.meta["size"])

    def check(self, i: int) -> bool:
        """Bucket `i` as the mapping holds it now has the producer's digest."""
        a, b = self.span(i)
        with memoryview(self.mm) as whole, whole[a:b] as part:
            return digest_of(part) == self.meta["digests"][i]

    def verify_all(self) -> None:
        """Check every bucket of the mapped producer file (no bucket is served before)."""
        if self.error is None:
            for i in range(self.meta["nblocks"]):
                if not self.check(i):
                    self.error = f"bucket {i} of version {self.meta['version']}: digest mismatch (tampered): refused"
                    break
            else:
                self.have = self.meta["nblocks"]
                self.at = [time.monotonic()] * self.have
        self.verified = True

    def drop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a local view is still alive; the mapping goes with it
                pass
        if self.fd >= 0:  # ours (never a refused name): consumers that mapped it keep their mapping
            private.unlink(self.name, self.root)
            os.close(self.fd)
            self.fd = -1


class Relay:
    """The receiver and forwarder of one node for one broadcast (an async Ray actor; see the module docstring).

    Args:
        uid: the broadcast's id (names its directory actor and its files).
        key: this relay's node key (a Ray node id, or any name in a benchmark that emulates nodes).
        egress_bytes_per_s: emulated upload bandwidth of this node (a token bucket), or None.
        window: buckets requested ahead from the upstream holder (k: the buckets in flight into this node).
        root: the shared-memory root (default /dev/shm or $ARROWBUF_SHM_DIR); files go to its private directory.
        incarnation: how many relays of this node key came before this one (names its files).
    """

    def __init__(self, uid: str, key: str, egress_bytes_per_s: float | None = None, window: int = 4,
                 root: str | None = None, incarnation: int = 0, secret: str | None = None) -> None:
        self.uid, self.key, self.window, self.root = uid, key, max(1, int(window)), root
        self.incarnation = int(incarnation)
        self.secret = bytes.fromhex(secret) if secret else bytes(wire.SECRET_BYTES)
        if len(self.secret) != wire.SECRET_BYTES:
            raise ValueError(f"the broadcast secret must be {wire.SECRET_BYTES} bytes")
        self._lsock: Any = None
        self._addr: tuple[str, int] | None = None
        self._tasks: set[asyncio.Task] = set()
        #: the last 16 re-attachments: version, upstream lost, buckets held (`have`), bytes of the cut bucket kept
        #: (`kept`, of `bucket_bytes`), the median time between the last buckets before the loss (`inter_bucket_s`),
        #: time.monotonic() of the last bucket (`last_bucket`) and the last bytes (`last_bytes`) before the loss, of
        #: its detection (`detected`), of the connection to the new source (`attached`) and of the first bucket after
        #: (`resumed`); `via` "backup" (no directory round trip, `to` the backup) or "directory" (`choose`);
        #: benchmarks measure the stall from them
        self.failovers: list[dict] = []
        self.me = f"{key}#{self.incarnation}"  # this relay as a requester (its upstream forgets it when it dies)
        self.gone: set[str] = set()
        private.sweep(root)  # on its node, the files of broadcasts whose holders died (the next start after a crash)
        self.bucket = TokenBucket(egress_bytes_per_s)
        self.cur: _Copy | None = None
        self._upstream: tuple[int, str, Any] | None = None  # (version, holder, socket) of the pull under way
        self.changed = asyncio.Condition()
        self._directory: Any = None

    def _dir(self) -> Any:
        if self._directory is None:
            import ray

            self._directory = ray.get_actor(f"arrowbuf-bc-{self.uid}-directory")
        return self._directory

    async def ping(self) -> str:
        return self.key

    async def upstream_died(self, version: int, holder: str) -> bool:
        """The directory learnt that `holder` died (its killer or another of its receivers said so): if this relay
        pulls `version` from it, cut that connection now, so the pull fails over at once instead of waiting for the
        dead process's sockets to close (a `ray.kill` stops an actor some tens of ms before they do). True if cut."""
        up = self._upstream
        if up is None or up[0] != version or up[1] != holder:
            return False
        with contextlib.suppress(OSError):
            up[2].shutdown(socket.SHUT_RDWR)
        return True

    async def pid(self) -> int:
        """This relay's process id (failure injection: a benchmark kills it with SIGKILL, as a crash would)."""
        return os.getpid()

    async def address(self, host: str | None = None) -> tuple[str, int]:
        """(host, port) of this relay's bucket server (started on first call, bound to `host`, by default the node's
        IP): receivers stream buckets from it (`wire.py`)."""
        if self._addr is None:
            if host is None:
                import ray

                host = str(ray.util.get_node_ip_address())
            self._lsock = wire.listen(host)
            host, port = self._lsock.getsockname()[:2]
            self._addr = (str(host), int(port))
            self._spawn(self._accept())
        return self._addr

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        while True:
            try:
                conn = await wire.accept(self._lsock)
            except OSError:  # closed (close) or out of descriptors: stop serving
                return
            self._spawn(self._serve(conn))

    async def _replace(self, copy: _Copy) -> None:
        old, self.cur = self.cur, copy
        if old is not None:
            async with old.cond:
                old.cond.notify_all()
            old.drop()
        async with self.changed:
            self.changed.notify_all()

    async def seed(self, meta: dict, name: str) -> bool:
        """Adopt the producer's file `name` (version `meta["version"]`) as this node's copy, after checking that it
        is the producer's inode and that every bucket has the producer's digest. False if not newer; raises
        `BroadcastRefused` when refused."""
        if self.cur is not None and self.cur.meta["version"] >= meta["version"]:
            return False
        copy = _Copy(meta, name, create=False, root=self.root)
        await asyncio.to_thread(copy.verify_all)  # hashing releases the GIL: the relay keeps serving meanwhile
        await self._replace(copy)
        if copy.error:
            raise BroadcastRefused(f"relay {self.key}: {copy.error}")
        self._dir().verified.remote(meta["version"], self.key)
        return True

    async def start(self, meta: dict) -> bool:
        """Begin receiving version `meta["version"]` (superseding an older one in flight); False if not newer."""
        if self.cur is not None and self.cur.meta["version"] >= meta["version"]:
            return False
        name = file_name(self.uid, self.key, meta["version"], self.incarnation)
        copy = _Copy(meta, name, create=True, root=self.root)
        await self._replace(copy)
        if copy.error is None:
            copy.task = asyncio.get_running_loop().create_task(self._pull(copy))
        return True

    async def _pull(self, copy: _Copy) -> None:
        """Fill `copy` bucket by bucket from the holder the directory picks; on a lost upstream, resume.

        Failover (docs/ray.md): a killed upstream's connection closes with its process, so the loss is seen at once;
        sooner when the directory hears of the death first (`upstream_died`); the stall watch covers a hung
        upstream. The receiver then connects straight to the backup the directory named with its upstream (that
        upstream's own upstream, whose upload slot the death frees; else the producer's node): no directory round
        trip before the bytes flow again; the directory hears of the switch in the background. The bucket in
        flight resumes at the byte where it was cut (the whole bucket is checked against the producer's digest
        when complete). Without a usable backup it asks the directory (`choose`).
        """
        d, meta = self._dir(), copy.meta
        version, n = meta["version"], meta["nblocks"]
        reattach = False
        lost: str | None = None
        reported = 0.0
        landed = [time.monotonic()]  # when the last bucket landed (the stall watch, failover records)
        bytes_at = [landed[0]]  # when the last bytes of a bucket landed (failover records)
        kept = 0  # bytes of bucket `copy.have` already in the file (a bucket cut mid-way by a dead upstream)
        got: Any = None  # the source to use next: (key, address, handle, backup) from the directory or a backup
        failed: set[str] = set()  # holders lost during this pull (never taken as a backup again)
        while copy.have < n and self.cur is copy and copy.error is None:
            if got is None:
                got = await d.choose.remote(version, self.key, copy.have, reattach, lost)
                lost = None
                if got is None:  # superseded
                    return
            src_key, addr, src, backup = got
            got = None
            sock = watch = None
            try:
                sock = await wire.connect(tuple(addr), self.secret, version, self.me)
                self._upstream = (version, src_key, sock)
                watch = asyncio.get_running_loop().create_task(self._watch(sock, src, landed))
                nxt = copy.have
                if self.failovers and "attached" not in self.failovers[-1]:
                    self.failovers[-1]["attached"] = time.monotonic()
                while copy.have < n:
                    if nxt - copy.have < self.window and nxt < n:  # keep k = window buckets asked ahead
                        more = min(n, copy.have + self.window) - nxt
                        await wire.request(sock, nxt, more, kept if nxt == copy.have else 0)
                        nxt += more
                    i = copy.have
                    a, b = copy.span(i)
                    with memoryview(copy.mm) as whole, whole[a + kept:b] as part:
                        try:
                            # from the socket straight into this node's file
                            await wire.read_bucket(sock, i, part, bytes_at)
                        except wire.Cut as cut:
                            kept += cut.got  # these bytes stay: the next source sends the rest
                            raise
                    kept = 0
                    if not copy.check(i):  # checked from the mapping, before anyone downstream sees it
                        copy.error = (f"bucket {i} of version {version} from {src_key}: digest mismatch "
                                      "(tampered or corrupted): refused")
                        break
                    copy.at[i] = time.monotonic()
                    async with copy.cond:
                        copy.have += 1
                        copy.cond.notify_all()
                    now = time.monotonic()
                    if self.failovers and "resumed" not in self.failovers[-1]:
                        self.failovers[-1]["resumed"] = now
                    landed[0] = now
                    if copy.have in (1, n) or now - reported >= PROGRESS_S:
                        d.progress.remote(version, self.key, copy.have)
                        reported = now
                d.release.remote(version, self.key, src_key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the upstream died or moved on: re-attach and resume from `have`
                now = time.monotonic()
                ats = [t for t in copy.at[max(0, copy.have - 9):copy.have] if t > 0]
                gaps = sorted(y - x for x, y in zip(ats, ats[1:]))
                self.failovers.append({"version": version, "upstream": src_key, "have": copy.have, "kept": kept,
                                       "bucket_bytes": copy.span(copy.have)[1] - copy.span(copy.have)[0]
                                       if copy.have < n else 0,
                                       "inter_bucket_s": gaps[len(gaps) // 2] if gaps else None,
                                       "last_bucket": landed[0], "last_bytes": max(bytes_at[0], landed[0]),
                                       "detected": now, "via": "directory"})
                del self.failovers[:-16]
                reattach = True
                if backup is not None and backup[0] != src_key and backup[0] not in failed:
                    # the backup, at once; the directory is told in the background (it frees the dead holder's
                    # slots and books the backup's)
                    got = (*backup, None)
                    self.failovers[-1]["via"] = "backup"
                    self.failovers[-1]["to"] = backup[0]
                    d.switched.remote(version, self.key, src_key, backup[0])
                else:
                    lost = src_key  # told to the directory with the next `choose` (one round trip)
                failed.add(src_key)
            finally:
                if watch is not None:
                    watch.cancel()
                if sock is not None:
                    if self._upstream is not None and self._upstream[2] is sock:
                        self._upstream = None
                    sock.close()
        if lost is not None:
            d.lost.remote(version, self.key, lost)
        if self.cur is copy:
            if copy.error is None and meta["digest"] != combine(meta["digests"]):
                copy.error = "the bucket digests do not make the payload digest"
            copy.verified = True
            async with copy.cond:
                copy.cond.notify_all()
            if copy.error is None:
                d.verified.remote(version, self.key)
            async with self.changed:
                self.changed.notify_all()

    async def _watch(self, sock: Any, src: Any, landed: list[float]) -> None:
        """While no bucket has landed for `STALL_S`, ask Ray whether the upstream relay `src` still lives (a killed
        relay's connection closes with its process, but a hung process or a dead node's TCP peer never closes it);
        if it died, shut the connection down, so the pending read fails and the receiver re-attaches."""
        while True:
            await asyncio.sleep(STALL_S)
            if time.monotonic() - landed[0] < STALL_S:
                continue
            try:
                await asyncio.wait_for(asyncio.ensure_future(src.ping.remote()), STALL_S)
            except TimeoutError:  # a busy upstream, not a dead one
                continue
            except Exception:  # noqa: BLE001 - the upstream is dead
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                return

    async def forget(self, requester: str) -> None:
        """`requester` (a relay's `me`) died: blocks queued for it are dropped instead of sent."""
        self.gone.add(requester)

    def _ready(self, copy: _Copy, i: int) -> bool:
        """Bucket `i` of `copy` is here, or it never will be (superseded, refused)."""
        return copy.have > i or self.cur is not copy or copy.error is not None

    async def _serve(self, conn: Any) -> None:
        """Serve one receiver's connection: check its hello, then answer its requests in order, each bucket as soon
        as it is here (pipelining) and this node's egress allows it, sent from this node's file (no copy)."""
        reader = None
        try:
            version, requester = await wire.read_hello(conn, self.secret)
            copy = self.cur
            if copy is None or copy.meta["version"] != version:
                await wire.send_error(conn, wire.SUPERSEDED, 0, f"relay {self.key} holds no version {version}")
                return
            reqs: asyncio.Queue = asyncio.Queue(maxsize=MAX_QUEUED)
            reader = asyncio.get_running_loop().create_task(self._requests(conn, reqs))
            while True:
                got = await reqs.get()
                if got is None:
                    return
                (i, off), asked = got
                if i >= copy.meta["nblocks"]:
                    await wire.send_error(conn, wire.BAD, i, f"version {version} has no bucket {i}")
                    return
                a, b = copy.span(i)
                if off >= b - a:
                    await wire.send_error(conn, wire.BAD, i, f"bucket {i} has no byte {off}")
                    return
                async with copy.cond:
                    await copy.cond.wait_for(functools.partial(self._ready, copy, i))
                if self.cur is not copy:
                    await wire.send_error(conn, wire.SUPERSEDED, i, f"relay {self.key}: version {version} was "
                                          "superseded")
                    return
                if copy.have <= i:
                    await wire.send_error(conn, wire.REFUSED, i, f"relay {self.key}: {copy.error}")
                    return
                # a receiver reported dead, or whose connection closed, costs the link nothing more (not even the
                # rest of a bucket it was receiving: the link streams pieces and stops when the receiver is gone)
                with memoryview(copy.mm) as whole, whole[a + off:b] as part:
                    sent = await self.bucket.transmit(
                        len(part), functools.partial(self._piece, conn, i, part),
                        functools.partial(self._alive, requester, reader), since=max(asked, copy.at[i]),
                        abort=reader)
                if sent == 0:
                    await wire.send_error(conn, wire.GONE, i, f"relay {self.key}: requester {requester} is gone")
                    return
                if sent < b - a - off:  # gone mid-bucket: the frame cannot be finished
                    return
        except (TimeoutError, OSError, wire.WireError):  # the receiver went away or broke the protocol
            return
        finally:
            if reader is not None:
                reader.cancel()
            conn.close()

    @staticmethod
    async def _piece(conn: Any, index: int, part: memoryview, offset: int, length: int) -> None:
        """Send bytes offset .. offset + length of `part` (the frame's payload), the frame's header first."""
        if offset == 0:
            await wire.send(conn, wire.frame_header(index, len(part)))
        with part[offset:offset + length] as piece:
            await wire.send(conn, piece)

    def _alive(self, requester: str, reader: asyncio.Task) -> bool:
        return requester not in self.gone and not reader.done()

    @staticmethod
    async def _requests(conn: Any, out: asyncio.Queue) -> None:
        """Read a connection's bucket requests as they arrive, each with its arrival time, into `out` (bounded: a
        receiver that asks for more than `MAX_QUEUED` ahead is held back by TCP); None at the end."""
        try:
            while (i := await wire.read_request(conn)) is not None:
                await out.put((i, time.monotonic()))
        except (OSError, wire.WireError):
            pass
        await out.put(None)

    def _answer(self, cur: _Copy) -> tuple[int, str, dict]:
        if cur.error:
            raise BroadcastRefused(f"relay {self.key}, version {cur.meta['version']}: {cur.error}")
        return cur.meta["version"], cur.name, dict(cur.meta, ident=list(cur.ident))

    async def wait(self, min_version: int = 0) -> tuple[int, str, dict]:
        """Wait until this node holds a complete, verified version >= `min_version`; return (version, file name,
        meta), the meta's `ident` the (device, inode) of this node's file (consumers check it after opening)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.cur is not None and self.cur.meta["version"] >= min_version
                                        and self.cur.verified)
        assert self.cur is not None
        return self._answer(self.cur)

    async def current(self) -> tuple[int, str, dict] | None:
        """(version, path, meta) of the verified copy this node holds now, or None (none yet, or one in flight);
        never waits (`Broadcast.poll`)."""
        cur = self.cur
        if cur is None or not cur.verified:
            return None
        return self._answer(cur)

    async def failover_log(self) -> list[dict]:
        """This relay's recent re-attachments (see `failovers`)."""
        return [dict(f) for f in self.failovers]

    async def progress(self) -> tuple[int, int]:
        """(version, blocks held) of this node's copy; (-1, 0) when it holds none."""
        return (-1, 0) if self.cur is None else (self.cur.meta["version"], self.cur.have)

    async def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by this relay's `process` (all its threads: Ray's own too) and by its event `loop`
        thread (the data plane: sockets, per-bucket hashing, frames, calls to the directory)."""
        return {"process": time.process_time(), "loop": time.thread_time()}

    async def memory(self, reset: bool = False) -> dict[str, int]:
        """This relay process's memory from /proc/self/status, in bytes: `peak` (VmHWM), `rss`, `anon` (RssAnon),
        `shmem` (RssShmem: its file's pages and the Ray object-store pages it touched). `reset` restarts the peak
        at the current RSS first (benchmarks measure the peak of one transfer)."""
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        fields = {"VmHWM": "peak", "VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                k = line.split(":", 1)[0]
                if k in fields:
                    out[fields[k]] = int(line.split()[1]) << 10
        return out

    async def close(self) -> None:
        """Stop receiving and serving, and remove this node's file."""
        if self._lsock is not None:
            self._lsock.close()
        for t in list(self._tasks):
            t.cancel()
        if self.cur is not None:
            self.cur.drop()
            self.cur = None
