"""The limits every server shares (`arrowbuf.serving.limits`, issue 42): the bind policy, the error codes, the JSON
depth check, and that docs/security.md lists every server with every limit it declares."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.flight.protocol import errors as protocol_errors
from arrowbuf.serving.limits import (
    SERVERS,
    InsecureServerWarning,
    NetLimits,
    check_bind,
    check_json_depth,
    error_code,
    is_loopback,
    public_error,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.3.4.5"])
def test_loopback_binds_need_nothing(host):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert is_loopback(host)
        check_bind("x", host, None)
        check_bind("x", host, "t", plain_http=True)
        check_bind("x", host, None, takes_token=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_beyond_loopback_a_token_or_an_explicit_allowance(host):
    assert not is_loopback(host)
    with pytest.raises(ab.InvalidArgument, match="without a token"):
        check_bind("x", host, None)
    with pytest.warns(InsecureServerWarning, match="without a token"):
        check_bind("x", host, None, allow_unauthenticated=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bind("x", host, "t")
    with pytest.warns(InsecureServerWarning, match="clear text"):
        check_bind("x", host, "t", plain_http=True)
    with pytest.warns(InsecureServerWarning, match="no token"):
        check_bind("metrics", host, None, takes_token=False)


def test_the_flight_server_refuses_a_non_loopback_bind_without_a_token():
    """Authentication by default beyond loopback, for the Flight server too (before: a warning only)."""
    store = ab.ExperienceStore({"name": "b", "fields": {"x": {"dtype": "int64"}}}, capacity=8)
    with pytest.raises(ab.InvalidArgument, match="token"):
        ab.serve(store, "grpc://192.0.2.1:0")  # TEST-NET-1: refused before any bind
    with pytest.warns(InsecureServerWarning, match="without a token"), pytest.raises(Exception) as err:
        ab.serve(store, "grpc://192.0.2.1:0", allow_unauthenticated=True)  # warned; the bind itself then fails
    assert not isinstance(err.value, ab.InvalidArgument)
    store.close()


def test_the_flight_error_table_carries_the_same_codes():
    for m in protocol_errors.ERRORS:
        assert error_code(m.cls("x")) == m.code, m


def test_an_unexpected_error_is_internal_and_says_nothing():
    for exc in (RuntimeError("/srv/app/secret.py line 3"), RecursionError("maximum recursion depth"),
                MemoryError(), AssertionError("x")):
        err = public_error(exc)
        assert err.code == "INTERNAL" and not err.expected and "secret" not in err.message
    err = public_error(KeyError("partition 'p' not found"))
    assert (err.name, err.code, err.message) == ("KeyError", "NOT_FOUND", "partition 'p' not found")
    err = public_error(ab.SchemaError("x" * 5000))
    assert err.code == "INVALID_ARGUMENT" and len(err.message) < 1100
    assert json.loads(json.dumps(err.json())) == err.json()


def test_json_depth_is_checked_on_the_text_without_recursion():
    check_json_depth(b'{"a": [[1, 2], {"b": [3]}]}', 4, "x")
    check_json_depth(b'"' + b"[" * 1000 + b'"', 2000, "x")
    with pytest.raises(ab.InvalidArgument, match="deeper than 64"):
        check_json_depth(b"[" * 1_000_000 + b"]" * 1_000_000, 64, "x")


def test_net_limits_validate():
    with pytest.raises(ab.InvalidArgument, match="max_connections"):
        NetLimits(max_connections=0)
    with pytest.raises(ab.InvalidArgument, match="idle_timeout"):
        NetLimits(idle_timeout=float("nan"))
    assert NetLimits().with_overrides(max_connections=3).max_connections == 3


def test_docs_list_every_server_and_every_limit_it_declares():
    text = (ROOT / "docs" / "security.md").read_text()
    for spec in SERVERS.values():
        section = re.search(rf"^### {re.escape(spec.name)}\b.*?(?=^### |^## |\Z)", text, re.M | re.S)
        assert section is not None, f"docs/security.md has no section '### {spec.name}'"
        for limit in spec.limits:
            assert f"`{limit}`" in section.group(0), (spec.name, limit)
        assert f"{spec.allocation.multiple}x" in section.group(0), spec.name


def test_allocation_bound_arithmetic():
    rule = SERVERS["tq.v2"].allocation
    assert rule.bound(100) == rule.multiple * 100
    assert rule.bound(100, named_bytes=7, rows=2) == rule.multiple * 100 + 7 + 2 * rule.per_row
    assert np.isfinite(rule.bound(1 << 40))
