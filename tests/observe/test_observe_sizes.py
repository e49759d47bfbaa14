"""One definition of a store's size (issue 44): `stats()`, `arrowbuf inspect`, the inspector's API and /metrics show
the same rows' bytes and reserved bytes for the same store, each labelled; a checkpoint of it inspects the same;
`store.placement()` lists ragged columns too."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.cli import main
from arrowbuf.observe.ui import Inspector

parser = pytest.importorskip("prometheus_client.parser")


def _atari(n: int) -> dict:
    return {"obs": np.full((n, 4, 84, 84), 3, np.uint8), "action": np.arange(n) % 4,
            "reward": np.ones(n, np.float32), "terminated": np.arange(n) % 50 == 49, "truncated": np.zeros(n, bool),
            "next_obs": np.full((n, 4, 84, 84), 4, np.uint8)}


def _grpo(n: int) -> dict:
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 9, n)
    return {"prompt_id": np.arange(n) // 4, "prompt_tokens": [[1, 2, 3]] * n,
            "response_tokens": [list(range(k)) for k in lens], "logprobs": [[-0.5] * k for k in lens],
            "policy_version": np.zeros(n, np.int64), "done": np.ones(n, bool)}


STORES = {"atari": (lambda: ab.ExperienceStore("atari", capacity=2000, seed=0), _atari),
          "grpo": (lambda: ab.ExperienceStore("grpo", capacity=2000, seed=0, tasks=["train"]), _grpo)}


def _cli_sizes(out: str) -> tuple[dict[str, tuple[int, int]], str]:
    """{column: (rows bytes, reserved bytes)} of `arrowbuf inspect`'s table, and its header line."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("column "))
    cols = {}
    for line in lines[head + 1:]:
        m = re.match(r"^(\S+)\s+(\S+)\s+([\d,]+)\s+([\d,]+)$", line)
        if not m:
            break
        cols[m.group(1)] = (int(m.group(3).replace(",", "")), int(m.group(4).replace(",", "")))
    return cols, lines[head]


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("kind", sorted(STORES))
def test_stats_inspect_inspector_and_metrics_agree_on_sizes(kind, tmp_path, capsys):
    make, rows = STORES[kind]
    store = make()
    try:
        store.extend(rows(500))
        st = store.stats()
        cols = st["columns"]
        # the two numbers, and what they are made of
        assert st["rows_bytes"] == sum(c["rows_bytes"] for c in cols.values()) > 0
        assert st["reserved_bytes"] == sum(st["bytes"].values()) > st["rows_bytes"]  # room for 2000 rows
        assert set(cols) == set(store.to_table().column_names)
        for name, f in store.schema.fields.items():
            if not f.ragged:
                assert cols[name]["rows_bytes"] == 500 * f.row_bytes
        if kind == "atari":
            assert cols["obs"]["rows_bytes"] == 500 * 4 * 84 * 84  # 14.1 MB of 500 rows, reserved for 2000
            assert cols["obs"]["reserved_bytes"] >= 2000 * 4 * 84 * 84
        else:
            lengths = [len(r) for r in _grpo(500)["response_tokens"]]
            assert cols["response_tokens"]["rows_bytes"] == 4 * sum(lengths)  # int32 tokens of the live rows
            assert cols["ref_logprobs"]["rows_bytes"] == 0  # a later field not written yet
        placed = store.placement()
        for name in store.schema.fields:  # ragged columns too
            assert name in placed.column("column").to_pylist()
            assert cols[name]["reserved_bytes"] == sum(b for c, b in zip(placed.column("column").to_pylist(),
                                                                         placed.column("bytes").to_pylist())
                                                       if c == name)

        # arrowbuf inspect (over Flight: the same store), labelled, the type column whole
        with ab.serve(store, "grpc://127.0.0.1:0", metrics="127.0.0.1:0") as server:
            capsys.readouterr()
            assert main(["inspect", server.location]) == 0
            out = capsys.readouterr().out
            shown, header = _cli_sizes(out)
            assert "rows bytes" in header and "reserved bytes" in header
            assert shown == {c: (v["rows_bytes"], v["reserved_bytes"]) for c, v in cols.items()}
            assert "rows' bytes:" in out and "reserved bytes:" in out
            if kind == "atari":
                assert "tensor<uint8>[4,84,84]" in out
            # /metrics
            m = _scrape(server.metrics_url)
            assert m[("arrowbuf_rows_bytes", frozenset({("store", store.name)}))] == st["rows_bytes"]
            assert m[("arrowbuf_reserved_bytes", frozenset({("store", store.name)}))] == st["reserved_bytes"]
            for c, v in cols.items():
                assert m[("arrowbuf_column_rows_bytes", frozenset({("store", store.name), ("column", c)}))] \
                    == v["rows_bytes"]
        # the inspector's API (what its page shows)
        with Inspector(store, "127.0.0.1:0") as inspector:
            with urllib.request.urlopen(inspector.url + "api/overview", timeout=10) as r:
                page = json.loads(r.read())
        assert page["stats"]["rows_bytes"] == st["rows_bytes"]
        assert page["stats"]["reserved_bytes"] == st["reserved_bytes"]
        assert page["stats"]["columns"] == cols
        assert {p["column"] for p in page["placement"]} == set(store.schema.fields)

        # a checkpoint of it: `arrowbuf inspect ckpt/` shows the same (it restores the same geometry)
        store.checkpoint(tmp_path / "ckpt")
        assert main(["inspect", str(tmp_path / "ckpt")]) == 0
        again, _ = _cli_sizes(capsys.readouterr().out)
        assert again == shown
    finally:
        store.close()


def test_inspect_names_every_type_whole(tmp_path, capsys):
    """The type column is as wide as its longest type: never cut mid-word."""
    schema = {"name": "wide", "fields": {"a_very_long_field_name_for_images": {"dtype": "float32",
                                                                              "shape": [3, 64, 64, 2]},
                                         "tokens": {"dtype": "int32", "ragged": True}, "done": {"dtype": "bool"}}}
    with ab.ExperienceStore(schema, capacity=10) as store:
        store.extend({"a_very_long_field_name_for_images": np.zeros((2, 3, 64, 64, 2), np.float32),
                      "tokens": [[1], [2, 3]], "done": [False, True]})
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            assert main(["inspect", server.location]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("a_very_long_field_name_for_images"))
    assert "tensor<float>[3,64,64,2]" in line
    assert "list<int32>" in out


def test_rows_bytes_of_ragged_columns_follow_the_ring_when_it_wraps():
    import pyarrow.compute as pc

    with ab.ExperienceStore("grpo", capacity=100, seed=0) as store:
        for k in range(5):  # 250 rows into 100: the ring wraps, the live rows straddle its end
            store.extend(_grpo(50) | {"prompt_id": np.arange(50) + 50 * k})
        cols = store.stats()["columns"]
        table = store.to_table()
        for name in ("prompt_tokens", "response_tokens", "logprobs"):
            elements = pc.sum(pc.list_value_length(table.column(name))).as_py()
            assert cols[name]["rows_bytes"] == 4 * elements, name


@pytest.mark.parametrize("kind", sorted(STORES))
def test_stats_of_a_closed_store_still_answers(kind):
    make, rows = STORES[kind]
    store = make()
    store.extend(rows(10))
    store.close()
    st = store.stats()  # as before sizes were added: a closed store still reports its counters
    assert st["inserts"] == 10 and "rows_bytes" in st and "reserved_bytes" in st
