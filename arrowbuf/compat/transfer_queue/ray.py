"""`tq.init()` inside a Ray job, as TransferQueue's: the first process to call it starts the system in a named Ray
actor (which serves it over Flight, `server`), and every later `init` in any process of the job finds that actor
and joins the system over Flight. The process whose `init` created the actor stops it in `close()`.

The actor binds 127.0.0.1 unless `{"arrowbuf": {"host": ...}}` says otherwise (a multi-node job needs the node's
address, and then a token: `{"arrowbuf": {"token": ...}}`).
"""

from __future__ import annotations

from typing import Any

ACTOR_NAME = "ArrowbufTransferQueue"
NAMESPACE = "arrowbuf_transfer_queue"


class _Host:
    """The Ray actor: one `TQState` served over Flight."""

    def __init__(self, capacity: int, sampler: Any, host: str, token: str | None) -> None:
        from .samplers import make_sampler
        from .server import TQServer
        from .state import TQState

        self.state = TQState(capacity=capacity, sampler=make_sampler(sampler))
        self.server = TQServer(self.state, f"grpc://{host}:0", token=token)

    def location(self) -> str:
        return str(self.server.location)

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


def join_or_start(capacity: int, sampler: Any, host: str, token: str | None) -> tuple[str, Any]:
    """The Flight location of the job's system, and the actor handle when this call started it (else None)."""
    import ray

    actor: Any
    owned: Any = None
    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        spec = sampler if isinstance(sampler, str) or sampler is None else type(sampler).__name__
        try:
            actor = ray.remote(_Host).options(name=ACTOR_NAME, namespace=NAMESPACE, num_cpus=0,
                                              lifetime=None).remote(capacity, spec, host, token)
            owned = actor
        except ValueError:  # another process created it meanwhile
            actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
            owned = None
    return str(ray.get(actor.location.remote())), owned


def join_or_start_shards(n: int, capacity: int, sampler: Any, host: str, token: str | None
                         ) -> tuple[list[str], list[Any]]:
    """The Flight locations of the job's `n`-shard system (`sharded`): one named actor per shard, found by every
    later `init` with the same `n`; and the actors this call started (stopped by its `close`)."""
    import ray

    locations: list[str] = []
    owned: list[Any] = []
    spec = sampler if isinstance(sampler, str) or sampler is None else type(sampler).__name__
    for k in range(n):
        name = f"{ACTOR_NAME}-{k}-of-{n}"
        actor: Any
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            try:
                actor = ray.remote(_Host).options(name=name, namespace=NAMESPACE, num_cpus=0, lifetime=None,
                                                  scheduling_strategy="SPREAD").remote(capacity, spec, host, token)
                owned.append(actor)
            except ValueError:  # another process created it meanwhile
                actor = ray.get_actor(name, namespace=NAMESPACE)
        locations.append(str(ray.get(actor.location.remote())))
    return locations, owned


def stop(actor: Any) -> None:
    """Stop the system's actor (the process that started it calls this from `close`)."""
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    finally:
        ray.kill(actor)
