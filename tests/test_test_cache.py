"""The suite's own XLA cache kept between runs (scripts/test): a half-written entry from a killed run is dropped."""

import zlib

from conftest import _drop_truncated_entries


def test_a_truncated_entry_is_dropped_and_whole_ones_kept(tmp_path):
    whole = zlib.compress(b"an executable" * 1000)
    (tmp_path / "jit_f-1-cache").write_bytes(whole)
    (tmp_path / "jit_g-2-cache").write_bytes(whole[: len(whole) // 2])  # killed mid-write
    (tmp_path / "jit_h-3-cache").write_bytes(b"\x28\xb5\x2f\xfd" + b"zstd frame")  # not zlib: left as it is
    (tmp_path / "notes.txt").write_bytes(b"\x78 not an entry")
    _drop_truncated_entries(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_f-1-cache", "jit_h-3-cache", "notes.txt"]
