"""Memory tiers: host (here), shared memory, disk and GPU arenas behind one `Tier` interface."""

from .base import Tier
from .host import HostTier

__all__ = ["Tier", "HostTier"]
