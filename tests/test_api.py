import subprocess
import sys

import arrowbuf as ab

CONTRACT = ["ExperienceSchema", "ExperienceStore", "SampleBatch", "load_schema", "samplers", "rate_limiters",
            "ArrowbufError", "SchemaError", "SampleTimeout", "InsertTimeout"]


def test_all_lists_public_names():
    import types

    namespaces = {"samplers", "rate_limiters", "placement", "config"}  # modules exported as namespaces (ab.samplers.X)
    public = {n for n in dir(ab) if not n.startswith("_")
              and (not isinstance(getattr(ab, n), types.ModuleType) or n in namespaces)}
    assert set(ab.__all__) == public, "every public name is in __all__ and nothing else"
    for name in CONTRACT:
        assert name in ab.__all__
    for name in ab.__all__:
        assert getattr(ab, name) is not None


def test_error_hierarchy():
    assert issubclass(ab.SchemaError, ValueError) and issubclass(ab.SchemaError, ab.ArrowbufError)
    assert issubclass(ab.SampleTimeout, TimeoutError) and issubclass(ab.InsertTimeout, TimeoutError)


def test_import_needs_only_runtime_deps():
    code = ("import sys, arrowbuf; heavy = {'torch', 'ray', 'duckdb', 'polars', 'pandas', 'cudf', 'cupy'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_samplers_namespace():
    assert ab.samplers.Uniform is ab.samplers.UniformSampler
    assert ab.samplers.Fifo.queue
    assert ab.rate_limiters.MinSize(3).min_size == 3
