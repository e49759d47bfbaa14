"""Durable experience: checkpoints, restore and datasets in one Arrow format (docs/format.md).

Usage::

    store.checkpoint("ckpt/", keep=3)                   # consistent, incremental, atomic
    h = store.checkpoint("ckpt/", background=True)      # sampling and inserting go on; h.wait(), h.progress
    again = ab.ExperienceStore.restore("ckpt/")         # same rows, sampler state, seeded batches
    pyarrow.dataset.dataset("ckpt/", format="ipc")      # the latest checkpoint's rows, without arrowbuf

Modules: `manifest` (layout, manifest, checksums), `snapshot` (what is copied under the store's locks),
`checkpoint` (writing, retention, background handle), `restore` (a plan the facade builds the store from, then
loads its internals), `datasets` (export, open_dataset, from_dataset), `cli` (`arrowbuf checkpoint ...`),
`journal` (a durable store's write-ahead log: segments, records, durability policies, torn tails), `replay` (what
journal records hold, and applying them to a restored store; `arrowbuf.store.durable` drives both), `remote` (the
Flight checkpoint action's root).

persist sits between the facade and the store's internals (docs/architecture.md): it reads and fills a store's one
internals object (`arrowbuf.engine.core.StoreCore`), and never builds or imports the facade; `ExperienceStore`'s
`checkpoint`, `restore`, `export` and `from_dataset` call into it.
"""

from .checkpoint import CheckpointHandle, checkpoint
from .datasets import ExperienceDataset, export, from_dataset, open_dataset
from .manifest import FORMAT_VERSION, read_manifest, verify
from .restore import RestorePlan, plan_restore

__all__ = ["CheckpointHandle", "ExperienceDataset", "FORMAT_VERSION", "RestorePlan", "checkpoint", "export",
           "from_dataset", "open_dataset", "plan_restore", "read_manifest", "verify"]
