"""SampleBatch (arrowbuf/delivery/batch.py): joining batches of one schema made by different stores."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from conftest import LLM

import arrowbuf as ab


def _rows(n, start=0):
    i = np.arange(start, start + n)
    return {"prompt_id": i, "response_tokens": [[int(k)] * (int(k) % 3 + 1) for k in i], "done": np.ones(n, bool),
            "policy_version": np.zeros(n, np.int64)}


def test_concat_joins_a_part_with_unwritten_fields_and_a_part_without():
    """A sharded consume joins the shards' parts: a later field still NULL in one part (an Arrow array, its nulls
    kept) and written in another (numpy) must join, with the nulls where they were."""
    schema = {**LLM, "fields": {**LLM["fields"], "reward": {"dtype": "float32", "later": True}}}
    a, b = (ab.ExperienceStore(schema, capacity=16, tasks=["t"]) for _ in range(2))
    try:
        a.extend(_rows(2))
        ids = b.extend(_rows(3, start=2))
        b.update(ids, {"reward": np.array([1.0, 2.0, 3.0], np.float32)})
        pa_part, np_part = a.consume("t", 8), b.consume("t", 8)
        assert isinstance(pa_part["reward"], pa.Array) and isinstance(np_part["reward"], np.ndarray)
        for first, second in ((pa_part, np_part), (np_part, pa_part)):
            joined = ab.SampleBatch.concat([first, second])
            assert len(joined) == 5 and joined.data.num_rows == 5
        joined = ab.SampleBatch.concat([pa_part, np_part])
        assert pa.array(joined["reward"]).to_pylist() == [None, None, 1.0, 2.0, 3.0]
        assert joined.data.column("response_tokens").to_pylist()[2] == [2, 2, 2]
        np.testing.assert_array_equal(joined.indices, np.concatenate([pa_part.indices, np_part.indices]))
    finally:
        a.close()
        b.close()
