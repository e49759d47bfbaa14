"""Drop-in integrations where users already are (docs/integrations.md).

- `arrowbuf.compat.transfer_queue`: TransferQueue 0.1.x's API (`import arrowbuf.compat.transfer_queue as tq`), a
  package whose docstring maps its modules (columns, state, samplers, meta, the tq.v2 Flight protocol, Ray, shards).
- `arrowbuf.compat.torchrl` (a package): `ArrowbufStorage`, a drop-in TorchRL replay-buffer storage backed by an
  arrowbuf store, and prioritized samplers on arrowbuf's sum trees (its `__init__` maps the package).

Nothing here is imported by `import arrowbuf`; each module imports its framework (torch, tensordict, torchrl) itself.
"""
