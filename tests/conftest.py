"""Shared helpers: small schemas and reference episodes generated from plain numpy."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.tiers import shm

#: TorchRL's vendored replay-buffer suite (tests/compat/torchrl_suite/) has a conftest of its own and is run by
#: tests/test_compat_torchrl_suite.py in a process of its own, never collected with this suite.
collect_ignore = ["compat"]


ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "schemas"

SMALL = {
    "name": "small",
    "fields": {
        "obs": {"dtype": "float32", "shape": [3]},
        "action": {"dtype": "int64"},
        "reward": {"dtype": "float32"},
        "terminated": {"dtype": "bool"},
        "truncated": {"dtype": "bool"},
    },
    "derived": {"next_obs": {"next_of": "obs"}},
}


#: What the server of `process_context()` imports once, before it forks any process a test starts.
_FORKSERVER_PRELOAD = ["numpy", "pyarrow", "arrowbuf", "pytest", "hypothesis", "conftest"]


def process_context() -> Any:
    """multiprocessing's context for the processes a test starts (writers, consumers, holders to kill): forkserver,
    its server having imported numpy, pyarrow, arrowbuf, pytest and hypothesis once. Each process is forked from
    that server, so it is as fresh as a spawned one (not a fork of the test's process, its threads and locks) but does
    not import them again: a spawned child took 0.5-0.8 CPU-s to start, on two cores where the suite is CPU-bound.
    Unlike spawn, a child sees the environment the server started with, not `os.environ` at its start: a test that
    sets variables for its children (ARROWBUF_SHM_DIR, say) uses `mp.get_context("spawn")`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # (read when the server starts: at the first process)
    return ctx


#: Rows that `rows()` writes: each row's columns encode (writer, step), so a torn or partial row shows on its own
#: (test_shm, persist/test_persist_process; their spawned children import it from here too).
ROWS_SCHEMA = {
    "name": "rows",
    "fields": {
        "obs": {"dtype": "float32", "shape": [4]},
        "action": {"dtype": "int64"},
        "reward": {"dtype": "float32"},
        "terminated": {"dtype": "bool"},
        "truncated": {"dtype": "bool"},
    },
    "derived": {"next_obs": {"next_of": "obs"}},
}
EPISODE = 50


def rows(writer: int, k0: int, n: int) -> dict[str, np.ndarray]:
    """Steps k0..k0+n-1 of `writer` (ROWS_SCHEMA): every column encodes (writer, k), so a row can be checked on its
    own; an episode ends every EPISODE steps."""
    k = np.arange(k0, k0 + n)
    enc = lambda kk: np.stack([np.full(len(kk), writer), kk, kk + 1, np.full(len(kk), 7)], 1).astype(np.float32)  # noqa: E731
    return {"obs": enc(k), "action": k.astype(np.int64), "reward": (writer * 1e6 + k).astype(np.float32),
            "terminated": (k % EPISODE) == EPISODE - 1, "truncated": np.zeros(n, bool), "next_obs": enc(k + 1)}


@pytest.fixture
def small_schema() -> ab.ExperienceSchema:
    return ab.load_schema(SMALL)


def make_episodes(lengths, seed=0, obs_dim=3, start=0.0):
    """Steps of consecutive episodes: obs row i encodes (global step index); next_obs exact.

    Returns (batch dict, reference dict with per-row next_obs and episode number).
    """
    rng = np.random.default_rng(seed)
    obs, nxt, act, rew, term, trunc, epno = [], [], [], [], [], [], []
    g = start
    for e, n in enumerate(lengths):
        o = g + np.arange(n + 1, dtype=np.float32)[:, None] + np.zeros((1, obs_dim), np.float32)
        obs.append(o[:-1])
        nxt.append(o[1:])
        act.append(rng.integers(0, 4, n))
        rew.append(rng.normal(size=n).astype(np.float32))
        t = np.zeros(n, bool)
        tr = np.zeros(n, bool)
        if rng.random() < 0.5:
            t[-1] = True
        else:
            tr[-1] = True
        term.append(t)
        trunc.append(tr)
        epno.append(np.full(n, e))
        g += n + 1000
    batch = {
        "obs": np.concatenate(obs), "action": np.concatenate(act), "reward": np.concatenate(rew),
        "terminated": np.concatenate(term), "truncated": np.concatenate(trunc), "next_obs": np.concatenate(nxt),
    }
    return batch, {"episode": np.concatenate(epno)}


def store_snapshot(store: ab.ExperienceStore):
    """Everything observable about a store's contents and episode state."""
    t = store.to_table()
    return (len(store), t.to_pydict() if t.num_rows < 5000 else t.num_rows, store.stats()["next_seq"],
            {k: (v.episode_id, v.step, v.pending_seq) for k, v in store._episodes.streams.items()},
            store._episodes.next_episode_id)


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test (scipy when present, else Wilson-Hilferty)."""
    observed = np.asarray(observed, float)
    expected = np.asarray(expected, float)
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, df))
    except ImportError:
        import math

        z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    import threading

    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"test leaked threads: {leaked}"


@pytest.fixture(autouse=True)
def _no_sys_path_change():
    """A test leaves sys.path as it found it: processes the suite starts with multiprocessing's spawn inherit it, and a
    folder put first (one with a conftest.py of its own, say) changes what every later such process imports."""
    before = list(sys.path)
    yield
    # what libraries add for themselves (Ray its vendored packages under site-packages) is theirs to keep
    changed = [p for p in set(sys.path) ^ set(before)
               if os.path.isabs(p) and not p.startswith(sys.prefix + os.sep)]
    if changed:
        sys.path[:] = before
    assert not changed, f"the test changed sys.path: {sorted(changed)}"


os.environ.setdefault("ARROWBUF_TEST", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per native pool in each worker and what it starts (read when torch, OpenMP and BLAS load): two
    # workers on two cores each spinning a pool of two made a torch test 10x slower (285 s for DQN on CartPole)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


# ------------------------------------------------------------------------------------------ local Ray clusters
def _raylet_of(pid: int) -> int | None:
    """The raylet a Ray worker was started by (its environment's RAY_RAYLET_PID), None if unknown."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for var in env:
        if var.startswith(b"RAY_RAYLET_PID="):
            return int(var.split(b"=", 1)[1])
    return None


def _ray_pids(raylets: frozenset[int] | set[int] = frozenset()) -> set[int]:
    """Pids below this process (from /proc), and Ray workers orphaned by a dead raylet of `raylets` (ours); not
    another cluster's (other test runs on this machine start and stop their own clusters meanwhile)."""
    parents: dict[int, int] = {}
    ray_procs = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"ray::" in cmd or b"default_worker.py" in cmd or b"raylet" in cmd or b"gcs_server" in cmd:
            ray_procs.add(int(d))
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    # a Ray worker whose raylet died is re-parented (to init or a subreaper): count those orphans too, but only those
    # of our raylets, not the workers of another Ray cluster on the machine
    return out | {p for p in ray_procs if (parents.get(p) == 1 or parents.get(p) not in parents)
                  and _raylet_of(p) in raylets}


def _raylets_below() -> set[int]:
    """The raylets among this process's descendants."""
    out = set()
    for p in _ray_pids():
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"raylet" in f.read().split(b"\0")[0]:
                    out.add(p)
        except OSError:
            continue
    return out


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")[:200].decode(errors="replace").strip()
        return f"{pid} {cmd}"
    except OSError:
        return f"{pid} (gone)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def local_ray_cluster(nodes: int) -> Iterator[Any]:
    """A local multi-node Ray cluster (`ray.cluster_utils.Cluster`, 1 CPU per node) with this process connected;
    on exit it shuts down and asserts that none of its processes outlives it."""
    import ray
    from ray.cluster_utils import Cluster

    before = _ray_pids()
    raylets: set[int] = set()  # every raylet of this cluster, also of nodes added and removed by a test
    # what no test reads, not started or made rarer (each cost CPU all through a run, beside the tests: the log
    # monitor ~10 CPU-s, the three nodes' dashboard agents ~18 CPU-s, mostly their stats every 5 s): worker logs are
    # not sent to the driver (log_to_driver=False), the autoscaler's monitor has nothing to scale
    quiet = {"include_log_monitor": False, "no_monitor": True}
    reporter = os.environ.get("REPORTER_UPDATE_INTERVAL_MS")
    os.environ["REPORTER_UPDATE_INTERVAL_MS"] = "60000"  # read by each dashboard agent as it starts
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20,
                                                      "include_dashboard": False, **quiet})
    add_node = c.add_node

    def add_and_note(*args: Any, **kw: Any) -> Any:
        node = add_node(*args, **{"include_log_monitor": False, **kw})
        raylets.update(_raylets_below())
        return node

    c.add_node = add_and_note  # type: ignore[method-assign]
    try:
        raylets.update(_raylets_below())
        for _ in range(nodes - 1):
            c.add_node(num_cpus=1, object_store_memory=80 << 20)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        yield c
    finally:
        if reporter is None:
            os.environ.pop("REPORTER_UPDATE_INTERVAL_MS", None)
        else:
            os.environ["REPORTER_UPDATE_INTERVAL_MS"] = reporter
        raylets.update(_raylets_below())
        # multiprocessing's resource tracker and the forkserver of `process_context` live as long as this process,
        # whichever test started them first: not waited for (the wait below used to run out its 60 s on them at the
        # session's end)
        started = {p for p in _ray_pids(raylets) - before
                   if not any(m in _describe(p) for m in ("multiprocessing.resource_tracker",
                                                           "multiprocessing.forkserver"))}
        ray.shutdown()
        c.shutdown()
        end = time.monotonic() + 60  # a bounded wait for shutdown on a loaded machine, not a timing assert
        while time.monotonic() < end and any(_alive(p) for p in started):
            time.sleep(0.1)  # teardown only: waiting for the OS to reap Ray's processes
        left = [_describe(p) for p in started if _alive(p)]
        assert not left, f"processes left behind by the Ray cluster: {left}"


#: the nodes of the session's Ray cluster (1 CPU each): enough for the multi-node tests (shards and broadcast relays
#: on different nodes), few enough to start in seconds on a 2-core machine
RAY_NODES = 3


@pytest.fixture(scope="session")
def arrowbuf_wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A wheel of this tree, built once per test session (from a clean copy of the tracked and new files, links
    kept: arrowbuf/schemas links to schemas/, as scripts/wheel_demo.sh copies it: no stale build output can reach
    it). Tests that install arrowbuf into a fresh venv (test_docs_blocks, test_extras) share it."""
    tmp = tmp_path_factory.mktemp("wheel-build")
    src = tmp / "src"
    src.mkdir()
    subprocess.run(f"git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -C '{src}' -xf -",
                   shell=True, cwd=ROOT, check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                   check=True, env=env, timeout=600)
    return next((tmp / "dist").glob("arrowbuf-*.whl"))


def _uv() -> pathlib.Path | None:
    uv = pathlib.Path(sys.executable).parent / "uv"
    return uv if uv.exists() else None


def install_into(python: pathlib.Path, requirements: list[str], env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess[str]:
    """`requirements` (and their dependencies, from PyPI where they are not cached) installed into the venv of
    `python`, for tests that check what an install of the wheel gives (test_extras, test_docs_blocks' [ray] blocks).

    uv when the test venv has it (the dev extra does): it resolves as pip does, but links each package's files from
    its cache instead of unpacking it again, so the second venv with torch or Ray costs about a second, not 20-60 s
    of CPU. It does not read pip's configuration, so pip's find-links (this machine's CPU build of torch) is passed
    on. Without uv: pip. Returns the install's completed process (the caller checks it)."""
    uv = _uv()
    if uv is None:
        return subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *requirements], env=env,
                              capture_output=True, text=True, timeout=timeout)
    links = [a for d in env.get("PIP_FIND_LINKS", "").split() for a in ("--find-links", d)]
    # --native-tls: the system's certificates, as pip's (a machine whose proxy re-signs PyPI's certificate: uv's own
    # roots refuse it, "invalid peer certificate: UnknownIssuer", where SSL_CERT_FILE is not set)
    return subprocess.run([str(uv), "pip", "install", "-q", "--native-tls", "--python", str(python), "--link-mode",
                           "hardlink", *links, *requirements], env=env, capture_output=True, text=True, timeout=timeout)


def install_into_fresh_venv(venv: pathlib.Path, requirements: list[str], env: dict[str, str],
                            timeout: float) -> subprocess.CompletedProcess[str]:
    """A fresh venv at `venv` (by uv where the test venv has it, else `python -m venv`) with `requirements`
    installed (`install_into`)."""
    uv = _uv()
    if uv is None:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    else:
        subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env,
                       timeout=120)
    return install_into(venv / "bin" / "python", requirements, env, timeout)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster (`RAY_NODES` nodes of 1 CPU, no dashboard) for every Ray test of the session, started
    when the first test asks for it; this process stays connected. At the end of the session (also after failures)
    it shuts down and asserts that none of its processes is left. A test that adds a node removes it again."""
    pytest.importorskip("ray")
    with local_ray_cluster(RAY_NODES) as c:
        yield c


def _on_ray(item: pytest.Item) -> bool:
    return ("ray_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray") is not None
            or _own_cluster(item))


def _own_cluster(item: pytest.Item) -> bool:
    """A test that starts a Ray cluster of its own (a wheel's venv, TransferQueue's suite): never beside the
    session's cluster. Two clusters on this machine at once lost a node of the session's (its Ray tests then failed,
    TransferQueue's system start waited out its 300 s) or aborted a worker of the other."""
    return item.get_closest_marker("own_ray_cluster") is not None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group markers into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the session's Ray cluster run together (in their order): the cluster starts once. The tests that
    start a Ray cluster of their own (`own_ray_cluster`) run with them, first, so that two clusters never run at once.
    A test that asks for the cluster through `request.getfixturevalue` carries the `ray` marker instead. Without
    xdist they run last. Under pytest-xdist (`--dist loadgroup`, as scripts/test.sh runs the suite) they are one
    group, and xdist hands out the largest group first: one worker runs the whole Ray group from the start while the
    other takes the slow tests, then the quick ones (the order below), and the first to finish takes the rest."""
    for item in items:
        if _on_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the long tests first, then the quick ones; the Ray group is one unit of work, handed out first (the
        # largest), whatever its place here
        items.sort(key=lambda item: (_on_ray(item), not _own_cluster(item), item.get_closest_marker("slow") is None))
    else:  # the tests with a cluster of their own first among the Ray tests: before the session's cluster starts
        items.sort(key=lambda item: (_on_ray(item), not _own_cluster(item)))


@pytest.fixture
def servers():
    """Start Flight servers through `start(stores, **kw)` (as `ab.serve`); every one is closed at teardown, even when
    the test fails."""
    started: list = []

    def start(stores, **kw):
        kw.setdefault("shutdown_timeout", 1.0)
        server = ab.serve(stores, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


#: A GRPO-style schema: one row per completion, grouped by prompt, with a ragged token field.
LLM = {
    "name": "llm",
    "fields": {
        "prompt_id": {"dtype": "int64"},
        "response_tokens": {"dtype": "int32", "ragged": True},
        "reward": {"dtype": "float32"},
        "done": {"dtype": "bool"},
        "policy_version": {"dtype": "int64"},
    },
}


@pytest.fixture
def names():
    """A factory of unique store names; afterwards kills leftover children and removes every segment."""
    made: list[str] = []
    procs: list[mp.Process] = []

    def new() -> str:
        name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
        made.append(name)
        return name

    new.procs = procs  # type: ignore[attr-defined]
    try:
        yield new
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for name in made:
            shm.remove(name)
        left = [n for n in os.listdir(shm.shm_root()) if any(m in n for m in made)]
        assert not left, f"segments left in /dev/shm: {left}"


@pytest.fixture
def procs():
    """Subprocesses started through `spawn(...)` are killed at teardown."""
    started: list[subprocess.Popen] = []

    def spawn(args, **kw):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for pipe in (p.stdout, p.stderr, p.stdin):
            if pipe is not None:
                pipe.close()
