"""TorchRL on arrowbuf: `ArrowbufStorage`, a drop-in replay-buffer storage whose elements are rows of an arrowbuf
store, and prioritized samplers that need no C++ extension.

    from torchrl.data import TensorDictReplayBuffer, TensorDictPrioritizedReplayBuffer
    from arrowbuf.compat.torchrl import ArrowbufStorage, ArrowbufPrioritizedSampler, use_arrowbuf_sum_trees

    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(100_000), batch_size=256)
    per = TensorDictReplayBuffer(storage=ArrowbufStorage(100_000), priority_key="td_error", batch_size=256,
                                 sampler=ArrowbufPrioritizedSampler(100_000, alpha=0.6, beta=0.4))
    use_arrowbuf_sum_trees()   # TorchRL's own prioritized buffers, on arrowbuf's sum trees (no C++ extension)
    per = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=ArrowbufStorage(100_000), batch_size=256)

The package, one concept per module:

- `storage`: `ArrowbufStorage` (TorchRL's Storage API: writes, reads, shape, state, pickling across processes).
- `layout`: how a tensor, TensorDict, tensorclass or pytree maps onto columns (schema from the first write) and
  back; `codecs`: one codec per kind of leaf (dense tensors, the bits of bf16/complex/float8, NonTensorData as JSON).
- `index`: TorchRL's index forms (ints, slices, tensors, boolean masks, tuples) resolved to element positions.
- `slots`: element positions <-> store rows (each row records its position: any write order works).
- `rows`: reading rows by id (a local store's `take`, a served store's snapshot).
- `state`: state_dicts (`torch.load(weights_only=True)` reads them; LazyTensorStorage's load too).
- `shared`: a shared-memory storage handed to workers before its first write (the home process creates the store).
- `sumtrees`: TorchRL's segment-tree classes on arrowbuf's sum and min trees (`use_arrowbuf_sum_trees`).
- `samplers`: `ArrowbufPrioritizedSampler` (TorchRL's PrioritizedSampler on those trees) and `ArrowbufSampler`
  (delegates to the store's own sampler).

`import arrowbuf` does not import this package; importing it imports torch, tensordict and torchrl.
docs/integrations.md lists what is supported and what raises.
"""

from .samplers import ArrowbufPrioritizedSampler, ArrowbufSampler
from .storage import ArrowbufStorage
from .sumtrees import use_arrowbuf_sum_trees

__all__ = ["ArrowbufPrioritizedSampler", "ArrowbufSampler", "ArrowbufStorage", "use_arrowbuf_sum_trees"]
