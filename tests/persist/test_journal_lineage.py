"""Lineage survives a restore from the journal (issue 25): replayed rows keep the writer and write time, and their
consumption the consumer and time, that the journal recorded, not the restoring process's name and clock."""

from __future__ import annotations

import time

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.observe.identity import acting_as
from arrowbuf.persist import replay as rp

pytest.importorskip("duckdb")

SCHEMA = {"name": "l", "fields": {"x": "int64", "done": "bool"}}
Q = ("SELECT seq, writer, epoch(written_at) AS w, task, consumer, epoch(consumed_at) AS c, outcome, staleness "
     "FROM lineage "
     "ORDER BY seq, task")


def rows(n, start):
    return {"x": np.arange(start, start + n), "done": np.ones(n, bool)}


@pytest.mark.parametrize("bulk", [True, False])
def test_a_restore_from_the_journal_keeps_who_wrote_and_consumed_and_when(tmp_path, monkeypatch, bulk):
    if not bulk:
        monkeypatch.setattr(rp, "BULK_ROWS", 0)
    root = str(tmp_path / "run")
    s = ab.ExperienceStore(SCHEMA, capacity=100, durable=root, durability="os", tasks=["train"])
    with acting_as("actor-7"):
        for i in range(3):
            s.extend(rows(4, 4 * i))
    s.checkpoint()  # the rows above come back from the checkpoint, the rest from the journal
    with acting_as("actor-9"):
        for i in range(3, 6):
            s.extend(rows(4, 4 * i))
    with acting_as("trainer-2"):
        assert len(s.consume("train", 6).indices) == 6
    with acting_as("trainer-3"):
        b = s.consume("train", 4, lease=30.0)
        b.ack()
    before = s.sql(Q).to_pylist()
    s.close()
    time.sleep(0.05)  # a restore now would stamp a later time
    with acting_as("restorer"), ab.ExperienceStore.restore(root) as again:
        after = again.sql(Q).to_pylist()
        counts = again.stats()["journal"]["replayed"]
    assert counts["batch"] == 3 and counts["consumed"] == 2
    assert [r["seq"] for r in after] == [r["seq"] for r in before] == list(range(24))
    assert {r["writer"] for r in after} == {"actor-7", "actor-9"}
    assert [r["writer"] for r in after] == [r["writer"] for r in before]
    assert [r["consumer"] for r in after] == [r["consumer"] for r in before]
    assert [r["consumer"] for r in after][:10] == ["trainer-2"] * 6 + ["trainer-3"] * 4
    assert [(r["outcome"], r["staleness"]) for r in after] == [(r["outcome"], r["staleness"]) for r in before]
    assert [r["outcome"] for r in after][:10] == ["delivered"] * 6 + ["acked"] * 4
    for a, b in zip(before, after):
        # the journal records a batch at its reservation, microseconds before the live store stamped its commit
        assert abs(a["w"] - b["w"]) < 0.02, (a, b)
        if a["c"] is not None:
            assert abs(a["c"] - b["c"]) < 0.02, (a, b)
