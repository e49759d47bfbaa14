"""`tq.init()` inside a Ray job, as TransferQueue's: the first process to call it starts the system in a Ray actor
named "TransferQueueController" in the namespace "transfer_queue" (TransferQueue's controller's name: code that
looks the controller up with `ray.get_actor` finds this system), which serves it over Flight (`server`); every later
`init` in any process of the job finds that actor and joins the system over Flight. The process whose `init` created
the actor stops it in `close()`.

The actor binds 127.0.0.1 unless `{"arrowbuf": {"host": ...}}` says otherwise (a multi-node job needs the node's
address, and then a token: `{"arrowbuf": {"token": ...}}`). The sampler travels as its spec (class and parameters,
`samplers.sampler_spec`), so `GRPOGroupNSampler(4)` is a 4-sampler in the actor too. Besides `location`, the actor
answers TransferQueue's controller calls that tests and tools make: `list_partitions`, `clear_partition`,
`get_partition_snapshot`, `get_config`, and `save_checkpoint`/`load_checkpoint` (paths on the actor's node).

Its field groups are in /dev/shm unless `{"arrowbuf": {"shared_memory": False}}`: the processes of its node write
and read their rows themselves (`remote`), only plans, commits and locations go over Flight.
"""

from __future__ import annotations

import gc
from typing import Any

from .samplers import sampler_spec

ACTOR_NAME = "TransferQueueController"
NAMESPACE = "transfer_queue"
#: The actor's server limits (docs/security.md): it serves its own job's processes, with TransferQueue-sized puts
#: (perftest's are 320 MiB); `init({"arrowbuf": {"limits": {...}}})` overrides any of them.
JOB_LIMITS: dict[str, Any] = {"max_upload_bytes": 64 << 30, "max_reply_bytes": 64 << 30, "max_put_rows": 1 << 24,
                              "max_ids": 1 << 24, "max_request_bytes": 64 << 20}


class TransferQueueController:
    """The Ray actor: one `TQState` served over Flight."""

    def __init__(self, settings: dict[str, Any], host: str, token: str | None) -> None:
        from .limits import TQLimits
        from .server import TQServer
        from .state import TQState

        self.settings = settings
        self.state = TQState(capacity=settings["capacity"], sampler=settings["sampler"],
                             polling_mode=settings["polling_mode"], wait=settings["wait"],
                             shared_memory=settings.get("shared_memory") is not False)
        limits = TQLimits(**{**JOB_LIMITS, **(settings.get("limits") or {})})
        self.server = TQServer(self.state, f"grpc://{host}:0", token=token, limits=limits)
        # this process is the system's own: what it imported (Ray, pyarrow, numpy: most of its objects) stays for
        # its life, so the cyclic collector need not walk it again. Without this a full collection walked it in the
        # middle of a put (0.15-0.2 s of a 0.25 s 320 MiB put over Flight, in a two-process put loop)
        gc.collect()
        gc.freeze()

    def location(self) -> str:
        return str(self.server.location)

    def get_config(self) -> dict[str, Any]:
        """The settings the system was started with."""
        return dict(self.settings)

    def list_partitions(self) -> list[str]:
        return self.state.list_partitions()

    def clear_partition(self, partition_id: str) -> None:
        self.state.clear_partition(partition_id)

    def get_partition_snapshot(self, partition_id: str) -> Any:
        """A copy of a partition's bookkeeping (`meta.PartitionSnapshot`), or None."""
        from .meta import PartitionSnapshot

        record = self.state.snapshot(partition_id)
        return None if record is None else PartitionSnapshot(record)

    def save_checkpoint(self, path: str) -> None:
        self.state.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.state.load_checkpoint(path)

    def shutdown(self) -> None:
        self.server.close()
        self.state.close()


def ray_running() -> bool:
    """Whether this process is connected to a Ray cluster (driver or worker)."""
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def _spec(settings: dict[str, Any]) -> dict[str, Any]:
    """What the actor needs of `api._settings` (no token: `get_config` hands this out)."""
    return {"capacity": settings["capacity"], "polling_mode": settings["polling_mode"], "wait": settings["wait"],
            "sampler": sampler_spec(settings["sampler"]), "limits": settings.get("limits"),
            "shared_memory": settings.get("shared_memory")}


def _start(name: str, settings: dict[str, Any], host: str, token: str | None, **options: Any) -> tuple[Any, bool]:
    """The named actor: found, or started by this call (then True)."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE), False
    except ValueError:
        pass
    spec = _spec(settings)
    try:
        return ray.remote(TransferQueueController).options(name=name, namespace=NAMESPACE, num_cpus=0,
                                                           lifetime=None, **options).remote(spec, host, token), True
    except ValueError:  # another process created it meanwhile
        return ray.get_actor(name, namespace=NAMESPACE), False


def join_or_start(settings: dict[str, Any], host: str, token: str | None) -> tuple[str, Any, Any]:
    """(the Flight location of the job's system, its actor, the actor when this call started it else None)."""
    actor, started = _start(ACTOR_NAME, settings, host, token)
    return _location(actor, ACTOR_NAME), actor, actor if started else None


def _location(actor: Any, name: str) -> str:
    """The Flight location of the system in the actor `name`; a clear error when that actor is not this system
    (TransferQueue's own controller has the same name: both cannot run in one Ray job)."""
    import ray

    try:
        method = actor.location
    except AttributeError:
        raise RuntimeError(
            f"the Ray actor {name!r} in namespace {NAMESPACE!r} is not arrowbuf's TransferQueue system "
            "(TransferQueue's own controller runs under that name?): close that system first; one job runs one of "
            "them") from None
    return str(ray.get(method.remote()))


def join_or_start_shards(n: int, settings: dict[str, Any], host: str, token: str | None
                         ) -> tuple[list[str], list[Any]]:
    """The Flight locations of the job's `n`-shard system (`sharded`): one named actor per shard, found by every
    later `init` with the same `n`; and the actors this call started (stopped by its `close`)."""
    locations: list[str] = []
    owned: list[Any] = []
    for k in range(n):
        actor, started = _start(f"{ACTOR_NAME}-{k}-of-{n}", settings, host, token, scheduling_strategy="SPREAD")
        if started:
            owned.append(actor)
        locations.append(_location(actor, f"{ACTOR_NAME}-{k}-of-{n}"))
    return locations, owned


def stop(actor: Any) -> None:
    """Stop the system's actor (the process that started it calls this from `close`)."""
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    finally:
        ray.kill(actor)
