"""Broadcast large objects (policy weights, Arrow tables) to every node: `broadcast` (one `ray.put`) and `Broadcast`.

`broadcast(obj, actors, method)` is the simple path: one `ray.put`, every actor gets the ref (each node fetches the
object once from the producer's node: a star).

`Broadcast` is Hoplite's transfer (see docs/ray.md): the object is cut into blocks, a directory actor records which
node holds how many, each node's relay pulls from the holder with the most progress that has a spare upload slot and
forwards blocks while it still receives later ones; consumers on a node map the node's one copy (a private /dev/shm
file) zero-copy. A relay created late joins the running broadcast; a newer version supersedes one in flight; a
receiver whose upstream relay dies re-attaches to another holder and resumes from the blocks it has.

The payload is a JSON header and raw tensor bytes (`payload.py`; no pickle); every block (bucket) carries the
producer's digest and is checked from the receiving node's mapping before it counts as held. Files are 0600 in a 0700
per-user directory, created O_EXCL|O_NOFOLLOW, opened by consumers once and checked to be the relay's own inode
(`arrowbuf.tiers.shm.private`); `close`, `arrowbuf shm gc` and the next `create` remove them.

Usage::

    bc = Broadcast.create(bucket_size=4 << 20)     # one relay per alive Ray node
    v = bc.publish(model.state_dict(), 7)          # returns once the source node holds it; buckets flow node to node
    bc.load_into(model, v)                         # in any process: copy this node's copy into the parameters
    v, views = bc.tensors(v)                       # or zero-copy torch views of this node's copy
    weights = bc.get(v)                            # or numpy arrays viewing it, read-only
    bc.fence(store, receivers=4)                   # store.policy_version := newest version 4 nodes hold
    bc.close()                                     # kills relays and the directory, removes the files
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ...errors import BroadcastRefused, InvalidArgument
from ...tiers.shm import private
from .._common import _ray
from .directory import BlockDirectory
from .payload import bucket_digests, combine, decode, encode, flat_tensors
from .relay import file_name, shm_prefix

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from ray.actor import ActorHandle

    from ...surface import StoreSurface


def broadcast(obj: object, actors: Iterable[ActorHandle] | None = None, method: str | None = None, *args: Any,
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


def _this_node() -> str:
    return str(_ray().get_runtime_context().get_node_id())


class Broadcast:
    """A versioned, pipelined, receiver-driven broadcast over per-node relays (see the module docstring).

    The handle pickles: pass it to actors and tasks, which call `get`, `tensors`, `load_into` or `poll`.
    """

    def __init__(self, uid: str, directory: Any, block_size: int, upload_slots: int, root_slots: int,
                 pipelined: bool, root: str | None = None) -> None:
        self.uid, self.directory = uid, directory
        self.block_size, self.upload_slots, self.root_slots = block_size, upload_slots, root_slots
        self.pipelined = pipelined
        self.root = root
        self._version = 0
        self._maps: list[Any] = []
        self._relay_cache: ActorHandle | None = None
        self._receiver: str | None = None

    @classmethod
    def create(cls, *, block_size: int = 4 << 20, upload_slots: int = 1, root_slots: int | None = None,
               pipelined: bool = True, egress_bytes_per_s: float | None = None, window: int = 4,
               nodes: bool = True, bucket_size: int | None = None, root: str | None = None) -> Broadcast:
        """Start a broadcast: its directory actor and (with `nodes`) one relay on every alive Ray node.

        Args:
            block_size: bytes per bucket (a few MB: small enough to pipeline, large enough to amortise a call).
            upload_slots: receivers one relay uploads to at once (1: a chain, 2: a binary tree).
            root_slots: the same for the producer's node (default `upload_slots`).
            pipelined: forward buckets while still receiving (False: store-and-forward, for comparison).
            egress_bytes_per_s: emulated upload bandwidth of every relay (token bucket); None for unlimited.
            window: buckets a relay requests ahead from its upstream (k of the memory bound in docs/ray.md).
            nodes: create the relays of the alive nodes now (else on first `relay`, `publish` or `get`).
            bucket_size: the same as `block_size` (the name the weight-sync literature uses); wins when given.
            root: the shared-memory root of every node (default /dev/shm or $ARROWBUF_SHM_DIR); the files live in
                its private per-user directory. Files of dead broadcasts there are swept first.
        """
        ray = _ray()
        if bucket_size is not None:
            block_size = bucket_size
        if block_size < 1 or upload_slots < 0 or window < 1:
            raise InvalidArgument(f"block_size and window must be >= 1 and upload_slots >= 0, got {block_size}, "
                                  f"{window}, {upload_slots}")
        private.sweep(root)  # the files of broadcasts whose processes died (the next start after a crash)
        os.close(private.open_dir(root))  # refuses a planted link or a foreign directory before anything starts
        uid = secrets.token_hex(4)
        directory = ray.remote(BlockDirectory).options(
            name=f"arrowbuf-bc-{uid}-directory", num_cpus=0, max_concurrency=1000).remote(
            uid, {"egress_bytes_per_s": egress_bytes_per_s, "window": window, "root": root,
                  "secret": secrets.token_hex(16)})  # relays accept only connections that know it (wire.py)
        bc = cls(uid, directory, int(block_size), int(upload_slots),
                 int(upload_slots if root_slots is None else root_slots), bool(pipelined), root)
        if nodes:
            for n in ray.nodes():
                if n.get("Alive"):
                    bc.relay(n["NodeID"], n["NodeID"])
        return bc

    def relay(self, key: str | None = None, node_id: str | None = None) -> ActorHandle:
        """The relay actor of node `key` (default: this process's node), created if missing; it joins the running
        broadcast at once. `node_id` pins it to that Ray node (default: `key` when `key` is omitted)."""
        ray = _ray()
        if key is None:
            key = node_id = _this_node()
        return ray.get(self.directory.relay.remote(key, node_id))

    def publish(self, obj: object, version: int | None = None, *, source: str | None = None,
                upload_slots: int | None = None, root_slots: int | None = None, pipelined: bool | None = None,
                allow_pickle: bool = False) -> int:
        """Publish `obj` (a state_dict, tensors, arrays, Arrow tables, JSON scalars in dicts and lists) as `version`
        (default: the last one + 1; it must grow) and return the version; the transfer runs in the background.

        The payload (a JSON header and the raw tensor bytes, see `payload.py`; no pickle) is written once into this
        node's (or `source`'s) private file, and the digest of every bucket is taken from it; that node's relay
        checks the file and serves it. The keyword overrides change the schedule of this version only (benchmarks
        compare star, tree and chain). Other Python objects raise `InvalidArgument` unless `allow_pickle` (a
        `PickleWarning`; receivers must opt in too).
        """
        import mmap

        ray = _ray()
        if version is None:
            version = self._version + 1
        if int(version) <= self._version:
            raise InvalidArgument(f"version {version} is not newer than the last published, {self._version}")
        version = int(version)
        layout = encode(obj, allow_pickle=allow_pickle)
        here = _this_node()
        source = here if source is None else source
        root = self.relay(source, None if source != here else source)
        name = file_name(self.uid, "~src", version)
        fd = private.create_file(name, layout.size, self.root)
        try:
            with mmap.mmap(fd, layout.size, access=mmap.ACCESS_WRITE) as mm:
                layout.write(mm)
                digests = bucket_digests(mm, self.block_size)
            meta = {"version": version, "size": layout.size, "block_size": self.block_size,
                    "nblocks": len(digests), "digests": digests, "digest": combine(digests),
                    "ident": list(private.identity(fd)),
                    "upload_slots": self.upload_slots if upload_slots is None else int(upload_slots),
                    "root_slots": (self.root_slots if root_slots is None else int(root_slots)),
                    "pipelined": self.pipelined if pipelined is None else bool(pipelined)}
            try:
                ray.get(root.seed.remote(meta, name))  # the relay holds (and removes) the file from now on
            except Exception:
                private.unlink(name, self.root)
                raise
        finally:
            os.close(fd)
        self._version = version
        ray.get(self.directory.publish.remote(meta, source))
        return version

    def wait(self, version: int = 0, key: str | None = None, timeout: float | None = None) -> dict:
        """Wait until node `key` (default: this node) holds a verified version >= `version`; return its meta."""
        ray = _ray()
        _, _, meta = ray.get(self.relay(key).wait.remote(version), timeout=timeout)
        return dict(meta)

    def _map(self, name: str, meta: dict, cow: bool) -> mmap.mmap:
        """Open this node's file once, check it is the relay's own (see `private.open_verified`), map it (read-only,
        or copy-on-write for torch views), close the descriptor: the name is never opened again."""
        import mmap

        fd = private.open_verified(name, meta["size"], tuple(meta["ident"]), self.root)
        try:
            return mmap.mmap(fd, meta["size"], access=mmap.ACCESS_COPY if cow else mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def _acquire(self, version: int, timeout: float | None, cow: bool) -> tuple[int, Any]:
        """(v, mapping) of this node's verified copy of a version v >= `version` (waits for it)."""
        ray = _ray()
        key = _this_node()
        r = self.relay()
        while True:
            try:
                v, name, meta = ray.get(r.wait.remote(version), timeout=timeout)
            except ray.exceptions.ActorDiedError:  # this node's relay died: a new one joins the broadcast
                r = ray.get(self.directory.relay.remote(key, key, r), timeout=timeout)
                continue
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, BroadcastRefused):
                    raise exc.cause from None
                raise
            try:
                return v, self._map(name, meta, cow)
            except FileNotFoundError:  # superseded between the answer and the open: take the newer one
                version = v + 1

    def _ack(self, version: int) -> None:
        """Tell the directory this receiver loaded `version` (for `fence(..., loads=True)`); fire and forget."""
        if self._receiver is None:
            self._receiver = f"{_this_node()[:12]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.directory.loaded.remote(self._receiver, version)

    def get(self, version: int = 0, timeout: float | None = None, *, allow_pickle: bool = False) -> Any:
        """The object of a version >= `version` from this node's copy: arrays (and tensors, as numpy arrays) view
        shared memory, read-only; Arrow tables too."""
        return self.fetch(version, timeout, allow_pickle=allow_pickle)[1]

    def fetch(self, version: int = 0, timeout: float | None = None, *,
              allow_pickle: bool = False) -> tuple[int, Any]:
        """`(v, object)` of a version `v >= version` from this node's copy (as `get`, with the version it got)."""
        v, mm = self._acquire(version, timeout, cow=False)
        obj = decode(memoryview(mm), allow_pickle=allow_pickle)
        self._ack(v)
        return v, obj

    def tensors(self, version: int = 0, timeout: float | None = None) -> tuple[int, Any]:
        """`(v, object)` with every tensor a zero-copy torch view of this node's copy of a version `v >= version`.

        The node's file is mapped copy-on-write: reads share the node's one copy; a write to a view stays private
        to this process (it copies that page), never reaching the node's copy or other consumers.
        """
        v, mm = self._acquire(version, timeout, cow=True)
        obj = decode(mm, torch_views=True)
        self._ack(v)
        return v, obj

    def load_into(self, target: torch.nn.Module | Mapping[str, torch.Tensor], version: int = 0,
                  timeout: float | None = None, *, strict: bool = True) -> int:
        """Copy a version >= `version` into existing tensors in place and return its number.

        `target`: a torch module (its `state_dict()` tensors: parameters and buffers, sharing their storage) or a
        mapping of names to tensors. Every tensor is copied from the node's shared copy straight into the target
        (`Tensor.copy_`, casting dtypes, to any device): no extra full copy. Shapes are checked for every name
        before anything is written; `strict` also refuses names missing on either side.
        """
        import torch

        v, mm = self._acquire(version, timeout, cow=True)
        src = flat_tensors(decode(mm, torch_views=True))
        dst = target.state_dict() if isinstance(target, torch.nn.Module) else dict(target)
        missing, unexpected = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
        if strict and (missing or unexpected):
            raise InvalidArgument(f"version {v} does not match the target: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")
        both = [k for k in dst if k in src]
        bad = [k for k in both if tuple(dst[k].shape) != tuple(src[k].shape)]
        if bad:
            raise InvalidArgument(f"version {v}: shapes differ for {bad[:5]} (e.g. {tuple(src[bad[0]].shape)} "
                                  f"published, {tuple(dst[bad[0]].shape)} here)")
        with torch.no_grad():
            for k in both:
                dst[k].copy_(src[k])
        del src
        self._ack(v)
        return v

    def poll(self, after: int = 0, timeout: float | None = 60.0, *, allow_pickle: bool = False
             ) -> tuple[int, Any] | None:
        """`(version, object)` when this node holds a verified version newer than `after`, else None; never waits
        for a transfer (an actor calls it between steps and keeps acting on the weights it has).

        A node whose relay died gets a new one, which joins the running broadcast (as `get`). `timeout` bounds the
        calls to the directory and the relay, not a transfer.
        """
        ray = _ray()
        r = self._local_relay(timeout)
        try:
            got = ray.get(r.current.remote(), timeout=timeout)
        except ray.exceptions.ActorDiedError:  # the relay died: a new one joins the broadcast; poll again later
            key = _this_node()
            self._relay_cache = ray.get(self.directory.relay.remote(key, key, r), timeout=timeout)
            return None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, BroadcastRefused):
                raise exc.cause from None
            raise
        if got is None or got[0] <= after:
            return None
        v, name, meta = got
        try:
            mm = self._map(name, meta, cow=False)
        except FileNotFoundError:  # superseded between the answer and the open: the next poll has the newer one
            return None
        obj = decode(memoryview(mm), allow_pickle=allow_pickle)
        self._ack(v)
        return v, obj

    def fence(self, store: StoreSurface | None = None, receivers: int | None = None, *, loads: bool = False,
              wait: int | None = None, timeout: float | None = None) -> int:
        """The version fence: the newest version fully delivered to `receivers` nodes (None: to every live node's
        relay), or with `loads`, loaded (`get`, `fetch`, `poll`, `tensors`, `load_into`) by `receivers` receiver
        handles (None: by every one that ever loaded). With `store`, raises `store.policy_version` to it (never
        lowers it), so admission by staleness counts from the weights actually delivered. With `wait`, first waits
        until the fence reaches that version. Returns the fence (0 before any delivery).
        """
        ray = _ray()
        if wait is not None:
            v = int(ray.get(self.directory.wait_fence.remote(int(wait), receivers, loads), timeout=timeout))
        else:
            v = int(ray.get(self.directory.get_fence.remote(receivers, loads), timeout=timeout))
        if store is not None and v > int(store.policy_version):
            store.policy_version = v
        return v

    def _local_relay(self, timeout: float | None) -> ActorHandle:
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
        state["_receiver"] = None     # each process that loads is a receiver of its own
        return state

    def digest(self, version: int = 0, key: str | None = None, timeout: float | None = None) -> str:
        """The digest of node `key`'s bytes of a version >= `version`, recomputed from its file."""
        ray = _ray()
        _, name, meta = ray.get(self.relay(key).wait.remote(version), timeout=timeout)
        mm = self._map(name, meta, cow=False)
        try:
            return combine(bucket_digests(mm, meta["block_size"]))
        finally:
            mm.close()

    def kill_relay(self, key: str) -> None:
        """Kill node `key`'s relay (failure injection); receivers pulling from it re-attach elsewhere."""
        ray = _ray()
        r = self.relay(key)
        ray.kill(r, no_restart=True)
        ray.get(self.directory.mark_dead.remote(key, r))  # unless a consumer already replaced it

    def state(self) -> dict:
        """The directory's view: version, blocks per node, uploads, upstream of each receiver, dead relays, the
        version each node holds verified (`delivered`) and each receiver loaded (`loads`)."""
        return dict(_ray().get(self.directory.state.remote()))

    def files(self) -> list[str]:
        """The paths of this broadcast's files on this machine (its private directory)."""
        prefix = os.path.basename(shm_prefix(self.uid, self.root))
        return [os.path.join(private.user_dir(self.root), n) for n in private.names(prefix, self.root)]

    def close(self) -> None:
        """Kill every relay and the directory, and remove this broadcast's files. Idempotent."""
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
        prefix = os.path.basename(shm_prefix(self.uid, self.root))
        for n in private.names(prefix, self.root):
            private.unlink(n, self.root)
        private.remove_if_empty(self.root)

    def __enter__(self) -> Broadcast:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
