"""Broadcast large objects (policy weights, Arrow tables) to every node: `broadcast` (one `ray.put`) and `Broadcast`.

`broadcast(obj, actors, method)` is the simple path: one `ray.put`, every actor gets the ref (each node fetches the
object once from the producer's node: a star).

`Broadcast` is Hoplite's transfer (see docs/ray.md): the object is cut into blocks, a directory actor records which
node holds how many, each node's relay pulls from the holder with the most progress that has a spare upload slot and
forwards blocks while it still receives later ones; consumers on a node map the node's one copy (a /dev/shm file)
read-only, zero-copy. A relay created late joins the running broadcast; a newer version supersedes one in flight; a
receiver whose upstream relay dies re-attaches to another holder and resumes from the blocks it has.

Usage::

    bc = Broadcast.create(block_size=4 << 20)      # one relay per alive Ray node
    v = bc.publish(model.state_dict())             # returns at once; blocks flow node to node
    weights = bc.get(v)                            # in any process: this node's copy, numpy arrays viewing shm
    bc.close()                                     # kills relays and the directory, removes the /dev/shm files
"""

from __future__ import annotations

import glob
import os
import secrets
import sys
from collections.abc import Iterable
from typing import Any

from ...errors import InvalidArgument
from .._common import _ray
from .directory import BlockDirectory
from .relay import digest_of, pack_to_file, shm_path, shm_prefix, unpack


def broadcast(obj: Any, actors: Iterable[Any] | None = None, method: str | None = None, *args: Any,
              **kwargs: Any) -> Any:
    """Send `obj` to many actors through Ray's object store: one `ray.put`, then every actor gets the same object.

    Without `actors`: returns the `ObjectRef` (pass it to tasks and actors; each node fetches it once, then its
    processes read it from that node's shared memory). With `actors` and `method`: calls
    `actor.<method>(obj, *args, **kwargs)` on each, all with the one ref (Ray resolves it to the object in each
    actor), and returns their result refs. Sending `obj` by value to each instead serialises and stores it once per
    actor (see benchmarks/bench_ray.py). For large objects to many nodes, `Broadcast` pipelines blocks through
    per-node relays instead.
    """
    ray = _ray()
    ref = obj if isinstance(obj, ray.ObjectRef) else ray.put(obj)
    if actors is None:
        return ref
    if method is None:
        raise InvalidArgument("broadcast to actors needs the name of the method that receives the object")
    return [getattr(a, method).remote(ref, *args, **kwargs) for a in actors]


def _plain(obj: Any) -> Any:
    """torch tensors -> numpy (CPU) inside dicts/lists, so they travel out of band and map zero-copy."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return type(obj)((k, _plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _this_node() -> str:
    return str(_ray().get_runtime_context().get_node_id())


class Broadcast:
    """A versioned, pipelined, receiver-driven broadcast over per-node relays (see the module docstring).

    The handle pickles: pass it to actors and tasks, which call `get`.
    """

    def __init__(self, uid: str, directory: Any, block_size: int, upload_slots: int, root_slots: int,
                 pipelined: bool) -> None:
        self.uid, self.directory = uid, directory
        self.block_size, self.upload_slots, self.root_slots = block_size, upload_slots, root_slots
        self.pipelined = pipelined
        self._version = 0
        self._maps: list[Any] = []
        self._relay_cache: Any = None

    @classmethod
    def create(cls, *, block_size: int = 4 << 20, upload_slots: int = 1, root_slots: int | None = None,
               pipelined: bool = True, egress_bytes_per_s: float | None = None, window: int = 4,
               nodes: bool = True) -> Broadcast:
        """Start a broadcast: its directory actor and (with `nodes`) one relay on every alive Ray node.

        Args:
            block_size: bytes per block (a few MB: small enough to pipeline, large enough to amortise a call).
            upload_slots: receivers one relay uploads to at once (1: a chain, 2: a binary tree).
            root_slots: the same for the producer's node (default `upload_slots`).
            pipelined: forward blocks while still receiving (False: store-and-forward, for comparison).
            egress_bytes_per_s: emulated upload bandwidth of every relay (token bucket); None for unlimited.
            window: blocks a relay requests ahead from its upstream.
            nodes: create the relays of the alive nodes now (else on first `relay`, `publish` or `get`).
        """
        ray = _ray()
        if block_size < 1 or upload_slots < 0:
            raise InvalidArgument(f"block_size must be >= 1 and upload_slots >= 0, got {block_size}, {upload_slots}")
        uid = secrets.token_hex(4)
        directory = ray.remote(BlockDirectory).options(
            name=f"arrowbuf-bc-{uid}-directory", num_cpus=0, max_concurrency=1000).remote(
            uid, {"egress_bytes_per_s": egress_bytes_per_s, "window": window})
        bc = cls(uid, directory, int(block_size), int(upload_slots),
                 int(upload_slots if root_slots is None else root_slots), bool(pipelined))
        if nodes:
            for n in ray.nodes():
                if n.get("Alive"):
                    bc.relay(n["NodeID"], n["NodeID"])
        return bc

    def relay(self, key: str | None = None, node_id: str | None = None) -> Any:
        """The relay actor of node `key` (default: this process's node), created if missing; it joins the running
        broadcast at once. `node_id` pins it to that Ray node (default: `key` when `key` is omitted)."""
        ray = _ray()
        if key is None:
            key = node_id = _this_node()
        return ray.get(self.directory.relay.remote(key, node_id))

    def publish(self, obj: Any, *, source: str | None = None, upload_slots: int | None = None,
                root_slots: int | None = None, pipelined: bool | None = None) -> int:
        """Publish `obj` as the next version and return its number; the transfer runs in the background.

        The object is written once into this node's (or `source`'s) /dev/shm file, which its relay serves. The
        keyword overrides change the schedule of this version only (benchmarks compare star, tree and chain).
        """
        ray = _ray()
        source = _this_node() if source is None else source
        root = self.relay(source, None if source != _this_node() else source)
        self._version += 1
        version = self._version
        path = shm_path(self.uid, source, version)
        size = pack_to_file(_plain(obj), path)
        with open(path, "rb") as f:
            import mmap

            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                digest = digest_of(mm)
        meta = {"version": version, "size": size, "block_size": self.block_size,
                "nblocks": -(-size // self.block_size), "digest": digest,
                "upload_slots": self.upload_slots if upload_slots is None else int(upload_slots),
                "root_slots": (self.root_slots if root_slots is None else int(root_slots)),
                "pipelined": self.pipelined if pipelined is None else bool(pipelined)}
        ray.get(root.seed.remote(meta, path))
        ray.get(self.directory.publish.remote(meta, source))
        return version

    def wait(self, version: int = 0, key: str | None = None, timeout: float | None = None) -> dict:
        """Wait until node `key` (default: this node) holds a verified version >= `version`; return its meta."""
        ray = _ray()
        _, _, meta = ray.get(self.relay(key).wait.remote(version), timeout=timeout)
        return meta

    def get(self, version: int = 0, timeout: float | None = None) -> Any:
        """The object of a version >= `version` from this node's copy: arrays view shared memory (read-only)."""
        return self.fetch(version, timeout)[1]

    def fetch(self, version: int = 0, timeout: float | None = None) -> tuple[int, Any]:
        """`(v, object)` of a version `v >= version` from this node's copy (as `get`, with the version it got)."""
        import mmap

        ray = _ray()
        key = _this_node()
        r = self.relay()
        while True:
            try:
                v, path, _ = ray.get(r.wait.remote(version), timeout=timeout)
            except ray.exceptions.ActorDiedError:  # this node's relay died: a new one joins the broadcast
                r = ray.get(self.directory.relay.remote(key, key, r), timeout=timeout)
                continue
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:  # superseded between the answer and the open: take the newer one
                version = v + 1
                continue
            return v, unpack(memoryview(mm))

    def poll(self, after: int = 0, timeout: float | None = 60.0) -> tuple[int, Any] | None:
        """`(version, object)` when this node holds a verified version newer than `after`, else None; never waits
        for a transfer (an actor calls it between steps and keeps acting on the weights it has).

        A node whose relay died gets a new one, which joins the running broadcast (as `get`). `timeout` bounds the
        calls to the directory and the relay, not a transfer.
        """
        import mmap

        ray = _ray()
        r = self._local_relay(timeout)
        try:
            got = ray.get(r.current.remote(), timeout=timeout)
        except ray.exceptions.ActorDiedError:  # the relay died: a new one joins the broadcast; poll again later
            key = _this_node()
            self._relay_cache = ray.get(self.directory.relay.remote(key, key, r), timeout=timeout)
            return None
        if got is None or got[0] <= after:
            return None
        v, path, _ = got
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:  # superseded between the answer and the open: the next poll has the newer one
            return None
        return v, unpack(memoryview(mm))

    def _local_relay(self, timeout: float | None) -> Any:
        """This node's relay, remembered between polls (asked again after it died)."""
        if self._relay_cache is None:
            ray = _ray()
            key = _this_node()
            self._relay_cache = ray.get(self.directory.relay.remote(key, key), timeout=timeout)
        return self._relay_cache

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_relay_cache"] = None  # a handle of the sender's node, not the receiver's
        state["_maps"] = []
        return state

    def digest(self, version: int = 0, key: str | None = None, timeout: float | None = None) -> str:
        """The digest of node `key`'s bytes of a version >= `version`, recomputed from its file."""
        import mmap

        ray = _ray()
        _, path, _ = ray.get(self.relay(key).wait.remote(version), timeout=timeout)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return digest_of(mm)

    def kill_relay(self, key: str) -> None:
        """Kill node `key`'s relay (failure injection); receivers pulling from it re-attach elsewhere."""
        ray = _ray()
        r = self.relay(key)
        ray.kill(r, no_restart=True)
        ray.get(self.directory.mark_dead.remote(key, r))  # unless a consumer already replaced it

    def state(self) -> dict:
        """The directory's view: version, blocks per node, uploads, upstream of each receiver, dead relays."""
        return dict(_ray().get(self.directory.state.remote()))

    def close(self) -> None:
        """Kill every relay and the directory, and remove this broadcast's /dev/shm files. Idempotent."""
        ray = _ray()
        if self.directory is None:
            return
        try:
            relays = ray.get(self.directory.all_relays.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the directory is gone already; clean what we can
            relays = []
        for r in relays:
            try:
                ray.get(r.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a killed relay: its file is removed below
                pass
            ray.kill(r, no_restart=True)
        ray.kill(self.directory, no_restart=True)
        self.directory = None
        for p in glob.glob(shm_prefix(self.uid) + "*"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Broadcast:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
