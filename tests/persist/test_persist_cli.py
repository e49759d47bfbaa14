"""`arrowbuf checkpoint ls|inspect|verify|export` and `arrowbuf inspect <checkpoint dir>` (real files, real CLI)."""

from __future__ import annotations

import pyarrow.dataset as pads

import arrowbuf as ab
from arrowbuf.cli import main

from conftest import SMALL, make_episodes


def _checkpointed(root, times=2):
    with ab.ExperienceStore(SMALL, capacity=500, chunk_rows=32, seed=0) as store:
        for i in range(times):
            store.extend(make_episodes([120, 80], seed=i, start=i * 1e6)[0])
            store.checkpoint(root, keep=3)
        return len(store)


def test_ls_inspect_verify_export(tmp_path, capsys):
    root = tmp_path / "c"
    n = _checkpointed(root)
    assert main(["checkpoint", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "     1" in out and "     2" in out and out.rstrip().endswith("*")
    assert main(["checkpoint", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "generation 2" in out and "UniformSampler" in out and f"rows {n:,}" in out and "state:sampler" in out
    assert main(["checkpoint", "inspect", str(root), "--generation", "1"]) == 0
    assert "generation 1" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(root), "--all"]) == 0
    assert "generation 2: ok" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(root), str(tmp_path / "out"), "--format", "parquet"]) == 0
    assert pads.dataset(str(tmp_path / "out"), format="parquet").count_rows() == n
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"size {n:,}" in out and "episodes:" in out


def test_verify_names_a_damaged_file_and_fails(tmp_path, capsys):
    root = tmp_path / "c"
    _checkpointed(root, times=1)
    victim = sorted(root.glob("*.arrow"))[1]
    victim.write_bytes(victim.read_bytes()[:-10])
    assert main(["checkpoint", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and victim.name in out
    assert main(["checkpoint", "ls", str(tmp_path / "nothing")]) == 2
