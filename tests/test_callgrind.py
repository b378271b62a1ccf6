"""scripts/_callgrind.py: the benchmarks' instruction counts, the same on a busy host as on an idle one."""

import shutil
import sys
from pathlib import Path

import pytest

from lab.core.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))  # benchmark helpers live there
import _callgrind as callgrind

needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed here")
# Python under valgrind starts in about 5 s: the counts themselves run with the slow tests
slow = pytest.mark.slow


@slow
@needs_valgrind
def test_a_command_counts_the_same_every_time_and_more_work_counts_more():
    bare = [callgrind.instructions(["-c", "pass"]) for _ in range(2)]
    loop = callgrind.instructions(["-c", "x = sum(range(10**6))"])
    assert bare[0] == bare[1] > 10**6
    assert loop > bare[0] + 10**6  # a million additions are more than a million instructions


@slow
@needs_valgrind
def test_a_failing_command_is_named():
    with pytest.raises(UserError, match=r"valgrind could not count -c raise SystemExit\(3\) \(exit 3\)"):
        callgrind.instructions(["-c", "raise SystemExit(3)"])


def test_without_valgrind_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not callgrind.available()
    with pytest.raises(UserError, match=r"needs valgrind on PATH \(apt install valgrind\)"):
        callgrind.instructions(["-c", "pass"])
