"""The import contract (scripts/check_layers.py): layers, and no import cycle of any kind."""

from __future__ import annotations

import importlib.util
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
assert _spec is not None and _spec.loader is not None
check_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_layers)


def test_arrowbuf_keeps_its_import_contract():
    assert check_layers.violations() == []


def _tree(tmp_path, files):
    root = tmp_path / "arrowbuf"
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_a_lazy_import_of_a_higher_layer_is_a_violation(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "errors.py": "", "store/__init__.py": "", "store/facade.py": "",
        "ring/__init__.py": "", "ring/index.py": "def f():\n    from ..store import facade\n",
    })
    found = check_layers.violations(root)
    assert any("arrowbuf.ring.index (ring) imports arrowbuf.store.facade (facade)" in v for v in found), found


def test_a_type_only_cycle_within_a_layer_is_a_violation(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "errors.py": "", "ring/__init__.py": "",
        "ring/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "ring/b.py": "from .a import A\n",
    })
    assert any(v.startswith("import cycle: arrowbuf.ring.a -> arrowbuf.ring.b") for v in check_layers.violations(root))


def test_a_module_in_no_layer_is_named(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "errors.py": "", "stray.py": ""})
    assert any("arrowbuf.stray: in no layer" in v for v in check_layers.violations(root))
