"""Durable experience: checkpoints, restore and datasets in one Arrow format (docs/format.md).

Usage::

    store.checkpoint("ckpt/", keep=3)                   # consistent, incremental, atomic
    h = store.checkpoint("ckpt/", background=True)      # sampling and inserting go on; h.wait(), h.progress
    again = ab.ExperienceStore.restore("ckpt/")         # same rows, sampler state, seeded batches
    pyarrow.dataset.dataset("ckpt/", format="ipc")      # the latest checkpoint's rows, without arrowbuf

Modules: `manifest` (layout, manifest, checksums), `snapshot` (what is copied under the store's locks),
`checkpoint` (writing, retention, background handle), `restore`, `datasets` (export, open_dataset, from_dataset),
`parts` (what persist sees of a store).
"""

from .checkpoint import CheckpointHandle, checkpoint
from .datasets import ExperienceDataset, export, from_dataset, open_dataset
from .manifest import FORMAT_VERSION, read_manifest, verify
from .parts import StoreParts
from .restore import restore

__all__ = ["CheckpointHandle", "ExperienceDataset", "FORMAT_VERSION", "StoreParts", "checkpoint", "export",
           "from_dataset", "open_dataset", "read_manifest", "restore", "verify"]
