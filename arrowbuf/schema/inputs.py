"""Named types of what arrowbuf's entry points accept and return, for signatures that take many shapes of input.

A store takes a batch as a dict of arrays, a `pa.RecordBatch` or a `pa.Table`; ids and priorities as numpy arrays,
lists or torch tensors. Writing those unions out in every signature (or writing `Any`) loses the reader, so they are
named here once::

    def extend(self, batch: BatchLike) -> np.ndarray: ...
    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> int: ...

They are type aliases only (strings at run time: this module imports neither torch nor anything heavy). pyarrow has
no type information, so to mypy an Arrow member of a union is `Any`; the names still tell a reader what comes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import numpy.typing as npt
    import pyarrow as pa
    import torch

#: One column of a batch: values with a leading row dimension (a numpy array, nested lists, a `pa.Array` or
#: `pa.ChunkedArray`, a torch tensor); for a ragged field, one list per row.
ColumnLike: TypeAlias = "npt.ArrayLike | pa.Array | pa.ChunkedArray | torch.Tensor"

#: A batch of steps: a dict of columns (`ColumnLike`, one leading row dimension), a `pa.RecordBatch` or a `pa.Table`.
BatchLike: TypeAlias = "Mapping[str, ColumnLike] | pa.RecordBatch | pa.Table"

#: One step (`append`): field name -> its value for that step (a scalar, an array of the field's shape, a list for a
#: ragged field, a JSON value for a json field).
StepLike: TypeAlias = "Mapping[str, object]"

#: Row ids (`update_priorities`, `update`, `take`): a 1-D integer numpy array, a list of ints, or a torch tensor (a
#: device sample's indices).
IdsLike: TypeAlias = "npt.ArrayLike | torch.Tensor"

#: One number per id (priorities, weights): a 1-D numpy array, a list of numbers, or a torch tensor.
ValuesLike: TypeAlias = "npt.ArrayLike | torch.Tensor"

#: A field's values in stored form (`ExperienceSchema.validate_batch`, `convert_field`): a [n, *shape] numpy array
#: for a fixed-width field (a `np.ma.MaskedArray` where a later field has rows without a value), a `pa.Array` for a
#: ragged or json field.
Converted: TypeAlias = "np.ndarray | pa.Array"

#: One column of rows as a gather delivers it (`ColumnArenas.take`, a `SampleBatch`'s values): a [n, *shape] numpy
#: array, a `pa.Array` (ragged fields, later fields with rows without a value), or a torch tensor (a GPU tier).
Gathered: TypeAlias = "np.ndarray | pa.Array | torch.Tensor"

#: A torch device as arrowbuf's `to_torch`/`Loader` take it: "cpu", "cuda:0", an index or a `torch.device`.
DeviceLike: TypeAlias = "str | int | torch.device"

#: A JSON value (json fields, manifests, protocol bodies).
JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"

__all__ = ["BatchLike", "ColumnLike", "Converted", "DeviceLike", "Gathered", "IdsLike", "JsonValue", "StepLike",
           "ValuesLike"]
