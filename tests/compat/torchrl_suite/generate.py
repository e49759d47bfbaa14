"""Make TorchRL's replay-buffer tests run on `ArrowbufStorage` too: copy upstream/ and add the storage beside
`LazyTensorStorage` in every storage parametrization.

    python tests/compat/torchrl_suite/generate.py OUT_DIR        # writes OUT_DIR/conftest.py, OUT_DIR/rb/*.py
    python tests/compat/torchrl_suite/generate.py OUT_DIR --diff # and prints the diff against upstream/

The change is mechanical and the only one made to TorchRL's files: in each `pytest.mark.parametrize(names, values)`
whose `values` is a list or tuple literal, every value that names `LazyTensorStorage` (alone, in a tuple, in a
`functools.partial`, in a `pytest.param`) is followed by a copy of itself with `LazyTensorStorage` renamed
`ArrowbufStorage`; a file that gained one imports `ArrowbufStorage` below its `from __future__` line. No assertion,
test body or other value is touched. Parametrizations by name strings ("tensor", "memmap") that a test body maps to
a class are left alone (adding a storage there would mean editing the body).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
import re
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
IMPORT = "from arrowbuf.compat.torchrl import ArrowbufStorage  # added by arrowbuf's generate.py\n"
PEER, OURS = "LazyTensorStorage", "ArrowbufStorage"


def _is_parametrize(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "parametrize"


def _values(call: ast.Call) -> ast.expr | None:
    if len(call.args) > 1:
        return call.args[1]
    return next((k.value for k in call.keywords if k.arg == "argvalues"), None)


def add_storage(source: str) -> tuple[str, int]:
    """`source` with `ArrowbufStorage` added beside `LazyTensorStorage` in its parametrizations, and how many
    values were added."""
    tree = ast.parse(source)
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    inserts: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _is_parametrize(node.func)):
            continue
        values = _values(node)
        if not isinstance(values, (ast.List, ast.Tuple)):
            continue
        for elt in values.elts:
            if not any(isinstance(n, ast.Name) and n.id == PEER for n in ast.walk(elt)):
                continue
            segment = ast.get_source_segment(source, elt)
            assert segment is not None and elt.end_lineno is not None and elt.end_col_offset is not None
            end = starts[elt.end_lineno - 1] + len(source.splitlines(keepends=True)[elt.end_lineno - 1]
                                                   .encode()[:elt.end_col_offset].decode())
            inserts.append((end, ", " + re.sub(rf"\b{PEER}\b", OURS, segment)))
    if not inserts:
        return source, 0
    out = source
    for pos, text in sorted(inserts, reverse=True):
        out = out[:pos] + text + out[pos:]
    marker = "from __future__ import annotations\n"
    if marker in out:
        out = out.replace(marker, marker + "\n" + IMPORT, 1)
    else:
        out = IMPORT + out
    ast.parse(out)  # still Python
    return out, len(inserts)


def generate(out: pathlib.Path, upstream: pathlib.Path = UPSTREAM) -> dict[str, int]:
    """Write the suite to `out` (replacing what is there); returns {file: values added} for the changed files."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(upstream, out)
    added = {}
    for path in sorted((out / "rb").glob("test_*.py")):
        text, n = add_storage(path.read_text())
        if n:
            path.write_text(text)
            added[path.name] = n
    return added


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--diff", action="store_true", help="print the diff against upstream/")
    args = p.parse_args(argv)
    added = generate(args.out)
    for name, n in added.items():
        print(f"{name}: {n} parametrization values added", file=sys.stderr)
        if args.diff:
            a = (UPSTREAM / "rb" / name).read_text().splitlines(keepends=True)
            b = (args.out / "rb" / name).read_text().splitlines(keepends=True)
            sys.stdout.writelines(difflib.unified_diff(a, b, f"upstream/rb/{name}", f"generated/rb/{name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
