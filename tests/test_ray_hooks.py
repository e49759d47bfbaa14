"""Test hooks of production actors are gated: a shard refuses `set_delay` unless its sharded store was created with
`_test_hooks=True` (injected by the test, never read from the environment)."""

from __future__ import annotations

import types

import pytest

import arrowbuf as ab
from arrowbuf.ray.shard import ShardActor


def _shard(test_hooks):
    return types.SimpleNamespace(shard_store=types.SimpleNamespace(delay_s=0.0), test_hooks=test_hooks)


def test_a_shard_refuses_set_delay_without_test_hooks():
    shard = _shard(False)
    with pytest.raises(ab.InvalidArgument, match="test hook"):
        ShardActor.set_delay(shard, 1.0)
    assert shard.shard_store.delay_s == 0.0


def test_a_shard_of_a_test_run_takes_set_delay():
    shard = _shard(True)
    ShardActor.set_delay(shard, 0.5)
    assert shard.shard_store.delay_s == 0.5


def test_the_shard_adapters_old_name_still_works_and_says_its_new_one():
    import arrowbuf.ray as abr
    from arrowbuf.ray.shard import ShardBackend

    with pytest.warns(DeprecationWarning, match="ShardBackend"):
        assert abr.ShardStore is ShardBackend
