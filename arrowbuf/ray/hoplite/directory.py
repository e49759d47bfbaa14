"""The block directory of a broadcast: which node holds how many blocks, and who uploads to whom (an async Ray actor).

The schedule is built as receivers arrive (Hoplite's receiver-driven rule): a relay that needs blocks asks `choose`,
which hands it the live holder with the most blocks beyond the asker's own that still has a spare upload slot, and
waits (no polling: an `asyncio.Condition` woken by progress, releases and losses) when none has. `upload_slots=1`
makes a chain, whose pipelined time is about S/B + (N-1)·b/B; 2 makes a binary tree; the producer's node has
`root_slots`. With each answer comes a backup (the holder's own upstream, else the producer's node): a receiver whose
upstream died switches to it at once and tells the directory afterwards (`switched`); without one it asks again with
`reattach=True`, which may also use one spare slot of the producer's node. Either way it resumes from the blocks (and
the bytes of the cut bucket) it has.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ray.actor import ActorHandle


class BlockDirectory:
    """Directory actor of one broadcast (see the module docstring). Created by `Broadcast.create`."""

    def __init__(self, uid: str, relay_options: dict) -> None:
        self.uid = uid
        self.relay_options = relay_options
        self.relays: dict[str, Any] = {}
        self.addresses: dict[str, tuple[str, int]] = {}  # node key -> its relay's bucket server (wire.py)
        self.incarnations: dict[str, int] = {}  # relays created per node key so far
        self.ids: dict[str, str] = {}           # node key -> its relay as a requester ("key#incarnation")
        self.meta: dict | None = None
        self.root: str | None = None
        self.count: dict[str, int] = {}
        self.uploads: dict[str, int] = {}
        self.upstream: dict[str, str] = {}
        self.dead: set[str] = set()
        self.delivered: dict[str, int] = {}  # node key -> newest version its relay holds complete and verified
        self.loads: dict[str, int] = {}      # receiver id -> newest version it loaded (Broadcast.load_into, ...)
        self.cond = asyncio.Condition()
        self.creating = asyncio.Lock()

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def relay(self, key: str, node_id: str | None = None, dead: ActorHandle | None = None) -> ActorHandle:
        """The relay of node `key`, created (on Ray node `node_id` when given) if it has none or its relay died.

        A relay created while a version is in flight starts receiving it at once: late joiners join the running
        broadcast. `dead`: a relay handle the caller found dead; if it is still `key`'s relay it is marked dead and
        replaced (under the same lock, so two consumers that both saw it die get one new relay, not two).
        """
        async with self.creating:
            if dead is not None and self.relays.get(key) == dead and key not in self.dead:
                await self.mark_dead(key)
            return await self._relay(key, node_id)

    async def _relay(self, key: str, node_id: str | None) -> ActorHandle:
        if key in self.relays and key not in self.dead:
            return self.relays[key]
        import ray

        from .relay import Relay

        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, "max_restarts": 0}
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        incarnation = self.incarnations.get(key, 0)
        self.incarnations[key] = incarnation + 1
        self.ids[key] = f"{key}#{incarnation}"
        r: Any = ray.remote(Relay).options(**opts).remote(self.uid, key, incarnation=incarnation,
                                                          **self.relay_options)
        self.addresses[key] = tuple(await r.address.remote())  # also: the relay is up
        self.relays[key] = r
        self.dead.discard(key)
        self.count.pop(key, None)
        self.delivered.pop(key, None)
        if self.meta is not None and key != self.root:
            await r.start.remote(self.meta)
        return r

    async def publish(self, meta: dict, root: str) -> None:
        """Make `meta` the current version, held in full by `root`'s relay, and tell every other relay to fetch it."""
        self.meta, self.root = meta, root
        self.count = {root: meta["nblocks"]}
        self.uploads, self.upstream = {}, {}
        await self._notify()
        for key, r in list(self.relays.items()):
            if key != root and key not in self.dead:
                r.start.remote(meta)

    def _slots(self, key: str) -> int:
        assert self.meta is not None
        return int(self.meta["root_slots"] if key == self.root else self.meta["upload_slots"])

    def _pick(self, me: str, have: int, reattach: bool) -> str | None:
        assert self.meta is not None
        n, best, best_rank = self.meta["nblocks"], None, None
        for k, c in self.count.items():
            if k == me or k in self.dead or c <= have or (not self.meta["pipelined"] and c < n):
                continue
            spare = self._slots(k) + (1 if reattach and k == self.root else 0) - self.uploads.get(k, 0)
            if spare <= 0:
                continue
            rank = (c, spare)
            if best_rank is None or rank > best_rank:
                best, best_rank = k, rank
        return best

    def _backup(self, me: str, holder: str) -> tuple[str, tuple[str, int], Any] | None:
        """The source `me` should switch to, without asking again, if `holder` dies: `holder`'s own upstream (it
        holds more than `holder`, and `holder`'s death frees the upload slot it used, so its link is not split
        between two children), else the producer's node (which keeps one spare slot for re-attaching receivers);
        None when `holder` is the producer's node."""
        for k in (self.upstream.get(holder), self.root):
            if k is not None and k not in (me, holder) and k not in self.dead and k in self.addresses:
                return k, self.addresses[k], self.relays[k]
        return None

    async def choose(self, version: int, me: str, have: int, reattach: bool = False, lost: str | None = None
                     ) -> tuple[str, tuple[str, int], Any, tuple[str, tuple[str, int], Any] | None] | None:
        """Pick (and reserve an upload slot of) the holder `me` should pull from: (its key, its bucket server's
        address, its relay handle, the backup: the same three of the holder to switch to at once if this one dies,
        or None; see `_backup`); None once `version` is superseded. `lost`: the holder `me` could not pull from
        (see `lost`), reported in the same call."""
        if lost is not None:
            await self.lost(version, me, lost)
        async with self.cond:
            await self.cond.wait_for(lambda: self.meta is None or self.meta["version"] != version
                                     or self._pick(me, have, reattach) is not None)
            if self.meta is None or self.meta["version"] != version:
                return None
            k = self._pick(me, have, reattach)
            assert k is not None
            self.uploads[k] = self.uploads.get(k, 0) + 1
            self.upstream[me] = k
            return k, self.addresses[k], self.relays[k], self._backup(me, k)

    async def switched(self, version: int, me: str, lost: str, new: str) -> None:
        """`me` lost `lost` and already pulls from its backup `new` (no `choose`): record the loss (as `lost`) and
        book an upload slot of `new` (over its count if a re-attaching receiver took the freed slot first: the
        receiver is pulling already)."""
        if self.meta is None or self.meta["version"] != version:
            return
        await self.lost(version, me, lost)
        if new not in self.dead and self.upstream.get(me) is None:
            self.uploads[new] = self.uploads.get(new, 0) + 1
            self.upstream[me] = new
            await self._notify()

    async def progress(self, version: int, key: str, count: int) -> None:
        if self.meta is not None and self.meta["version"] == version and key not in self.dead:
            self.count[key] = max(count, self.count.get(key, 0))
            await self._notify()

    async def release(self, version: int, me: str, src: str) -> None:
        """`me` has everything it needed from `src`: free the upload slot."""
        if self.meta is not None and self.meta["version"] == version and self.upstream.get(me) == src:
            del self.upstream[me]
            self.uploads[src] = max(0, self.uploads.get(src, 0) - 1)
            await self._notify()

    async def lost(self, version: int, me: str, src: str) -> None:
        """`me` could not pull from `src` (it died or moved on): forget `src` as a holder and free `me`'s slot.

        Only for the current version: a loss of an older version's transfer (its holder moved on to this one, and
        answered that it was superseded) says nothing about the holder now."""
        if self.meta is None or self.meta["version"] != version:
            return
        await self.release(version, me, src)
        if src != self.root:
            self.dead.add(src)
            self.count.pop(src, None)
            self.delivered.pop(src, None)
            up = self.upstream.pop(src, None)
            if up is not None:
                self.uploads[up] = max(0, self.uploads.get(up, 0) - 1)
                self._forget(up, src)
            self._tell_orphans(src)
        await self._notify()

    async def mark_dead(self, key: str, handle: ActorHandle | None = None) -> None:
        """Forget `key`'s relay (it was killed); receivers pulling from it are told at once and re-attach.

        With `handle`, only if that is still `key`'s relay (a consumer may have replaced it already).
        """
        if handle is not None and self.relays.get(key) != handle:
            return
        self.dead.add(key)
        self.count.pop(key, None)
        self.delivered.pop(key, None)
        up = self.upstream.pop(key, None)
        if up is not None:
            self.uploads[up] = max(0, self.uploads.get(up, 0) - 1)
            self._forget(up, key)
        self._tell_orphans(key)
        await self._notify()

    async def verified(self, version: int, key: str) -> None:
        """`key`'s relay holds `version` complete, every bucket verified."""
        if key not in self.dead:
            self.delivered[key] = max(version, self.delivered.get(key, 0))
            await self._notify()

    async def loaded(self, receiver: str, version: int) -> None:
        """Receiver `receiver` (one `Broadcast` handle in one process) loaded `version`."""
        self.loads[receiver] = max(version, self.loads.get(receiver, 0))
        await self._notify()

    async def get_fence(self, receivers: int | None = None, loads: bool = False) -> int:
        """`fence` (for `Broadcast.fence`)."""
        return self.fence(receivers, loads)

    def fence(self, receivers: int | None = None, loads: bool = False) -> int:
        """The newest version held by at least `receivers` live nodes (None: by every live relay); with `loads`,
        loaded by at least `receivers` receivers (None: by every receiver that ever reported). 0 when none."""
        if loads:
            held = list(self.loads.values())
        else:
            held = [self.delivered.get(k, 0) for k in self.relays if k not in self.dead]
        if not held:
            return 0
        n = len(held) if receivers is None else int(receivers)
        if n < 1 or n > len(held):
            return 0
        return sorted(held, reverse=True)[n - 1]

    async def wait_fence(self, version: int, receivers: int | None = None, loads: bool = False) -> int:
        """Wait until `fence(receivers, loads) >= version`; return the fence."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.fence(receivers, loads) >= version)
        return self.fence(receivers, loads)

    def _tell_orphans(self, dead: str) -> None:
        """Tell every relay pulling from `dead` that it died (fire and forget): each cuts its connection and fails
        over to its backup now, not when the dead process's sockets close."""
        if self.meta is None:
            return
        for me, up in list(self.upstream.items()):
            r = self.relays.get(me)
            if up == dead and r is not None and me not in self.dead:
                r.upstream_died.remote(self.meta["version"], dead)

    def _forget(self, holder: str, dead: str) -> None:
        """Tell `holder` to drop the blocks queued for `dead`'s relay (its egress goes to the living at once)."""
        r = self.relays.get(holder)
        if r is not None and holder not in self.dead and dead in self.ids:
            r.forget.remote(self.ids[dead])

    async def wait_count(self, key: str, count: int) -> int:
        """Wait until `key` holds at least `count` blocks of the current version (for tests and benchmarks)."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.count.get(key, 0) >= count or key in self.dead)
        return self.count.get(key, 0)

    async def state(self) -> dict:
        return {"version": None if self.meta is None else self.meta["version"], "root": self.root,
                "count": dict(self.count), "uploads": dict(self.uploads), "upstream": dict(self.upstream),
                "dead": sorted(self.dead), "relays": sorted(self.relays), "delivered": dict(self.delivered),
                "loads": dict(self.loads)}

    async def all_relays(self) -> list[Any]:
        return list(self.relays.values())
