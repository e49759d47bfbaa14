"""No snippet can rot: every code block of README.md and docs/*.md is marked (scripts/docs_blocks.py) and runs, the
docstring examples run, and (slow) a wheel installed into a fresh venv outside the repository runs the README and
docs blocks, every example and every demo's --help from a temporary directory, as a new user would (issue 30)."""

import doctest
import fcntl
import importlib
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, install_into_fresh_venv

sys.path.insert(0, str(ROOT / "scripts"))
import docs_blocks  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = {  # small flags: the examples' own checks run, in seconds
    "local_replay.py": ["--steps", "500"],
    "flight_actor_learner.py": ["--steps", "200", "--batches", "5"],
    "shared_memory_actors.py": ["--steps", "200", "--batches", "5"],
    "inspect_buffer.py": ["--steps", "800"],
    "llm_tokens.py": [],
}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_block_says_what_it_is(path):
    for b in docs_blocks.extract(str(path)):  # a bare fence or a reasonless skip raises
        assert b.lang in docs_blocks.RUN or b.lang in docs_blocks.TEXT, f"{path}:{b.line}: {b.lang!r}"


def test_the_readme_blocks_run_from_a_temporary_directory(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("duckdb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_blocks.py"), str(ROOT / "README.md")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def _modules_with_examples():
    for path in sorted((ROOT / "arrowbuf").rglob("*.py")):
        if ">>> " in path.read_text():
            yield ".".join(path.relative_to(ROOT).with_suffix("").parts)


@pytest.mark.parametrize("module", list(_modules_with_examples()))
def test_docstring_examples_run(module):
    mod = importlib.import_module(module)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(mod, module) if t.examples]
    assert tests
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module} failed (output above)"


# ---------------------------------------------------------------------------------------------- from a wheel
WHEEL_EXTRAS = "query,demo,compat,metrics"
#: the tests of `wheel_venv` run on one pytest-xdist worker: the venv is built once and no worker waits for it
WHEEL_GROUP = pytest.mark.xdist_group("wheel_venv")


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory, arrowbuf_wheel):
    """The session's wheel of this tree (conftest.arrowbuf_wheel) with [query,demo,compat,metrics] (torch pinned)
    installed into a fresh venv outside the repository (`install_into_fresh_venv`: by uv where the dev extra brought
    it, which resolves as pip does and links the packages' files from its cache: pip unpacking torch, pandas, ... again
    was 25-45 s of CPU in a loaded run; else pip). One venv for the whole session: the pytest-xdist workers share it
    (the first to need it builds it under a lock in the session's shared temporary root), and the tests only read it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    tmp = shared / "wheel-venv"
    # what the tests import is compiled on first import, and its .pyc written into the venv (PYTHONDONTWRITEBYTECODE
    # dropped) for the later processes
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")}
    py = tmp / "venv" / "bin" / "python"
    with open(shared / "wheel-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this worker dies)
        if not (tmp / "ready").exists():
            shutil.rmtree(tmp, ignore_errors=True)  # a build a dead worker left half done
            tmp.mkdir()
            r = install_into_fresh_venv(tmp / "venv", [f"{arrowbuf_wheel}[{WHEEL_EXTRAS}]", "torch==2.13.0"], env,
                                        1200)
            assert r.returncode == 0, r.stderr[-4000:]
            (tmp / "run").mkdir()
            (tmp / "ready").touch()
    run_dir = tmp / "run"
    where = subprocess.run([py, "-c", "import arrowbuf; print(arrowbuf.__file__)"], cwd=run_dir, env=env,
                           check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(tmp / "venv")), where
    return py, run_dir, env


@pytest.mark.slow
@WHEEL_GROUP
def test_wheel_runs_every_readme_and_docs_block(wheel_venv, tmp_path):
    py, _, env = wheel_venv
    r = subprocess.run([py, str(ROOT / "scripts" / "docs_blocks.py"), *map(str, DOCS)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


RAY_DOCS = [ROOT / "README.md", *(ROOT / "docs" / f for f in ("ray.md", "rllib.md", "integrations.md"))]


@pytest.mark.slow
@pytest.mark.own_ray_cluster
def test_wheel_with_the_ray_extra_runs_the_ray_blocks(arrowbuf_wheel, tmp_path):
    """The blocks marked `ray` (a ShardedStore, the Ray actors example, RLlib's DQN with the arrowbuf buffer) run
    against the wheel with its [ray] extra, each file's local Ray cluster shut down after it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")}
    # a venv of its own (wheel_venv is shared and only read), installed by uv (`install_into`): Ray and RLlib
    # unpacked again by pip cost 30-60 s of CPU in a loaded run
    r = install_into_fresh_venv(tmp_path / "venv", [f"{arrowbuf_wheel}[{WHEEL_EXTRAS},ray]", "torch==2.13.0"], env,
                                1200)
    assert r.returncode == 0, r.stderr[-4000:]
    py = tmp_path / "venv" / "bin" / "python"
    listed = subprocess.run([py, str(ROOT / "scripts" / "docs_blocks.py"), "--list", *map(str, RAY_DOCS)],
                            env=env, check=True, capture_output=True, text=True).stdout
    assert listed.count(" ray: ") >= 4, listed
    # a cluster of its own, never the test session's: a bare ray.init() joins any cluster running on the machine (the
    # session's, on another pytest-xdist worker); RAY_ADDRESS=local makes it start one
    env = {**env, "RAY_ADDRESS": "local"}
    r = subprocess.run([py, str(ROOT / "scripts" / "docs_blocks.py"), "--ray", *map(str, RAY_DOCS)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.slow
@WHEEL_GROUP
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_wheel_runs_every_example_from_anywhere(wheel_venv, tmp_path, name):
    py, _, env = wheel_venv
    shutil.copy(ROOT / "examples" / name, tmp_path / name)  # a copy, elsewhere: no repository path can help
    r = subprocess.run([py, name, *EXAMPLES[name], "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@WHEEL_GROUP
def test_wheel_demos_help_lists_every_demo(wheel_venv):
    py, run_dir, env = wheel_venv
    for cmd in ([py, "-m", "arrowbuf.demo", "--help"], [str(py.parent / "arrowbuf"), "demo", "--help"]):
        out = subprocess.run(cmd, cwd=run_dir, env=env, check=True, capture_output=True, text=True).stdout
        for demo in ("dqn", "grpo", "ray"):
            assert f"  {demo} " in out, out
    for demo in ("grpo", "ray"):
        out = subprocess.run([str(py.parent / "arrowbuf"), "demo", demo, "--help"], cwd=run_dir, env=env,
                             check=True, capture_output=True, text=True).stdout
        assert f"arrowbuf demo {demo}" in out
