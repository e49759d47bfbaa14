"""Issue 30, "the first hour of a new user": the command line answers a user's mistake with one line saying what was
wrong and what to do, never a traceback; every demo is listed and reachable from both entry points."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

import arrowbuf as ab
from arrowbuf.cli import main

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_demo_help_lists_every_demo(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("dqn", "grpo", "ray"):
        assert f"  {name} " in out
    r = subprocess.run([sys.executable, "-m", "arrowbuf.demo", "--help"], capture_output=True, text=True, env=ENV,
                       check=True)
    for name in ("dqn", "grpo", "ray"):
        assert f"  {name} " in r.stdout


@pytest.mark.parametrize("demo,flag", [("grpo", "--workers"), ("ray", "--shards"), ("dqn", "--transport")])
def test_arrowbuf_demo_reaches_every_demo(demo, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", demo, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"arrowbuf demo {demo}" in out and flag in out


def test_unknown_demo_is_one_line(capsys):
    assert main(["demo", "nope"]) == 2
    assert "grpo" in _one_line_error(capsys.readouterr().err)


def test_bench_passes_its_flags_on(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    assert main(["bench", "--quick", "--only", "core"]) == 0
    assert calls and calls[0][-3:] == ["--quick", "--only", "core"]


def test_bench_without_a_checkout_says_what_to_run(monkeypatch, tmp_path, capsys):
    import arrowbuf.cli as cli

    monkeypatch.setattr(cli, "__file__", str(tmp_path / "arrowbuf" / "cli.py"))  # as installed from a wheel
    assert main(["bench", "--quick"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "source checkout" in line and "arrowbuf bench --quick" in line


def test_serve_bad_schema_path_is_one_line(capsys):
    assert main(["serve", "--schema", "no/such/schema.yaml", "--capacity", "10"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "no/such/schema.yaml" in line and "cartpole" in line


def test_serve_port_in_use_names_the_port(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--schema", "cartpole", "--capacity", "10", "--port", str(port)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"127.0.0.1:{port}" in line and "--port" in line


def test_inspect_a_parquet_file_from_export(tmp_path, capsys):
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=100)
    for i in range(10):
        store.append({"obs": np.full(4, i, np.float32), "action": 0, "reward": 1.0, "terminated": i == 9,
                      "truncated": False, "policy_version": 0, "next_obs": np.ones(4, np.float32)})
    store.export(str(tmp_path / "data"), format="parquet")
    store.close()
    assert main(["inspect", str(tmp_path / "data" / "part-0.parquet")]) == 0
    out = capsys.readouterr().out
    assert "size 10 of 10 rows" in out and "next_obs" in out and "episodes: 1 (1 complete)" in out


def test_inspect_a_missing_path_says_no_such_file(tmp_path, capsys):
    """A path that does not exist is not read as a shared-memory store name (a new user's report)."""
    for target in (str(tmp_path / "nothere") + "/", "run/ckpt", "experience.arrow"):
        assert main(["inspect", target]) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert "no such file or directory" in line and "shared store name" not in line, line


def test_inspect_into_a_closed_pipe_prints_no_traceback(tmp_path):
    path = tmp_path / "experience.arrow"
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=10)
    store.extend({"obs": np.zeros((3, 4), np.float32), "action": np.zeros(3, np.int64),
                  "reward": np.ones(3, np.float32), "terminated": np.array([False, False, True]),
                  "truncated": np.zeros(3, bool), "policy_version": np.zeros(3, np.int64),
                  "next_obs": np.zeros((3, 4), np.float32)})
    table = store.to_table()
    store.close()
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    read, write = os.pipe()
    os.close(read)  # as `| head` that has already left: every write to stdout fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "arrowbuf.cli", "inspect", str(path)], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode != 0


def test_from_dataset_of_an_export_with_an_open_episode(tmp_path):
    """The README's persistence block: an export whose last episode is open has null next_obs rows; Parquet writes
    their tensor values as nulls too, and reading them back must keep the dtype (it became float64 NaN)."""
    store = ab.ExperienceStore(ab.load_schema("atari"), capacity=100)
    n = 6
    store.extend({"obs": np.zeros((n, 4, 84, 84), np.uint8), "action": np.arange(n) % 4,
                  "reward": np.ones(n, np.float32), "terminated": np.arange(n) == 2, "truncated": np.zeros(n, bool),
                  "next_obs": np.ones((n, 4, 84, 84), np.uint8)})  # the second episode (3 rows) is still open
    store.export(str(tmp_path / "data"), format="parquet")
    store.close()
    offline = ab.ExperienceStore.from_dataset(str(tmp_path / "data"), capacity=100)
    try:
        assert len(offline) == n
        assert offline.to_table().column("obs").type == store.schema.to_arrow().field("obs").type
    finally:
        offline.close()
