"""The journal's and checkpoints' CRC-32 (`arrowbuf.persist.crc`): ISA-L's when installed gives zlib's values, so a
journal or checkpoint written with one implementation is read with the other (the formats do not change)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import crc


def test_the_crc_is_zlibs_crc32_chained_or_not():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 100, 4096, 186_000, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for start in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
            assert crc.crc32(data, start) == zlib.crc32(data, start) & 0xFFFFFFFF
        view = memoryview(data)
        assert crc.crc32(view[n // 2:], crc.crc32(view[:n // 2])) == zlib.crc32(data)


@pytest.mark.parametrize("write_with,read_with", [("fast", "zlib"), ("zlib", "fast")])
def test_a_journal_and_checkpoint_written_with_one_crc_restore_with_the_other(tmp_path, monkeypatch, write_with,
                                                                               read_with):
    schema = {"name": "c", "fields": {"x": "int64", "tok": {"dtype": "int32", "ragged": True}}}
    fast = crc._crc

    def use(which):
        monkeypatch.setattr(crc, "_crc", fast if which == "fast" else zlib.crc32)

    use(write_with)
    root = str(tmp_path / "run")
    s = ab.ExperienceStore(schema, capacity=100, durable=root, durability="os")
    for i in range(5):
        s.extend({"x": np.arange(4) + 10 * i, "tok": [np.arange(k + 1, dtype=np.int32) for k in range(4)]})
        if i == 2:
            s.checkpoint()
    before = s.to_table()
    s.close()
    use(read_with)
    with ab.ExperienceStore.restore(root) as again:
        assert again.to_table().equals(before)
    assert os.path.isdir(os.path.join(root, "_journal"))
