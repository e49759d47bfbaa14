"""Leases against other clients (issue 42): an id cannot be guessed from another (random, bound to its store), one
client cannot hold every lease (a cap per client; on a shared-memory store a cap per process too), and a lease
table whose shared memory was overwritten is `StoreCorrupt`, never a bare KeyError.

Each test here failed before issue 42 (the finding it checks is in its docstring)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from conftest import LLM

import arrowbuf as ab

G = 4


def rows(n, start=0):
    i = np.arange(start, start + n)
    return {"prompt_id": i // G, "response_tokens": [[int(k)] for k in i], "reward": i.astype(np.float32),
            "done": np.ones(n, bool), "policy_version": np.zeros(n, np.int64)}


def guesses(lease_id: str) -> list[str]:
    """Ids a client holding `lease_id` could try for its neighbours: every number in it, one up and one down."""
    out = []
    for m in re.finditer(r"\d+", lease_id):
        for d in (1, -1, 2):
            n = int(m.group()) + d
            if n >= 0:
                out.append(lease_id[:m.start()] + str(n) + lease_id[m.end():])
    head = lease_id.rsplit(".", 1)[0]
    out += [head, head + ".1", head + ".2"]
    return out


@pytest.fixture(params=["host", "shm"])
def store(request, names):
    kw = {"tier": "shm", "name": names()} if request.param == "shm" else {}
    s = ab.ExperienceStore(LLM, capacity=64, tasks=["t"], **kw)
    s.extend(rows(32))
    yield s
    s.close()


def test_a_lease_id_cannot_be_guessed_from_another(store):
    """Finding: ids were `<store token>.<counter>`: client B nacked client A's lease by guessing it."""
    mine = store.consume("t", 1, lease=60)
    theirs = store.consume("t", 1, lease=60)
    for guess in guesses(mine.lease):
        if guess == mine.lease:
            continue
        with pytest.raises(ab.LeaseError):
            store.nack(guess)
    assert store.ack(theirs.lease) == 1  # still open: no guess ended it
    assert store.ack(mine.lease) == 1
    assert len(set(store.consume("t", 1, lease=60).lease.split(".")[-1] for _ in range(5))) == 5


def test_over_flight_one_client_cannot_nack_anothers_lease_by_guessing():
    s = ab.ExperienceStore(LLM, capacity=64, tasks=["t"])
    s.extend(rows(16))
    with ab.serve(s) as server, ab.connect(server.location) as a, ab.connect(server.location) as b:
        mine = a.consume("t", 2, lease=60)
        got_one = b.consume("t", 1, lease=60)
        for guess in guesses(got_one.lease):
            if guess != got_one.lease:
                with pytest.raises(ab.LeaseError):
                    b.nack(guess)
        assert a.ack(mine.lease) == 2
    s.close()


def test_a_client_over_flight_holds_at_most_its_share_of_open_leases():
    """Finding: nothing capped the leases one client holds."""
    s = ab.ExperienceStore(LLM, capacity=64, tasks=["t"])
    s.extend(rows(32))
    with ab.serve(s, max_leases_per_client=3) as server:
        with ab.connect(server.location) as first, ab.connect(server.location) as second:
            held = [first.consume("t", 1, lease=60) for _ in range(3)]
            with pytest.raises(ab.ResourceExhausted, match="max_leases_per_client"):
                first.consume("t", 1, lease=60)
            assert second.consume("t", 1, lease=60).lease  # another client is not held back
            first.ack(held[0].lease)
            assert first.consume("t", 1, lease=60).lease  # a slot freed by an ack
            assert s.stats()["in_flight"] == {"t": 4}
    s.close()


def test_one_process_cannot_take_every_lease_slot_of_a_shared_store(names, monkeypatch):
    """Finding: on a shared-memory store one process could take all 4,096 lease slots."""
    from arrowbuf.store import consume_state, shared_leases

    monkeypatch.setattr(consume_state, "LEASE_SLOTS", 8)
    monkeypatch.setattr(shared_leases, "LEASE_SLOTS", 8)
    s = ab.ExperienceStore(LLM, capacity=64, tier="shm", name=names(), tasks=["t"])
    try:
        s.extend(rows(16))
        share = shared_leases.process_share(8)
        assert 1 <= share < 8
        held = [s.consume("t", 1, lease=60) for _ in range(share)]
        with pytest.raises(ab.ResourceExhausted, match="this process"):
            s.consume("t", 1, lease=60)
        assert s.stats()["in_flight"] == {"t": share}  # the refused consume took nothing
        held[0].nack()
        assert s.consume("t", 1, lease=60).lease
    finally:
        s.close()


def _header(store) -> np.memmap:
    path = os.path.join(store._tier.path, "arena.consume.header")
    return np.memmap(path, dtype=np.int64, mode="r+", shape=(8,))


@pytest.mark.parametrize("counter", [-5, 0, 2**62 + 1])
def test_a_corrupted_lease_counter_is_store_corrupt(names, counter):
    """Finding: a corrupted lease counter in shared memory raised a bare KeyError instead of StoreCorrupt."""
    from arrowbuf.engine.shared_leases import NEXT_LEASE

    s = ab.ExperienceStore(LLM, capacity=64, tier="shm", name=names(), tasks=["t"])
    try:
        s.extend(rows(8))
        first = s.consume("t", 1, lease=60)
        header = _header(s)
        header[NEXT_LEASE] = counter
        header.flush()
        del header
        with pytest.raises(ab.StoreCorrupt, match="arena.consume.header"):
            s.consume("t", 1, lease=60)
        assert s.ack(first.lease) == 1  # the open lease is untouched
    finally:
        s.close()


def test_a_corrupted_lease_token_is_store_corrupt(names):
    from arrowbuf.engine.shared_leases import TOKEN

    s = ab.ExperienceStore(LLM, capacity=64, tier="shm", name=names(), tasks=["t"])
    try:
        s.extend(rows(8))
        header = _header(s)
        header[TOKEN] = -1
        header.flush()
        del header
        with pytest.raises(ab.StoreCorrupt, match="arena.consume.header"):
            ab.ExperienceStore.attach(s.name).close()
    finally:
        s.close()
