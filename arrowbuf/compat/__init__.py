"""Drop-in integrations where users already are (docs/integrations.md).

- `arrowbuf.compat.transfer_queue`: TransferQueue 0.1.x's API (`import arrowbuf.compat.transfer_queue as tq`), a
  package whose docstring maps its modules (columns, state, samplers, meta, the tq.v1 Flight protocol, Ray, shards).
- `arrowbuf.compat.torchrl`: `ArrowbufStorage`, a TorchRL replay-buffer storage backed by an arrowbuf store.

Nothing here is imported by `import arrowbuf`; each module imports its framework (torch, tensordict, torchrl) itself.
"""
