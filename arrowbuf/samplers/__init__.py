"""Samplers: which items a sample returns.

A sampler selects items (rows by seq, or windows of rows) from the store's `RingIndex`; the store calls it under its
lock and gathers the data. Usage loop (what the store does)::

    sampler.bind(index, rng)         # once: a sampler instance serves one store (a second store raises)
    sampler.on_valid(positions)      # rows became sampleable (committed, next observation known)
    sampler.on_invalid(positions)    # rows stopped being sampleable (evicted, removed)
    seqs, weights = sampler.select(n)   # None when nothing can be served now
    sampler.on_sampled(seqs)         # after the batch is gathered
    sampler.update_priorities(positions, priorities)   # priorities checked first by `validate_priorities`
    sampler.mass(positions); sampler.total_mass(); sampler.min_mass()   # the sampling distribution, for placement

Sampling mass: every sampler states how likely each ring position is to be drawn, unnormalised, through `mass`
(1 per sampleable row for uniform, FIFO and LIFO sampling; the sum-tree leaf `p^alpha` for prioritized sampling; a
sequence sampler's start rows as its start distribution sees them), so callers never branch on sampler classes.

Importance-sampling weights (prioritized sampling) are `(P(i) / P_min)^-beta` with `P_min` the smallest positive
probability over the whole buffer, not over the batch: the largest weight a batch can hold is 1, and a batch whose
rows all have more than the smallest probability has its largest weight below 1. Items enter at the running maximum
priority seen by `update_priorities` (1.0 before any update). A priority of 0 gives probability 0 (with `eps=0`).

One module per family (`uniform`, `fifo` (FIFO and LIFO), `prioritized` with `sumtree`, `sequence`, `group`), the
interface in `base`, and one codec of specs in `spec`. Exported here as `Uniform`, `Fifo`, ...;
`ExperienceStore(sampler="uniform" | "fifo" | instance)`.
"""

from .base import MAX_PRIORITY, Sampler, validate_priorities
from .fifo import FifoSampler, LifoSampler
from .group import GroupSampler
from .prioritized import PrioritizedSampler
from .sequence import SequenceSampler
from .spec import from_spec, make_sampler, to_spec
from .uniform import UniformSampler

# Short names for the namespace: ab.samplers.Uniform, ab.samplers.Fifo, ...
Uniform = UniformSampler
Fifo = FifoSampler
Lifo = LifoSampler
Prioritized = PrioritizedSampler
Sequence = SequenceSampler
Group = GroupSampler

__all__ = ["MAX_PRIORITY", "validate_priorities", "Sampler", "UniformSampler", "FifoSampler", "LifoSampler",
           "PrioritizedSampler", "SequenceSampler", "GroupSampler", "Uniform", "Fifo", "Lifo", "Prioritized",
           "Sequence", "Group", "make_sampler", "to_spec", "from_spec"]
