"""Samplers: which items a sample returns.

One module per family: `uniform`, `fifo` (FIFO and LIFO queues), `prioritized` (with the sum trees of `sumtree`),
`sequence` (windows of T rows), `group` (whole groups, the LLM path). `base` holds the interface, its usage loop, the
sampling-mass and importance-weight conventions; `spec` is the one codec of specs that checkpoints and shared-memory
manifests record. Exported here as `Uniform`, `Fifo`, `Lifo`, `Prioritized`, `Sequence`, `Group`;
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
