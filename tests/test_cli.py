"""The `arrowbuf` command line: inspect (Flight location, shared-memory name, IPC file), demo and bench entry points."""

import os
import subprocess
import sys
import uuid

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from arrowbuf.cli import main
from conftest import ROOT, SMALL, make_episodes


def filled_store(**kw):
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=100, seed=0, **kw)
    store.extend(make_episodes([5, 7])[0])
    return store


def test_inspect_flight_location(capsys):
    store = filled_store()
    try:
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            assert main(["inspect", server.location, "--sql", "SELECT count(*) AS n FROM experience"]) == 0
    finally:
        store.close()
    out = capsys.readouterr().out
    assert "size 12 of 100 rows" in out
    assert "episodes: 2 (2 complete)" in out
    assert "obs" in out and " n" in out and "12" in out


def test_inspect_shared_memory_store(capsys):
    name = f"clitest-{uuid.uuid4().hex[:8]}"
    store = filled_store(tier="shm", name=name)
    try:
        assert main(["inspect", name]) == 0
    finally:
        store.close()
    out = capsys.readouterr().out
    assert f"shared-memory store {name!r}" in out and "size 12 of 100 rows" in out


def test_inspect_ipc_file(tmp_path, capsys):
    store = filled_store()
    table = store.to_table()
    store.close()
    path = tmp_path / "experience.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "size 12 of 12 rows" in out and "episodes: 2 (2 complete)" in out


def test_inspect_missing_target(capsys):
    assert main(["inspect", f"no-such-store-{uuid.uuid4().hex[:6]}"]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_console_script_and_bench_entry_point():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "arrowbuf.cli", "--help"], capture_output=True, text=True,
                         check=True, env=env).stdout
    for cmd in ("serve", "demo", "inspect", "bench", "shm"):
        assert cmd in out
    bench = subprocess.run([sys.executable, "-m", "arrowbuf.cli", "bench", "--help"], capture_output=True, text=True,
                           env=env, cwd=ROOT)
    assert bench.returncode == 0 and "benchmarks" in bench.stdout


@pytest.mark.slow
def test_demo_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "arrowbuf.cli", "demo", "--transport", "local", "--actors", "1",
                          "--steps", "600", "--warmup", "200", "--no-progress", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "mean return: first 20 episodes" in res.stdout
    assert (tmp_path / "returns.png").stat().st_size > 0
    assert np.isfinite(float(res.stdout.split("last 20 episodes")[1].split()[0]))


def test_serve_beyond_loopback_needs_a_token(capsys):
    """Issue 42: `arrowbuf serve` refuses a non-loopback bind without --token-file (TEST-NET-1: nothing is bound)."""
    assert main(["serve", "--schema", "cartpole", "--capacity", "10", "--host", "192.0.2.1"]) == 2
    assert "without a token" in capsys.readouterr().err
