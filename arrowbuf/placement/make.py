"""`make_placement`: a placement policy from what the store was given (an instance, a class, a name or None)."""

from __future__ import annotations

from ..errors import InvalidArgument
from .bandwidth import BandwidthAware
from .base import Placement, Static


def make_placement(spec: object, tiers: int) -> Placement | None:
    """The policy for a store with `tiers` data tiers: the one given, BandwidthAware() for several, else None."""
    if spec is None:
        return BandwidthAware() if tiers > 1 else None
    if isinstance(spec, Placement):
        return spec
    if isinstance(spec, type) and issubclass(spec, Placement):
        return spec()
    if spec == "bandwidth_aware":
        return BandwidthAware()
    if spec == "static":
        return Static()
    raise InvalidArgument(f"unknown placement {spec!r}; expected an ab.placement policy, 'bandwidth_aware' or 'static'")
