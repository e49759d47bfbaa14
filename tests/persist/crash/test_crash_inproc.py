"""The in-process kill harness (`crash.harness`): a worker process with writer, updater, consumer and checkpoint
threads on a durable store, SIGKILLed at random moments and during checkpoints, each restore checked against the
side log (`crash.oracle`)."""

from __future__ import annotations

import pytest

from crash import harness as h


def test_smoke_three_kills(tmp_path):
    """Short, not slow: three kills (the first and the third as a checkpoint starts) of the ragged variant under
    "group"."""
    r = h.KillRun(str(tmp_path), "inproc", "group", "ragged", kills=3).run()
    assert r.kills == 3
    h.assert_clean(r)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["group", "batch", "os"])
def test_kills_ragged(tmp_path, policy):
    """Ragged and tensor fields, two tasks (consumers with and without leases), the durable directory on disk."""
    r = h.KillRun(str(tmp_path), "inproc", policy, "ragged", kills=h.pick(3, h.LONG_KILLS)).run()
    h.assert_clean(r)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["group", "batch", "os"])
def test_kills_fixed(tmp_path, policy):
    """Fixed-size fields only, no tasks: rows are copied outside the writer's lock. The durable directory is in
    /dev/shm (`KillRun(fs="tmpfs")`: a journal rotation there is fast enough for a batch copy to span it)."""
    r = h.KillRun(str(tmp_path), "inproc", policy, "fixed", kills=h.pick(3, h.LONG_KILLS), fs="tmpfs").run()
    h.assert_clean(r)
