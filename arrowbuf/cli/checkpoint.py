"""`arrowbuf checkpoint ls|inspect|verify|export`: checkpoint directories from the command line.

    arrowbuf checkpoint ls ckpt/                      kept checkpoints: generation, time, rows, files, bytes
    arrowbuf checkpoint inspect ckpt/ [--generation N]  store settings, row range, files by kind, state
    arrowbuf checkpoint verify ckpt/ [--all]          sizes and CRC-32 of every file (exit 1 when damaged)
    arrowbuf checkpoint export ckpt/ out/ [--format parquet|arrow] [--partition-by episode_id]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any


def add_checkpoint(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="checkpoint directories: list, inspect, verify, export",
                       description="Checkpoint directories written by store.checkpoint(path) (docs/format.md).")
    cs = p.add_subparsers(dest="checkpoint_command", metavar="checkpoint_command")
    cs.required = True
    ls = cs.add_parser("ls", help="the kept checkpoints of a directory")
    ls.add_argument("path")
    ls.set_defaults(func=run_ls)
    ins = cs.add_parser("inspect", help="store settings, row range, files and state of a checkpoint")
    ins.add_argument("path")
    ins.add_argument("--generation", type=int, default=None, help="a kept generation (default: the latest)")
    ins.set_defaults(func=run_inspect)
    ver = cs.add_parser("verify", help="check sizes and checksums of every file (exit status 1 when damaged)")
    ver.add_argument("path")
    ver.add_argument("--all", action="store_true", help="every kept checkpoint, not only the latest")
    ver.set_defaults(func=run_verify)
    ex = cs.add_parser("export", help="write the latest checkpoint's rows as an offline-RL dataset")
    ex.add_argument("path")
    ex.add_argument("out")
    ex.add_argument("--format", choices=["parquet", "arrow"], default="parquet")
    ex.add_argument("--partition-by", nargs="*", default=None, help="hive-partition by these columns")
    ex.set_defaults(func=run_export)


def _manifest(path: str, generation: int | None = None) -> dict[str, Any]:
    from ..persist.manifest import read_manifest

    return read_manifest(path, None if generation is None else f"{generation:08d}.json")


def _fail(cmd: str, exc: BaseException) -> int:
    print(f"arrowbuf checkpoint {cmd}: {exc}", file=sys.stderr)
    return 2


def run_ls(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError
    from ..persist.manifest import kept_manifests, read_manifest

    try:
        latest = read_manifest(args.path)["generation"]
        names = kept_manifests(args.path)
    except (ArrowbufError, OSError) as exc:
        return _fail("ls", exc)
    print(f"{'gen':>6}  {'created (UTC)':<19} {'rows':>12} {'first_seq':>12} {'next_seq':>12} {'files':>6} "
          f"{'MiB':>10}")
    for n in names:
        try:
            m = read_manifest(args.path, n)
        except (ArrowbufError, OSError) as exc:
            print(f"{n[:8]:>6}  damaged: {exc}")
            continue
        created = datetime.datetime.fromtimestamp(m["created"], datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        r = m["rows"]
        size = sum(e["bytes"] for e in m["files"]) / 2**20
        mark = " *" if m["generation"] == latest else ""
        print(f"{m['generation']:>6}  {created:<19} {r['count']:>12,} {r['first_seq']:>12} {r['next_seq']:>12} "
              f"{len(m['files']):>6} {size:>10.1f}{mark}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError

    try:
        m = _manifest(args.path, args.generation)
    except (ArrowbufError, OSError) as exc:
        return _fail("inspect", exc)
    st = m["store"]
    print(f"checkpoint {args.path}: generation {m['generation']}, format version {m['version']}, "
          f"compression {m.get('compression') or 'none'}")
    print(f"store {st.get('name')!r}: schema {st['schema'].get('name')!r}, capacity {st['capacity']:,}, "
          f"chunk_rows {st['chunk_rows']}, tier {st.get('tier')}")
    from ..samplers.spec import spec_class_name

    sampler = st.get("sampler") or {}
    limiter = spec_class_name(st.get("rate_limiter")) or "none"
    print(f"sampler {spec_class_name(sampler)} {sampler.get('args', {})}; rate limiter {limiter}")
    r = m["rows"]
    print(f"rows {r['count']:,}: seqs [{r['first_seq']}, {r['next_seq']})"
          + (f"; {r['dropped_rows']:,} rows were overwritten while copied and left out" if r.get("dropped_rows")
             else ""))
    kinds: dict[str, list[int]] = {}
    for e in m["files"]:
        kinds.setdefault(e.get("kind", "?"), []).append(e["bytes"])
    print(f"{'files':<16} {'count':>6} {'bytes':>14}")
    for k, sizes in sorted(kinds.items()):
        print(f"{k:<16} {len(sizes):>6} {sum(sizes):>14,}")
    print("fields: " + ", ".join(f"{n} {f.get('dtype')}{list(f.get('shape', []))}"
                                 for n, f in st["schema"].get("fields", {}).items()))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError
    from ..persist.manifest import kept_manifests, read_manifest, verify

    try:
        manifests = ([read_manifest(args.path, n) for n in kept_manifests(args.path)] if args.all
                     else [read_manifest(args.path)])
    except (ArrowbufError, OSError) as exc:
        print(f"arrowbuf checkpoint verify: {exc}", file=sys.stderr)
        return 1
    from ..observe.meter import PhasedProgress

    bad = 0
    for m in manifests:
        with PhasedProgress(f"arrowbuf checkpoint verify: generation {m['generation']}: ") as progress:
            problems = verify(args.path, m, progress=progress)
        files = len(m["files"])
        if problems:
            bad += 1
            print(f"generation {m['generation']}: DAMAGED ({len(problems)} of {files} files)")
            for p in problems:
                print(f"  {p}")
        else:
            print(f"generation {m['generation']}: ok ({files} files, {sum(e['bytes'] for e in m['files']):,} bytes)")
    return 1 if bad else 0


def run_export(args: argparse.Namespace) -> int:
    from ..errors import ArrowbufError
    from ..observe.meter import PhasedProgress
    from ..store import ExperienceStore

    try:
        with PhasedProgress("arrowbuf checkpoint export: ") as progress, \
                ExperienceStore.restore(args.path, progress=progress) as store:
            info = store.export(args.out, format=args.format, partition_by=args.partition_by, progress=progress)
    except (ArrowbufError, OSError) as exc:
        return _fail("export", exc)
    print(f"exported {info['rows']:,} rows to {info['path']} ({info['format']})")
    return 0
