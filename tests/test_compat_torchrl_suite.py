"""TorchRL's own replay-buffer tests with ArrowbufStorage added to their storage parametrizations
(tests/compat/torchrl_suite: vendored, MIT, generated at run time; nothing is fetched): every ArrowbufStorage test
passes wherever its LazyTensorStorage twin passes, except EXPECTED_FAILURES (also in docs/integrations.md)."""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import sys
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

SUITE = pathlib.Path(__file__).resolve().parent / "compat" / "torchrl_suite"

#: test (its id with ArrowbufStorage) -> why it cannot pass; each raises a clear error or asserts a detail of
#: LazyTensorStorage's implementation
EXPECTED_FAILURES = {
    "rb/test_storages.py::TestLazyStorages::test_init[ArrowbufStorage-shape0-1000]":
        "asserts LazyTensorStorage's private preallocated TensorDict (`_init`, `_storage.shape`)",
    "rb/test_storages.py::TestLazyStorages::test_init_tensorclass[ArrowbufStorage-shape0-1000]":
        "asserts LazyTensorStorage's private preallocated TensorDict (`_init`, `_storage.shape`)",
    "rb/test_storages.py::TestLazyStorages::test_set[ArrowbufStorage-shape0-1000]":
        "asserts LazyTensorStorage's private preallocated TensorDict (`_storage.shape`)",
    "rb/test_storages.py::TestLazyStorages::test_set_tensorclass[ArrowbufStorage-shape0-1000]":
        "asserts LazyTensorStorage's private preallocated TensorDict (`_storage.shape`)",
    "rb/test_storages.py::TestStorages::test_extend_lazystack[ArrowbufStorage]":
        "a ragged lazy stack (entries of different shapes): arrowbuf columns are fixed-shape; raises SchemaError",
    "rb/test_storages.py::TestStorages::test_extend_lazystack_direct_write[ArrowbufStorage]":
        "asserts that LazyTensorStorage writes a lazy stack with `update_at_` (a mock of its internals)",
    "rb/test_storages.py::TestStorages::test_storage_dumps_loads[False-pytree-ArrowbufStorage-device_data0]":
        "asserts LazyTensorStorage's refusal to load a pytree checkpoint into an unwritten storage; "
        "ArrowbufStorage loads it",
    "rb/test_storages.py::TestStorages::test_storage_dumps_loads[False-tensor-ArrowbufStorage-device_data0]":
        "asserts LazyTensorStorage's refusal to load a tensor checkpoint into an unwritten storage; "
        "ArrowbufStorage loads it",
    "rb/test_storages.py::TestStorages::test_storage_inplace_writing_ndim[ArrowbufStorage]":
        "`rb[i, j] = x` writes into the view `rb[:]` returns; ArrowbufStorage's reads are copies, so it raises "
        "NotImplementedError (write `rb.storage[i, j] = x`)",
    "rb/test_storages.py::TestStorages::test_storage_inplace_writing_newkey[ArrowbufStorage-None]":
        "a key added by an in-place write after the first write (schema evolution): raises SchemaError",
}


def _run_module() -> Any:
    spec = importlib.util.spec_from_file_location("torchrl_suite_run", SUITE / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: the suite in shards (each test with its twin) that run side by side under pytest-xdist, each shard one pytest
#: process over every file: a process pays about 8 s of imports and collection, so few shards (two workers here)
FILES = ["test_composable.py", "test_ensemble.py", "test_rb_core.py", "test_storage_map.py", "test_storages.py"]
SHARDS = 2
PARTS = [(FILES, (i, SHARDS)) for i in range(SHARDS)]


def _in_part(nodeid: str, files: list[str], shard: tuple[int, int] | None) -> bool:
    sys.path.insert(0, str(SUITE))
    try:
        from report_plugin import shard_of  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SUITE))
    in_files = nodeid.split("::")[0].removeprefix("rb/") in files
    return in_files and (shard is None or shard_of(nodeid, shard[1]) == shard[0])


@pytest.mark.slow
@pytest.mark.parametrize(("files", "shard"), PARTS, ids=[f"shard{s[0]}" for _, s in PARTS])
def test_torchrl_replay_buffer_suite_passes_where_lazy_tensor_storage_passes(
        tmp_path: pathlib.Path, files: list[str], shard: tuple[int, int] | None) -> None:
    run = _run_module()
    # with arrowbuf's sum trees standing in for TorchRL's C++ ones (which do not load against torch 2.13), the
    # prioritized tests run too. Every ArrowbufStorage test runs; of the LazyTensorStorage twins only those of its
    # failures (a regression is a failure whose twin passes: the twins of passing tests decide nothing)
    records = run.run(tmp_path / "suite", files=files, timeout=120.0, file_timeout=3000.0, sum_trees=True,
                      shard=shard, twins="failed")
    counts = run.counts(records)
    print({k: dict(v) for k, v in counts.items()})
    assert counts[run.OURS]["passed"] > 0, counts  # the part ran
    failed = {r["twin"] for r in records if r["storage"] == run.OURS and r["outcome"] in ("failed", "timeout")}
    assert {r["nodeid"] for r in records if r["storage"] == run.PEER} == failed  # each failure's twin ran
    assert counts[run.OURS]["timeout"] == 0, [r["nodeid"] for r in records if r["outcome"] == "timeout"]
    got = run.regressions(records)
    unexpected = {k: v for k, v in got.items() if k not in EXPECTED_FAILURES}
    assert not unexpected, "\n".join(f"{k}: {v}" for k, v in sorted(unexpected.items()))
    fixed = sorted(k for k in set(EXPECTED_FAILURES) - set(got) if _in_part(k, files, shard))
    assert not fixed, f"expected failures that now pass (remove them here and in docs/integrations.md): {fixed}"


def test_expected_failures_are_few_and_documented() -> None:
    assert len(EXPECTED_FAILURES) <= 20
    docs = (SUITE.parent.parent.parent / "docs" / "integrations.md").read_text()
    for nodeid in EXPECTED_FAILURES:
        name = nodeid.split("::")[-1].split("[")[0]
        assert name in docs, f"{name} is not in docs/integrations.md's expected-failure list"


def test_generated_suite_only_adds_arrowbuf_storage(tmp_path: pathlib.Path) -> None:
    sys.path.insert(0, str(SUITE))
    try:
        from generate import UPSTREAM, generate  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SUITE))
    added = generate(tmp_path / "gen")
    assert added == {"test_composable.py": 9, "test_ensemble.py": 4, "test_rb_core.py": 3, "test_storage_map.py": 1,
                     "test_storages.py": 11}
    for name in added:
        before = (UPSTREAM / "rb" / name).read_text().splitlines()
        after = (tmp_path / "gen" / "rb" / name).read_text().splitlines()
        ops = difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes()
        for tag, i1, i2, j1, j2 in ops:
            if tag == "equal":
                continue
            if tag == "insert":  # the import (and a blank line before it)
                assert all("ArrowbufStorage" in x or x == "" for x in after[j1:j2]), after[j1:j2]
                continue
            assert tag == "replace" and i2 - i1 == j2 - j1, (tag, before[i1:i2], after[j1:j2])
            for old, new in zip(before[i1:i2], after[j1:j2]):
                # `new` is `old` with one inserted piece, a copy of a value that names ArrowbufStorage
                k = len(new) - len(old)
                assert any(new[:n] + new[n + k:] == old and "ArrowbufStorage" in new[n:n + k]
                           for n in range(len(old) + 1)), (old, new)


def _conftest_file(q: Any) -> None:
    import conftest

    q.put(conftest.__file__)


def test_loading_the_runner_leaves_what_spawned_processes_import_alone() -> None:
    """run.py once put its folder (with the TorchRL suite's conftest.py) first on sys.path: every process the project's
    suite spawned afterwards imported that conftest, and 20 multi-process tests failed after this file ran."""
    import multiprocessing as mp

    _run_module()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_conftest_file, args=(q,))
    p.start()
    try:
        got = q.get(timeout=120)
    finally:
        p.join(60)
    assert pathlib.Path(got).resolve() == pathlib.Path(__file__).resolve().parent / "conftest.py", got
