"""Membership: which shards of a `ShardedStore` are up, their Flight clients, and their revival after a restart.

A handle, its writers and its consumer share one `ShardMembership` (the handle owns it): a shard that fails a call
anywhere is marked down for all of them at once, and each asks, without waiting, whether a down shard's actor came
back (a new incarnation: `generation`) before using it. A shard is lost for good only when Ray says its actor is gone
(not while it restarts, however long that takes).

Usage::

    members = ShardMembership(actors, infos, token, failure_timeout)
    client = members.shard_client(k)          # a RemoteStore, or None while shard k is down
    members.report_down(k, exc)               # a call to shard k failed
    members.wait_for_revival(timeout)         # until a down shard's actor answers (False: none can come back)
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..errors import StoreClosed, Unavailable
from ._common import _ray

if TYPE_CHECKING:  # pragma: no cover
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from ..flight.client import RemoteStore

log = logging.getLogger("arrowbuf.ray")


class ShardState:
    """What a handle knows about one shard: its connection, state and the last mass it reported."""

    def __init__(self, k: int, actor: ActorHandle, info: dict[str, Any] | None) -> None:
        self.k = k
        self.actor = actor
        self.info = info
        self.client: RemoteStore | None = None
        self.down = info is None
        self.down_since = time.monotonic() if self.down else 0.0
        self.lost = False            # dead for good (restarts exhausted)
        self.late: cf.Future | None = None  # a sample past its deadline, still running
        self.mass = 0.0
        self.min_mass = float("inf")
        self.size = 0
        self.mass_at = 0.0           # when the mass was last reported
        self.refreshing: cf.Future | None = None  # an asynchronous stats call for a shard reported empty
        self.probe: ObjectRef | None = None  # an outstanding actor.get_info() while down
        self.probe_at = 0.0          # when it was sent
        self.answered_at = 0.0       # when its actor last answered a probe (a down shard that answers is reachable)

    def connected(self) -> RemoteStore:
        """The Flight client of a shard `ShardMembership.live` returned.

        Raises:
            Unavailable: the shard went down since (its client was closed).
        """
        if self.client is None:
            raise Unavailable(f"shard {self.k} went down during the call; retry")
        return self.client


class ShardMembership:
    """The shards of one handle: their last known info, liveness and Flight clients (see the module docstring).

    Args:
        actors: the shard actors (Ray actor handles), by shard.
        infos: each shard's last known info (None: not known to be up).
        token: the shards' Flight bearer token.
        failure_timeout: seconds after which a down shard whose actor Ray reports gone is lost for good.

    Attributes:
        shards: a `ShardState` per shard. lock: guards them. counters: `failed` and `revived` so far.
    """

    def __init__(self, actors: list[ActorHandle], infos: list[dict[str, Any] | None], token: str | None,
                 failure_timeout: float) -> None:
        self.shards = [ShardState(k, a, info) for k, (a, info) in enumerate(zip(actors, infos))]
        self.lock = threading.RLock()
        self.failure_timeout = float(failure_timeout)
        self.closed = False
        self.counters: dict[str, int] = {"failed": 0, "revived": 0}
        self._token = token

    @property
    def num_shards(self) -> int:
        """How many shards the store has (live or not)."""
        return len(self.shards)

    def __repr__(self) -> str:
        up = sum(not s.down for s in self.shards)
        return f"ShardMembership({self.num_shards} shards, {up} up)"

    @property
    def infos(self) -> list[dict[str, Any] | None]:
        """Each shard's last known info: location, generation, node_id, pid, shm name, ..."""
        return [s.info for s in self.shards]

    def shard_client(self, k: int) -> RemoteStore | None:
        """Shard `k`'s Flight client (an `ab.connect` `RemoteStore`), or None while it is down. For a down shard this
        looks (without waiting) whether it came back."""
        return self.client(self.shards[k])

    def report_down(self, k: int, exc: BaseException | None = None) -> None:
        """Shard `k` failed a call (a writer saw it): it gets no share of batches until it answers again."""
        self.mark_down(self.shards[k], exc)

    def client(self, s: ShardState) -> RemoteStore | None:
        """The shard's Flight client, or None while it is down."""
        if self.closed:  # contracts: a closed handle stays closed (StoreSurface)
            raise StoreClosed("this ShardedStore handle is closed; unpickle or create another")
        if s.down:
            self.poll_revival(s)
            if s.down:
                return None
        if s.client is None:
            from ..flight import connect

            info = s.info
            assert info is not None  # a shard is up only with an info
            try:
                s.client = connect(info["location"], token=self._token, store=info["store"], reconnect_timeout=0.0)
            except (StoreClosed, OSError, pa.ArrowException) as exc:
                self.mark_down(s, exc)
                return None
        return s.client

    def mark_down(self, s: ShardState, exc: BaseException | None = None) -> None:
        """Take shard `s` out of service after `exc` (idempotent): its size and mass stop counting and its
        client is closed; `poll_revival` brings it back."""
        with self.lock:
            if s.down:
                return
            log.info("shard %d is unreachable (%s); serving from the others", s.k, exc)
            s.down, s.down_since = True, time.monotonic()
            s.mass, s.size = 0.0, 0
            client, s.client = s.client, None
            self.counters["failed"] += 1
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def poll_revival(self, s: ShardState) -> None:
        """Non-blocking: has a down shard's actor come back under a new generation?"""
        if s.lost:
            return
        ray = _ray()
        with self.lock:
            if s.probe is None:
                s.probe, s.probe_at = s.actor.get_info.remote(), time.monotonic()
            probe = s.probe
            ready, _ = ray.wait([probe], timeout=0)
            if not ready:
                return
            s.probe = None
            try:
                info = ray.get(probe)
            except Exception as exc:  # noqa: BLE001 - RayActorError: restarting, or dead for good
                # Lost only when Ray says the actor is gone (not ActorUnavailableError: it is restarting, however
                # long that takes) to a question asked after failure_timeout (a probe sent earlier may be looked
                # at late: its age says nothing about the actor now).
                restarting = isinstance(exc, getattr(ray.exceptions, "ActorUnavailableError", ()))
                if not restarting and s.probe_at - s.down_since > self.failure_timeout:
                    s.lost = True
                return
            s.answered_at = time.monotonic()
            old = s.info
            if old is not None and info["generation"] == old["generation"] and info["pid"] == old["pid"]:
                if time.monotonic() - s.down_since < 1.0:  # the old incarnation answered; retry its endpoint later
                    return
            s.info, s.down, s.client = info, False, None
            s.mass, s.min_mass, s.size = 0.0, float("inf"), 0
            self.counters["revived"] += 1

    def live(self) -> list[ShardState]:
        """The shards reachable now (each with a client)."""
        return [s for s in self.shards if self.client(s) is not None]

    def all_lost(self) -> bool:
        """Whether no shard can serve any more: each is lost, or down and unheard of for longer than
        `failure_timeout` (an actor that answered since is reachable: its shard comes back, `poll_revival`)."""
        now = time.monotonic()
        return all(s.lost or (s.down and now - max(s.down_since, s.answered_at) > self.failure_timeout)
                   for s in self.shards)

    def wait_for_shards(self, timeout: float = 60.0) -> int:
        """Block until every shard is reachable (e.g. after a restart) or `timeout`; returns how many are up."""
        end = time.monotonic() + timeout
        while True:
            up = len(self.live())
            left = end - time.monotonic()
            if up == self.num_shards or left <= 0 or not self.wait_for_revival(left):
                return up

    def wait_for_revival(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until the actor of a down shard answers (it may be back: the next call that
        needs it looks) or fails; False when no shard can come back (every down shard is lost for good)."""
        probes = []
        for s in self.shards:
            if s.down and not s.lost:
                if s.probe is None:
                    self.poll_revival(s)  # asks the actor again (a restarting one answers once it is back)
                if s.probe is not None:
                    probes.append(s.probe)
                elif not s.down:  # it answered at once: back already
                    return True
        if not probes:
            return any(s.down and not s.lost for s in self.shards)
        _ray().wait(probes, num_returns=1, timeout=max(0.0, timeout))
        return True

    def close(self) -> None:
        """Close this process's clients; later calls raise `StoreClosed`. Idempotent."""
        self.closed = True
        for s in self.shards:
            if s.client is not None:
                with contextlib.suppress(Exception):
                    s.client.close()
                s.client = None
