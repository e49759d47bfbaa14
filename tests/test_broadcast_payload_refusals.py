"""`payload.decode` refuses every malformed header or body with `BroadcastRefused` (issue 42): before, a deep JSON
header raised RecursionError, `"dtype": []` TypeError, and an Arrow node pointed at the wrong bytes OSError or
ArrowNotImplementedError. No Ray: payloads built in memory."""

from __future__ import annotations

import json
import struct

import numpy as np
import pyarrow as pa
import pytest

from arrowbuf.errors import BroadcastRefused
from arrowbuf.ray.hoplite import payload


def _raw(header: bytes, data: bytes) -> memoryview:
    start = -(-(payload.PREFIX + len(header)) // payload.ALIGN) * payload.ALIGN
    return memoryview((payload.MAGIC + struct.pack("<Q", len(header)) + header).ljust(start, b"\0") + data)


def _with_node(node: dict, data: bytes) -> memoryview:
    return _raw(json.dumps({"format": payload.FORMAT, "data": node}).encode(), data)


def _arrow_bytes() -> bytes:
    sink = pa.BufferOutputStream()
    t = pa.table({"y": [1.0, 2.0]})
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write(t)
    return sink.getvalue().to_pybytes()


TENSOR = np.arange(64, dtype=np.float32).tobytes()
ARROW = _arrow_bytes()
CASES = {
    "deep JSON header": _raw(b'{"format": "' + payload.FORMAT.encode() + b'", "data": ' + b"[" * 100_000
                             + b"]" * 100_000 + b"}", b""),
    "dtype is a list": _with_node({"k": "tensor", "torch": False, "dtype": [], "shape": [4], "offset": 0,
                                   "nbytes": 16}, TENSOR),
    "dtype is an object": _with_node({"k": "tensor", "torch": False, "dtype": {"a": 1}, "shape": [4], "offset": 0,
                                      "nbytes": 16}, TENSOR),
    "kind is a list": _with_node({"k": ["tensor"]}, b""),
    "type is a list": _with_node({"k": "arrow", "type": ["table"], "offset": 0, "nbytes": 8}, ARROW),
    "shape holds a bool": _with_node({"k": "tensor", "torch": False, "dtype": "float32", "shape": [True, 4],
                                      "offset": 0, "nbytes": 16}, TENSOR),
    "huge shape": _with_node({"k": "tensor", "torch": False, "dtype": "float32", "shape": [2**62, 2**62, 0],
                              "offset": 0, "nbytes": 0}, TENSOR),
    "arrow node on tensor bytes": _with_node({"k": "arrow", "type": "table", "offset": 0, "nbytes": len(TENSOR)},
                                             TENSOR),
    "arrow node on half a stream": _with_node({"k": "arrow", "type": "table", "offset": 0,
                                               "nbytes": len(ARROW) // 2}, ARROW),
    "arrow node off by 8": _with_node({"k": "arrow", "type": "batch", "offset": 8, "nbytes": len(ARROW) - 8},
                                      ARROW),
    "arrow node with a wrong body": _with_node({"k": "arrow", "type": "table", "offset": 0, "nbytes": len(ARROW)},
                                               ARROW[:200] + bytes(len(ARROW) - 200)),
    "header not an object": _raw(json.dumps([payload.FORMAT]).encode(), b""),
    "header of invalid UTF-8": _raw(b'{"format": "\xff\xfe"}', b""),
    "dict items keyed oddly": _with_node({"k": "dict", "items": [["a", {"k": "json", "v": 1}]]}, b""),
    "huge integer leaf": _raw(
        b'{"format": "' + payload.FORMAT.encode() + b'", "data": {"k": "json", "v": ' + b"9" * 5000 + b"}}", b""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_payload_is_broadcast_refused(case):
    with pytest.raises(BroadcastRefused):
        payload.decode(CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_payload_is_broadcast_refused_as_torch_views_too(case):
    pytest.importorskip("torch")
    with pytest.raises(BroadcastRefused):
        payload.decode(bytearray(CASES[case]), torch_views=True)


def test_a_well_formed_payload_still_decodes():
    good = _with_node({"k": "dict", "items": {"w": {"k": "tensor", "torch": False, "dtype": "float32",
                                                    "shape": [64], "offset": 0, "nbytes": len(TENSOR)},
                                              "t": {"k": "arrow", "type": "table", "offset": 256,
                                                    "nbytes": len(ARROW)}}}, TENSOR.ljust(256, b"\0") + ARROW)
    out = payload.decode(good)
    np.testing.assert_array_equal(out["w"], np.arange(64, dtype=np.float32))
    assert out["t"].column("y").to_pylist() == [1.0, 2.0]
