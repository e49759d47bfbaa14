"""Drop-in integrations where users already are (docs/integrations.md).

- `arrowbuf.compat.transfer_queue`: TransferQueue 0.1.x's API (`import arrowbuf.compat.transfer_queue as tq`);
  `tq_columns` maps its fields onto Arrow columns, `tq_state` keeps partitions, keys, tags and statuses,
  `tq_samplers` its samplers, `tq_meta` its metadata objects, `tq_flight` serves it over Arrow Flight.
- `arrowbuf.compat.torchrl` (a package): `ArrowbufStorage`, a drop-in TorchRL replay-buffer storage backed by an
  arrowbuf store, and prioritized samplers on arrowbuf's sum trees (its `__init__` maps the package).

Nothing here is imported by `import arrowbuf`; each module imports its framework (torch, tensordict, torchrl) itself.
"""
