"""Progress a person can see (issue 44): the display (`arrowbuf.observe.meter`: a bar on a terminal, a line every few
seconds elsewhere, alive while the work is silent), the progress that restore, the journal's replay, export, verify
and from_dataset report, and the long CLI commands (`arrowbuf checkpoint verify|export`, `arrowbuf inspect` of a
durable directory, `arrowbuf bench`) printing it on stderr while stdout keeps their output."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest
from conftest import ROOT, SMALL, make_episodes

import arrowbuf as ab
from arrowbuf import config
from arrowbuf.cli import main
from arrowbuf.observe.meter import PhasedProgress, ProgressMeter
from arrowbuf.persist import verify


class Recorder:
    """A `ProgressSink` that keeps every report: {phase: [(done, total, unit), ...]}."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, int | None, str]]] = {}

    def __call__(self, phase: str, done: int, total: int | None, unit: str = "") -> None:
        self.calls.setdefault(phase, []).append((done, total, unit))

    def check(self, phase: str, unit: str) -> list[int]:
        """The phase's reports rise from 0 to its total, in `unit`; returns the amounts."""
        got = self.calls[phase]
        done = [d for d, _, _ in got]
        assert done[0] == 0 and done == sorted(done), got
        assert {u for _, _, u in got} == {unit}
        total = got[-1][1]
        if total is not None:
            assert done[-1] == total > 0, got
        return done


# ------------------------------------------------------------------ the display
def test_off_a_terminal_a_line_comes_every_interval_while_the_work_is_silent():
    out = io.StringIO()  # not a terminal
    with ProgressMeter(10, "work", "step", file=out, interval=0.25) as meter:
        meter.update(3, phase="copying")
        threading.Event().wait(1.2)  # the work says nothing for a while (a long write, workers starting)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3, lines  # lines kept coming, then the last one at close
    assert re.match(r"work: 3/10 steps \(30%\), [\d.]+ steps/s, 0:0\d elapsed, ~0:\d\d left \| phase=copying$",
                    lines[0]), lines[0]
    assert "left" not in lines[-1]


def test_work_shorter_than_the_interval_prints_nothing():
    out = io.StringIO()
    with ProgressMeter(100, "quick", "row", file=out, interval=30) as meter:
        meter.update_to(100)
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar_with_rate_and_time_left():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    with ProgressMeter(8, "demo", "step", file=out, bar=True) as meter:  # bar=True: as on a terminal
        for i in range(8):
            meter.update(1, reward=f"{i / 8:.2f}")
    text = out.getvalue()
    assert "demo: 100%|" in text and "8/8" in text and "step/s" in text and "reward=0.88" in text
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", text)  # elapsed < time left


def test_slow_units_read_as_seconds_each_and_bytes_scale():
    meter = ProgressMeter(4, "benchmarks", "benchmark", file=io.StringIO(), interval=1e9)
    try:
        meter.start -= 100.0  # as if started 100 s ago
        meter.update_to(2)
        assert re.search(r"2/4 benchmarks \(50%\), 5\d\.\d s/benchmark, 1:40 elapsed, ~1:4\d left", meter.line())
    finally:
        meter.close()
    meter = ProgressMeter(3 << 30, "verify", "B", file=io.StringIO(), interval=1e9)
    try:
        meter.update_to(1 << 30)
        assert meter.line().startswith("verify: 1.0 GiB/3.0 GiB (33%)")
    finally:
        meter.close()


# ------------------------------------------------------------------ what the library reports
def _durable(tmp_path) -> str:
    store = ab.ExperienceStore(SMALL, capacity=5000, durable=str(tmp_path / "run"), chunk_rows=64)
    store.extend(make_episodes([100, 200, 150], seed=0)[0])
    store.checkpoint()
    for k in range(3):  # after the checkpoint: only in the journal
        store.extend(make_episodes([60], seed=k + 1, start=1e6 * (k + 1))[0])
    store.close()
    return str(tmp_path / "run")


def test_restore_reports_its_row_files_and_the_journal(tmp_path):
    run = _durable(tmp_path)
    rec = Recorder()
    with ab.ExperienceStore.restore(run, progress=rec) as store:
        assert len(store) == 450 + 180
    assert list(rec.calls) == ["restore", "journal: read", "journal: replay"]
    rec.check("restore", "B")
    rec.check("journal: read", "B")
    assert rec.check("journal: replay", "record")[-1] >= 3


def test_export_verify_and_from_dataset_report_progress(tmp_path):
    rec = Recorder()
    with ab.ExperienceStore(SMALL, capacity=5000, chunk_rows=64) as store:
        store.extend(make_episodes([100, 200, 150], seed=0)[0])
        store.checkpoint(tmp_path / "ckpt")
        store.export(tmp_path / "data", progress=rec)
    assert rec.check("export: write", "row")[-1] == 450
    rec.check("export: copy", "row")
    assert verify(str(tmp_path / "ckpt"), progress=rec) == []
    rec.check("verify", "B")
    with ab.ExperienceStore.from_dataset(tmp_path / "data", progress=rec) as offline:
        assert len(offline) == 450
    assert rec.check("load dataset", "row")[-1] == 450


def test_phased_progress_shows_each_phase_as_its_own_meter():
    out = io.StringIO()
    with PhasedProgress("arrowbuf x: ", file=out, interval=0) as sink:
        sink("restore", 0, 10, "B")
        sink("restore", 10, 10, "B")
        sink("journal: replay", 0, 2, "record")
        sink("journal: replay", 2, 2, "record")
    text = out.getvalue()
    assert "arrowbuf x: restore: 10 B/10 B (100%)" in text
    assert "arrowbuf x: journal: replay: 2/2 records (100%)" in text


# ------------------------------------------------------------------ the long CLI commands
def test_long_cli_commands_print_progress_on_stderr(tmp_path, capsys):
    run = _durable(tmp_path)
    with ab.ExperienceStore(SMALL, capacity=5000, chunk_rows=64) as store:
        store.extend(make_episodes([100, 200, 150], seed=0)[0])
        store.checkpoint(tmp_path / "ckpt")
    with config.override(ARROWBUF_PROGRESS_INTERVAL=0.0):  # a line per report: no waiting for a long enough run
        capsys.readouterr()
        assert main(["checkpoint", "verify", str(tmp_path / "ckpt")]) == 0
        out, err = capsys.readouterr()
        assert "generation 1: ok" in out and "verify" not in out.replace("generation 1: ok", "")
        assert re.search(r"arrowbuf checkpoint verify: generation 1: verify: .* \(100%\)", err), err

        assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
        out, err = capsys.readouterr()
        assert "exported 450 rows" in out and "(100%)" not in out
        assert re.search(r"arrowbuf checkpoint export: restore: .*\(100%\)", err), err
        assert re.search(r"arrowbuf checkpoint export: export: write: 450/450 rows \(100%\)", err), err

        assert main(["inspect", run]) == 0  # a durable directory: its checkpoint, then its journal
        out, err = capsys.readouterr()
        assert "size 630 of 5,000 rows" in out and "journal" not in out
        assert re.search(r"arrowbuf inspect: journal: replay: \d+/\d+ records \(100%\)", err), err


def test_bench_prints_progress_over_the_benchmarks(tmp_path, monkeypatch, capsys):
    """`arrowbuf bench` runs `python -m benchmarks`: it says which benchmark runs and how many are done."""
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.__main__ as runner
    finally:
        sys.path.remove(str(ROOT))
    fake = tmp_path / "benchmarks"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "bench_fake.py").write_text("print('| bench | rows/s |')\n")
    monkeypatch.setattr(runner, "ROOT", tmp_path)  # RESULTS.md goes there, not into the checkout
    monkeypatch.setattr(runner, "BENCHMARKS", {"fake": ("benchmarks.bench_fake", [], "a fake benchmark")})
    with config.override(ARROWBUF_PROGRESS_INTERVAL=0.0):
        assert runner.main(["--only", "fake"]) == 0
    out, err = capsys.readouterr()
    assert "| bench | rows/s |" in out
    assert re.search(r"benchmarks: 1/1 benchmarks \(100%\)", err), err
    assert (tmp_path / "benchmarks" / "RESULTS.md").exists()


def test_import_arrowbuf_does_not_import_tqdm():
    import subprocess

    code = "import sys, arrowbuf, arrowbuf.observe.meter; print('tqdm' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.stdout.strip() == "False"
