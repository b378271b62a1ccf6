"""lab.core.files: a file written whole or not at all."""

import os

import pytest

from lab.core.files import write_atomic


def test_text_and_bytes_replace_the_file_whole(tmp_path):
    p = tmp_path / "a.json"
    write_atomic(p, "old\n")
    write_atomic(str(p), b"\x1f\x8bnew")
    assert p.read_bytes() == b"\x1f\x8bnew" and os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    write_atomic(p, "old\n")
    with pytest.raises(TypeError):
        write_atomic(p, 42)  # neither text nor bytes: fails after the temporary file is open
    assert p.read_text() == "old\n" and os.listdir(tmp_path) == ["a.json"]
