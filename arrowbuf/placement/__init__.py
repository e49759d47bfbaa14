"""Placement: which tier each (column, chunk) of a tiered store lives in.

Usage::

    store = ab.ExperienceStore(schema, capacity, tiers={"gpu": "8GiB", "host": "16GiB", "disk": "spill/"},
                               placement=ab.placement.BandwidthAware())   # the default when several tiers are given
    store.placement()               # pa.Table: column, tier, chunks, bytes
    store.placement(explain=True)   # ... and why: access share, sampling mass, value per byte, bandwidth

A policy is bound to one store's internals, which it sees only as a `PlacementTarget` (a Protocol of what a policy
reads and calls: tiers, chunk residency, access counts, per-chunk sampling mass, and `migrate`; the store's
`StoreCore` satisfies it, and placement imports nothing of the store); it runs `step()` in a
background thread every `interval` seconds (or not at all with `interval=None`: call `step()` yourself, as the tests
do). A step reads the inputs, plans, and carries out moves; each
move copies one chunk of one column off the sample path and flips the slot table (see `arrowbuf.ring.columns`).

`BandwidthAware` (after the Conduit paper): the value of keeping a (column, chunk) in a faster tier is the rate of
bytes samples read from it, `rows/s of the column x the chunk's share of the sampling mass x row bytes`, per byte
held: `access share(column) x mass share(chunk)`, the same for every column's row size. Tiers are filled top-down,
greedily by that value per byte, under each tier's byte budget; a (column, chunk) already in a tier counts
`1 + hysteresis` times its value there (a newcomer must beat it clearly) and access counts decay with a half-life of
a few steps, so an alternating pattern settles instead of thrashing. A promotion is made only if what it saves before
the chunk is evicted, `bytes read/s x (1/bandwidth below - 1/bandwidth above) x remaining life`, exceeds the copy,
`chunk bytes / copy bandwidth`; bandwidths come from a short probe (cached per process), or are given.
"""


from .bandwidth import BandwidthAware
from .base import Placement, Static
from .explain import placement_table
from .make import make_placement
from .probe import probe_bandwidth
from .target import PlacementTarget

__all__ = ["Placement", "PlacementTarget", "BandwidthAware", "Static", "make_placement", "placement_table",
           "probe_bandwidth"]
