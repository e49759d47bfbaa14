"""Sharded experience stores on a Ray cluster: shard actors spread over nodes, one Flight endpoint each.

Usage::

    import ray, arrowbuf as ab
    from arrowbuf.ray import ShardedStore, broadcast

    ray.init()
    sharded = ShardedStore.create(schema, num_shards=4, capacity_per_shard=1_000_000,
                                  sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4))

    @ray.remote
    def actor(sharded):                      # the handle pickles: pass it to any task or actor
        with sharded.writer() as w:          # the local node's shard: shared memory when it can, else Flight
            for batch in rollouts():
                w.extend(batch)              # an episode stays on one shard

    batch = sharded.sample(256, deadline=0.05)   # every shard in parallel, proportionally to its mass
    sharded.update_priorities(batch.indices, td)  # routed back to the owning shards
    for part in sharded.stream(256):              # or take the per-shard parts as they arrive
        ...
    weights_ref = broadcast(policy.state_dict(), actors, "set_weights")   # one put, many gets
    sharded.shutdown()

Ids: `batch.indices` are global ids, `shard << 53 | generation << 45 | seq` (see `encode_ids`): the shard routes
priority updates, the generation (a shard incarnation, 8 bits) keeps an update meant for a row of a dead incarnation
from touching the row that replaced it after a restart, and `seq` (45 bits: 3.5e13 rows per incarnation) is the
shard store's own id.

Sampling (see docs/ray.md for the arithmetic): shard k serves `n_k` rows with `E[n_k] = n * M_k / M`, where `M_k` is
its sampling mass (priority mass `sum p^alpha` for prioritized samplers, sampleable rows otherwise) as last reported,
and serves them from its local distribution `p_i^alpha / M_k`, so an item's probability is `p_i^alpha / M` over all
shards. IS weights are normalised globally: `w_i = (P_i / P_min)^-beta` with `P_min` the smallest probability over
every shard. A straggler deadline makes a late shard's share come from the others for that call (its rows have
probability 0 in that batch; see `sample`). A dead shard's share is served by the others at once; Ray restarts it
(`max_restarts`) and it comes back under a new generation, empty, or from its last checkpoint when the store was
created with `checkpoint_root`.

Ray is imported when used; a missing ray raises `MissingDependency` naming `arrowbuf[ray]`.
"""

from __future__ import annotations

from typing import Any

from ..errors import ShardsLost
from .handle import ShardedStore
from .hoplite.broadcast import Broadcast, broadcast
from .ids import GEN_BITS, MAX_SHARDS, SEQ_BITS, SHARD_BITS, decode_ids, encode_ids, shard_of
from .shard import ShardActor, ShardBackend, ShardDirectory, shm_safe
from .writer import ShardWriter

__all__ = ["Broadcast", "GEN_BITS", "MAX_SHARDS", "SEQ_BITS", "SHARD_BITS", "ShardActor", "ShardDirectory",
           "ShardBackend", "ShardWriter", "ShardedStore", "ShardsLost", "broadcast", "decode_ids", "encode_ids",
           "shard_of", "shm_safe"]


def __getattr__(name: str) -> Any:
    if name == "ShardStore":  # deprecated name of ShardBackend
        from . import shard

        return shard.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
