"""The `arrowbuf` command line.

    arrowbuf serve --schema atari --capacity 100000 --port 8815 [--token-file F] [--tls-cert C --tls-key K]
                   [--metrics 127.0.0.1:9100] [--ui 127.0.0.1:8800]
    arrowbuf ui grpc://127.0.0.1:8815 | <shm store name> | ckpt/ [--token-file F] [--address 127.0.0.1:8800]
    arrowbuf demo [dqn|grpo|ray] [--steps N ...]   (arrowbuf.demo; without a name: dqn)
    arrowbuf inspect grpc://127.0.0.1:8815 | <shm store name> | experience.arrow | ckpt/  [--sql "SELECT ..."]
    arrowbuf checkpoint ls|inspect|verify|export ckpt/ ...   (arrowbuf.cli.checkpoint)
    arrowbuf bench [--quick] [--only core sampling]
    arrowbuf shm ls | gc

Subcommands register themselves in `COMMANDS`: a function `add_<name>(subparsers)` that adds its parser and sets
`func`. `serve` is here; `demo`, `inspect` and `bench` have their places below. A subcommand that passes its remaining
arguments on (demo, bench) sets `extra=True` and reads them from `args.extra`.

A user's mistake (a bad path, a port in use, a closed pipe, Ctrl-C) ends in one line on stderr saying what was wrong
and what to do, never a traceback: `main` turns `ArrowbufError` and `OSError` into that line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ArrowbufError, InvalidArgument


# ---------------------------------------------------------------------------------------------------- serve
def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a new store over Arrow Flight",
                       description="Create a store from a schema and serve it over Arrow Flight until SIGINT/SIGTERM.")
    p.add_argument("--schema", required=True,
                   help="a shipped schema name (atari, cartpole, grpo, mujoco, tokens) or a YAML file path")
    p.add_argument("--capacity", type=int, required=True, help="rows the store holds")
    p.add_argument("--name", default=None, help="store name (default: the schema's name)")
    p.add_argument("--sampler", default="uniform", help="uniform (default) or fifo")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free port, printed on start)")
    p.add_argument("--token-file", default=None, help="file whose first line is the bearer token clients send "
                   "(required to bind beyond loopback)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="bind beyond loopback without a token anyway (anyone who reaches the port reads and writes)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (with --tls-key: serve grpc+tls)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--max-batch-rows", type=int, default=None, help="largest batch accepted or served")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="also serve Prometheus metrics at http://HOST:PORT/metrics (needs arrowbuf[metrics])")
    p.add_argument("--ui", default=None, metavar="HOST:PORT",
                   help="also serve the live web inspector at http://HOST:PORT/ (the server's token guards it)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from ..flight.server import DEFAULT_MAX_BATCH_ROWS, serve
    from ..schema import load_schema
    from ..store.facade import ExperienceStore

    if (args.tls_cert is None) != (args.tls_key is None):
        print("arrowbuf serve: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    token = None
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.readline().strip()
        if not token:
            print(f"arrowbuf serve: {args.token_file} is empty; put the token on its first line", file=sys.stderr)
            return 2
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    host = f"[{args.host}]" if ":" in args.host else args.host
    busy = _port_in_use(args.host, args.port)
    if busy:
        print(f"arrowbuf serve: cannot listen on {host}:{args.port}: {busy}; pick another --port, or --port 0 for a "
              "free one", file=sys.stderr)
        return 2
    schema = load_schema(args.schema)  # a SchemaError names the file and the shipped names (main prints it)
    store = ExperienceStore(schema, capacity=args.capacity, sampler=args.sampler, seed=args.seed, name=args.name)
    try:
        server = serve(store, f"grpc://{host}:{args.port}", token=token, tls=tls,
                       max_batch_rows=args.max_batch_rows or DEFAULT_MAX_BATCH_ROWS, metrics=args.metrics,
                       allow_unauthenticated=args.allow_unauthenticated)
    except InvalidArgument as exc:  # the bind policy (a token beyond loopback), a bad limit: its own message
        store.close()
        print(f"arrowbuf serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # pyarrow says only "Server did not start properly": name the address
        store.close()
        print(f"arrowbuf serve: the Flight server did not start on {host}:{args.port} ({exc}); is the port in use or "
              "the address not on this machine? Pick another --port (0: a free one) or --host", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    inspector = None
    if args.ui:
        from ..observe.ui import Inspector

        try:
            # the Flight server's gate: inspector queries and Flight's sql tickets share max_concurrent_sql
            inspector = Inspector(store, args.ui, token=token, sql_gate=server.calls)
        except Exception as exc:
            server.close()
            store.close()
            print(f"arrowbuf serve: the inspector did not start on {args.ui}: {exc}", file=sys.stderr)
            return 2
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with server:
            print(f"arrowbuf: serving store {store.name!r} at {server.location}", flush=True)
            if server.metrics_url:
                print(f"arrowbuf: metrics at {server.metrics_url}", flush=True)
            if inspector is not None:
                print(f"arrowbuf: inspector at {inspector.url}", flush=True)
            while not stop.wait(0.5):  # a short wait keeps the main thread responsive to signals
                pass
            print("arrowbuf: shutting down", flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if inspector is not None:
            inspector.close()
        store.close()
    if not server.stopped:  # --- hardening: close() cut the connections of stalled clients; a call still running
        # waits in the store (or /proc was missing), and a normal exit would wait for it
        print("arrowbuf: calls still open after the shutdown timeout; exiting without them", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0


def _port_in_use(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be bound (e.g. "address already in use"), or None when it can (or is 0)."""
    import errno
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a closed server's TIME_WAIT is no user
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the port is in use by another process"
            return exc.strerror or str(exc)
    return None


# ---------------------------------------------------------------------------------------------------- shm
def add_shm(sub: Any) -> None:
    p = sub.add_parser("shm", help="shared-memory stores on this node: list, reclaim",
                       description="Shared-memory stores (tier='shm') live in /dev/shm/arrowbuf.<name>/.")
    shm_sub = p.add_subparsers(dest="shm_command", metavar="shm_command")
    shm_sub.required = True
    gc = shm_sub.add_parser("gc", help="remove the stores whose owner process is dead, and the broadcast files "
                                       "nobody holds")
    gc.add_argument("--root", default=None, help="directory of the segments (default /dev/shm or $ARROWBUF_SHM_DIR)")
    gc.set_defaults(func=run_shm_gc)
    ls = shm_sub.add_parser("ls", help="list the stores: owner, attached processes, bytes")
    ls.add_argument("--root", default=None, help="directory of the segments (default /dev/shm or $ARROWBUF_SHM_DIR)")
    ls.set_defaults(func=run_shm_ls)


def run_shm_gc(args: argparse.Namespace) -> int:
    from ..tiers.shm import gc, private

    names = gc(args.root)
    print(f"arrowbuf shm gc: reclaimed {len(names)} store(s){': ' + ', '.join(names) if names else ''}")
    files = private.sweep(args.root)  # broadcast files whose holders died (arrowbuf.ray.Broadcast)
    print(f"arrowbuf shm gc: removed {len(files)} broadcast file(s){': ' + ', '.join(files) if files else ''}")
    return 0


def run_shm_ls(args: argparse.Namespace) -> int:
    from ..tiers.shm import list_stores

    print(f"{'name':<24} {'owner':>8} {'state':<7} {'MiB':>10}  attached")
    for s in list_stores(args.root):
        state = ("live" if s["alive"] else "stale") if s["sealed"] else "new"
        print(f"{s['name']:<24} {s['owner_pid'] or '?':>8} {state:<7} {s['bytes'] / 2**20:>10.1f}  "
              f"{' '.join(map(str, s['attached_pids']))}")
    return 0


# ---------------------------------------------------------------------------------------------------- demo
def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="the demos: dqn (default), grpo, ray; arrowbuf demo --help lists them",
                       description="The demos: arrowbuf demo [dqn|grpo|ray] [flags].", add_help=False)
    p.set_defaults(func=run_demo, extra=True)  # `arrowbuf demo [dqn|grpo|ray] ...`: the demo parses its own flags


def run_demo(args: argparse.Namespace) -> int:
    from ..demo.entry import dispatch

    return dispatch(args.extra_args, prog="arrowbuf demo")


# ---------------------------------------------------------------------------------------------------- inspect
def add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="schema, size, episode summary and column bytes of a store",
                       description="Inspect a store: a Flight location (grpc://host:port), the name of a shared-memory "
                                   "store on this node, or an Arrow IPC / Parquet file of experience.")
    p.add_argument("target", help="grpc://host:port, a shared-memory store name, a .arrow/.parquet file, or a "
                                  "checkpoint or dataset directory")
    p.add_argument("--token", default=None, help="bearer token for a Flight location")
    p.add_argument("--store", default=None, help="store name when a server serves several")
    p.add_argument("--sql", default=None, help="also run this query (the store is the table `experience`)")
    p.set_defaults(func=run_inspect)


def _open_target(args: argparse.Namespace) -> tuple[Any, str]:
    """A store-like object (stats, episodes, to_table, sql) for the target, and what it is."""
    import os

    target = args.target
    if "://" in target:
        from ..flight.client import connect

        return connect(target, token=args.token, store=args.store), f"Flight store at {target}"
    if os.path.isdir(target):  # a checkpoint or a dataset directory (arrowbuf.persist)
        from ..observe.meter import PhasedProgress
        from ..persist import manifest
        from ..store import ExperienceStore

        command = getattr(args, "command", "inspect")
        with PhasedProgress(f"arrowbuf {command}: ") as progress:  # restoring a large journal takes a while
            if os.path.exists(os.path.join(target, manifest.MANIFEST)):
                return (ExperienceStore.restore(target, progress=progress),
                        f"checkpoint {target} (restored into a temporary store)")
            return (ExperienceStore.from_dataset(target, progress=progress),
                    f"dataset {target} (loaded into a temporary store)")
    if os.path.exists(target):
        import pyarrow.parquet as pq

        from ..schema import load_schema
        from ..store.facade import ExperienceStore

        if target.endswith(".parquet"):
            table = pq.read_table(target)
        else:
            import pyarrow as pa

            with pa.memory_map(target) as source:
                try:
                    table = pa.ipc.open_file(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_stream(source).read_all()
        # a file holds every column as stored (an export writes next_obs too): nothing is derived when inspecting
        # it, so the schema's derived fields (metadata arrowbuf.derived) become plain stored fields
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"arrowbuf.derived"}
        spec = load_schema(table.schema.with_metadata(meta)).to_dict()
        spec.pop("derived", None)
        schema = load_schema(spec)
        store = ExperienceStore(schema, capacity=max(1, table.num_rows))
        inputs = [c for c in table.column_names if c in schema.fields or c in ("episode_id",)]
        if table.num_rows:
            store.extend(table.select(inputs))
        return store, f"file {target} (loaded into a temporary store)"
    if os.sep in target or target.endswith((".arrow", ".parquet", ".feather", ".ipc")):  # a path, not a name
        raise FileNotFoundError(f"no such file or directory {target!r} (a shared-memory store is named without "
                                "'/'; `arrowbuf shm ls` lists them)")
    from ..store.facade import ExperienceStore

    return ExperienceStore.attach(target), f"shared-memory store {target!r}"


def run_inspect(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError

    try:
        store, what = _open_target(args)
    except (ArrowbufError, OSError) as exc:
        print(f"arrowbuf inspect: cannot open {args.target!r}: {exc}", file=sys.stderr)
        return 2
    try:
        stats = store.stats()
        print(f"{what}: {stats.get('name')!r}, schema {stats.get('schema')!r}")
        print(f"size {stats.get('size'):,} of {stats.get('capacity'):,} rows; inserts {stats.get('inserts'):,}, "
              f"samples {stats.get('samples'):,}")
        _print_sizes(stats, store.to_table().schema)
        eps = store.episodes()
        if eps.num_rows:
            import pyarrow.compute as pc

            complete = eps.filter(eps.column("complete"))
            mean = pc.mean(complete.column("return")).as_py() if complete.num_rows else None
            print(f"episodes: {eps.num_rows} ({complete.num_rows} complete), mean return of complete episodes "
                  + (f"{mean:.3f}" if mean is not None else "-")
                  + f", mean length {pc.mean(eps.column('length')).as_py():.1f}")
        else:
            print("episodes: none")
        if args.sql:
            print(store.sql(args.sql).to_pandas().to_string(index=False))
    finally:
        store.close()
    return 0


def _print_sizes(stats: dict[str, Any], schema: Any) -> None:
    """Per column: its type, rows' bytes and reserved bytes (`arrowbuf.engine.sizes`: the numbers `stats()`, the
    inspector and /metrics show), then the totals, each labelled."""
    columns = stats.get("columns") or {}
    names = [f.name for f in schema]
    types = [type_name(f.type) for f in schema]
    wn = max(6, *map(len, names))
    wt = max(4, *map(len, types))  # as wide as the longest type: never cut mid-word
    print(f"{'column':<{wn}}  {'type':<{wt}}  {'rows bytes':>14}  {'reserved bytes':>14}")
    for name, typ in zip(names, types):
        sizes = columns.get(name) or {}
        rows, reserved = sizes.get("rows_bytes"), sizes.get("reserved_bytes")
        print(f"{name:<{wn}}  {typ:<{wt}}  {_n(rows):>14}  {_n(reserved):>14}")
    if "rows_bytes" in stats:
        print(f"rows' bytes:    {_human(stats['rows_bytes']):>10} (the live rows' values)")
        print(f"reserved bytes: {_human(stats['reserved_bytes']):>10} (what the store's memory holds for its "
              f"capacity of {stats.get('capacity'):,} rows: the ring, final observations, the index)")


def type_name(t: Any) -> str:
    """A short, whole name of an Arrow type: tensors as `tensor<uint8>[4,84,84]`, arrowbuf's dtypes by name."""
    import pyarrow as pa

    if isinstance(t, pa.FixedShapeTensorType):
        return f"tensor<{type_name(t.value_type)}>[{','.join(map(str, t.shape))}]"
    if isinstance(t, pa.ExtensionType):
        storage = t.storage_type
        shape = f"[{storage.list_size}]" if isinstance(storage, pa.FixedSizeListType) else ""
        return f"{t.extension_name}{shape}"
    if isinstance(t, (pa.ListType, pa.LargeListType)):
        return f"list<{type_name(t.value_type)}>"
    return str(t)


def _n(v: Any) -> str:
    return "-" if v is None else f"{int(v):,}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


# ---------------------------------------------------------------------------------------------------- ui
def add_ui(sub: Any) -> None:
    p = sub.add_parser("ui", help="a live web inspector of a store (overview, rates, tasks, SQL, lineage)",
                       description="Serve a live web page over a store until SIGINT/SIGTERM: a Flight location, a "
                                   "shared-memory store name, a checkpoint or dataset directory, or a file.")
    p.add_argument("target", help="grpc://host:port, a shared-memory store name, a checkpoint/dataset directory or "
                                  "an .arrow/.parquet file")
    p.add_argument("--token", default=None, help="bearer token of the Flight server; the page then needs it too")
    p.add_argument("--token-file", default=None, help="file whose first line is that token")
    p.add_argument("--store", default=None, help="store name when a server serves several")
    p.add_argument("--address", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the page listens (default 127.0.0.1:0: this machine only, a free port)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two samples of the rates")
    p.set_defaults(func=run_ui)


def run_ui(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError
    from ..observe.ui import Inspector

    if args.token_file:
        with open(args.token_file) as fh:
            args.token = fh.readline().strip() or None
    try:
        store, what = _open_target(args)
    except (ArrowbufError, OSError) as exc:
        print(f"arrowbuf ui: cannot open {args.target!r}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Inspector(store, args.address, token=args.token, interval=args.interval) as inspector:
            print(f"arrowbuf: inspecting {what} at {inspector.url}", flush=True)
            while not stop.wait(0.5):
                pass
    except ArrowbufError as exc:
        print(f"arrowbuf ui: {exc}", file=sys.stderr)
        return 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        store.close()
    return 0


# ---------------------------------------------------------------------------------------------------- bench
def add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="run the benchmarks (python -m benchmarks) from a source checkout",
                       description="Run benchmarks/ (a source checkout is needed: the benchmarks are not in the wheel) "
                                   "and write benchmarks/RESULTS.md. Other arguments go to python -m benchmarks, e.g. "
                                   "arrowbuf bench --quick, arrowbuf bench --only core sampling.")
    p.set_defaults(func=run_bench, extra=True)


def run_bench(args: argparse.Namespace) -> int:
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[2]  # the checkout: arrowbuf/cli/__init__.py -> ./benchmarks
    if not (root / "benchmarks" / "__main__.py").exists():
        print("arrowbuf bench: the benchmarks are not part of the installed package; in a source checkout of "
              "arrowbuf (git clone), run `pip install -e '.[bench]'` and then `arrowbuf bench --quick` there",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks", *args.extra_args], cwd=root)


def add_checkpoint(sub: Any) -> None:
    from .checkpoint import add_checkpoint as add

    add(sub)


COMMANDS: list[Callable[[Any], None]] = [add_serve, add_shm, add_demo, add_inspect, add_ui, add_bench,
                                         add_checkpoint]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrowbuf", description="arrowbuf: an Arrow experience store for RL")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not in the interpreter's final flush
        return code
    except BrokenPipeError:  # `arrowbuf inspect ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout would fail once more
        return 141
    except KeyboardInterrupt:
        print(f"arrowbuf {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ArrowbufError, OSError) as exc:
        print(f"arrowbuf {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """An exception as one line for a user: its message (what was wrong, and what to do) without a traceback."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"no such file or directory: {exc.filename}"
    if isinstance(exc, PermissionError) and exc.filename:
        return f"permission denied: {exc.filename}"
    return text
