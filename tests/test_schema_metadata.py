"""`ExperienceSchema.metadata`: free-form string metadata kept with a schema through dicts, Arrow schemas, shared
memory manifests and checkpoints (the TorchRL storage keeps its layout description there)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

import arrowbuf as ab

SCHEMA = {"name": "m", "fields": {"x": {"dtype": "float32", "shape": [2]}}, "metadata": {"owner": "a", "k": "{}"}}


def test_metadata_round_trips_through_dict_and_arrow() -> None:
    s = ab.load_schema(SCHEMA)
    assert s.metadata == {"owner": "a", "k": "{}"}
    assert ab.load_schema(s.to_dict()).metadata == s.metadata
    assert ab.load_schema(s.to_arrow()).metadata == s.metadata
    assert ab.load_schema({"name": "m", "fields": {"x": "float32"}}).metadata == {}
    with pytest.raises(ab.SchemaError, match="metadata"):
        ab.load_schema({**SCHEMA, "metadata": {"k": 1}})


def test_metadata_reaches_attached_and_restored_stores(tmp_path: Any) -> None:
    name = f"meta-{uuid.uuid4().hex[:8]}"
    with ab.ExperienceStore(SCHEMA, capacity=8, tier="shm", name=name) as store:
        store.extend({"x": np.ones((3, 2), np.float32)})
        with ab.ExperienceStore.attach(name) as other:
            assert other.schema.metadata == {"owner": "a", "k": "{}"}
        store.checkpoint(tmp_path / "ckpt")
    with ab.ExperienceStore.restore(tmp_path / "ckpt") as again:
        assert again.schema.metadata == {"owner": "a", "k": "{}"} and len(again) == 3
