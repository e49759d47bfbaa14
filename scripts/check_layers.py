"""The import contract of arrowbuf/: layers, and no import cycle of any kind (lazy and type-only imports count).

Run as `python scripts/check_layers.py` (`.ci/run` does; tests/test_layering.py too). Exit status 1 and one line per
violation when the contract is broken. The layers, top to bottom (a module may import its own layer and any below;
within a layer the imports must still form no cycle); docs/architecture.md draws them.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "arrowbuf"

#: Top to bottom. A module belongs to the layer of its longest matching entry: "pkg" matches pkg and everything in
#: it, "pkg." only what is in it, "=mod" only mod itself.
LAYERS: list[tuple[str, list[str]]] = [
    ("apps", ["=arrowbuf", "arrowbuf.cli", "arrowbuf.demo", "arrowbuf.conformance"]),
    ("integrations", ["arrowbuf.rllib", "arrowbuf.compat"]),
    ("ray", ["arrowbuf.ray"]),
    ("flight", ["arrowbuf.flight"]),
    ("facade", ["arrowbuf.store"]),
    ("persist", ["arrowbuf.persist"]),
    ("engine", ["arrowbuf.engine"]),
    ("observe", ["arrowbuf.observe"]),
    ("query", ["arrowbuf.query"]),
    ("placement", ["arrowbuf.placement"]),
    ("delivery", ["arrowbuf.delivery", "arrowbuf.surface"]),
    ("samplers", ["arrowbuf.samplers", "arrowbuf.options"]),
    ("ring", ["arrowbuf.ring"]),
    ("schema", ["arrowbuf.schema", "arrowbuf.rate_limiters"]),
    ("tiers", ["arrowbuf.tiers"]),
    ("serving", ["arrowbuf.serving"]),
    ("errors", ["arrowbuf.errors", "arrowbuf.config"]),
]


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(mods: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    """module -> {imported arrowbuf module: line}; every import statement counts, wherever it stands."""
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        pkg = m if is_pkg else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                # `from pkg import submodule` imports the submodule; other names come from the module itself
                targets = subs + ([target] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import arrowbuf.x.y` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != m:
                    edges[m].setdefault(t, node.lineno)
    return edges


def layer_of(mod: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if pre.startswith("="):
                hit = mod == pre[1:]
            elif pre.endswith("."):
                hit = mod.startswith(pre)
            else:
                hit = mod == pre or mod.startswith(pre + ".")
            if hit and len(pre) > best:
                best, rank = len(pre), i
    return rank


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(root: pathlib.Path = ROOT) -> list[str]:
    mods = modules(root)
    edges = imports(mods)
    out = []
    for m in sorted(mods):
        if layer_of(m) < 0:
            out.append(f"{m}: in no layer of scripts/check_layers.py; add it to one")
    for m, targets in sorted(edges.items()):
        for t, line in sorted(targets.items()):
            lm, lt = layer_of(m), layer_of(t)
            if lm >= 0 and lt >= 0 and lt < lm:
                out.append(f"{mods[m].relative_to(root.parent)}:{line}: {m} ({LAYERS[lm][0]}) imports {t} "
                           f"({LAYERS[lt][0]}), a higher layer")
    for comp in cycles(edges):
        out.append("import cycle: " + " -> ".join(comp))
    return out


def main() -> int:
    found = violations()
    for v in found:
        print(v)
    print(f"import contract: {len(found)} violation(s) in {len(modules())} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
