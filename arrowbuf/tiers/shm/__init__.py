"""The shared-memory tier: a store's arenas as plain files in /dev/shm that every process on the node maps.

Usage::

    store = ExperienceStore(schema, capacity=1_000_000, tier="shm", name="replay")   # creates the segments
    other = ExperienceStore.attach("replay")     # in another process: the same store over the same memory
    other.extend(batch); other.sample(256)       # writers and samplers in any process
    store.close()                                # the creator's close removes the name (see Lifetime)

Layout: one directory per store, ``/dev/shm/arrowbuf.<name>/`` (``$ARROWBUF_SHM_DIR`` overrides the root)::

    owner.lock      flock'ed by the creating process for its whole life; the kernel drops the lock when that process
                    dies, which is how the janitor tells a live store from a stale one (no pid-reuse race)
    owner.json      pid and start time of the creator (informational)
    manifest.json   written by seal(): format version, schema, geometry, sampler and rate-limiter specs, the arenas
    arena.<key>     one file per arena (a column's slots, the ring index, counters), reserved with posix_fallocate at
                    creation so that a later write can never SIGBUS, and mmap'd MAP_SHARED
    arena.tier.locks  the store's locks: process-shared robust pthread mutexes (the kernel marks a dead holder's
                    mutex owner-dead and the next locker takes it over); where libc lacks them, lock.<key> files
                    with flock
    lease.<pid>-..  one per open handle (process), flock'ed while it is open (listing; pruned by the janitor)

The store above keeps more state in arenas of the same kind: consumption per task, its leases and the Group sampler's
drops (`arena.consume.*`, `arena.sampler.group.*`: `arrowbuf.engine.consume_state`, `arrowbuf.engine.shared_leases`).

Plain files rather than `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks a segment when
any process that attached to it exits.

Lifecycle (Plasma's create, write, seal, get, release, at two levels):

- The store: `SharedMemoryTier.create(name)` makes the directory under a temporary name, takes the owner lock and
  renames it into place (the name is claimed atomically); the store then allocates its arenas (write) and calls
  `seal(meta)`, which publishes the manifest: from then on `attach(name)` (get) maps the same memory in any process.
  `close()` releases this process's mappings and lease (release).
- Rows and chunks: a writer fills free arena rows (create, write; the ring keeps one spare chunk, so no live row is
  touched) and commits them under the state lock (seal: they become visible; a full chunk is sealed and immutable
  until the ring evicts it); readers gather rows or take zero-copy views of sealed chunks (get); views are released by
  dropping them. A sampler checks each row's seq after its gather (a seqlock), so a recycled row is drawn again.

Lifetime: the creator owns the segments. Its `close()` (or `unlink()` from any process) removes the name: processes
still attached keep using their mappings, which the kernel frees when the last one unmaps; new attaches fail. If the
creator dies, the janitor (`gc()`, run on every create and attach, and by ``arrowbuf shm gc``) removes the store.

Views: `to_table()` columns are zero-copy views of the mappings, marked read-only (numpy flags, immutable Arrow
buffers); samples are gathered copies, and `SampleBatch.to_torch()` copies any read-only array, so no tensor it makes
aliases shared memory. The mappings themselves stay writable (a tensor over a read-only mapping segfaults on `add_`);
torch ignores read-only flags in DLPack, so `torch.from_dlpack(column)` of a `to_table()` column aliases the store:
copy it first.

Crash safety: every cross-process lock is a robust mutex (or an flock), which the kernel hands on when its holder
dies, so a writer killed mid-extend never blocks the others; rows it had not committed are invisible and are
overwritten by the next writer.

The package: `paths` (names, directories, small file helpers), `locks` (robust mutexes, flock locks), `segment`
(`SharedMemoryTier`: create, attach, arenas, seal, close), `janitor` (reclaiming stores of dead owners, leases,
listing), `manifest` (sampler and rate-limiter specs), `private` (the per-user 0700 directory and 0600 files of the
broadcast, `arrowbuf.ray.Broadcast`; ``arrowbuf shm gc`` sweeps the ones nobody holds).
"""

from __future__ import annotations

from .janitor import gc, list_stores, remove
from .locks import FlockLock, RobustMutex
from .paths import FORMAT_VERSION, PREFIX, shm_root, store_path
from .segment import SharedMemoryTier

__all__ = ["SharedMemoryTier", "RobustMutex", "FlockLock", "gc", "list_stores", "remove", "shm_root", "store_path",
           "FORMAT_VERSION", "PREFIX"]
