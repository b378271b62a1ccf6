"""Instructions a Python command executes, counted by valgrind's callgrind: what the benchmarks quote beside wall
time, since the count is the same on a busy host as on an idle one and this shared host's speed moves by 3x from
day to day (the same planner code priced the 64-H100 search in 10.7 ms on 2026-11-30 and in 24-37 ms on 2026-12-02).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from lab.core.errors import UserError

MISSING = "counting instructions needs valgrind on PATH (apt install valgrind); or time without it"


def available() -> bool:
    return shutil.which("valgrind") is not None


def instructions(args: list[str]) -> int:
    """Instructions ``python args...`` executes (this interpreter), with ``PYTHONHASHSEED=0`` so that its sets and
    dicts are laid out alike every run: the same count each time. A :class:`UserError` when valgrind is missing or
    the command fails under it."""
    if not available():
        raise UserError(MISSING)
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONHASHSEED": "0"},
    )
    found = re.search(r"Collected : (\d+)", r.stderr)
    if r.returncode or not found:
        raise UserError(f"valgrind could not count {' '.join(args)} (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return int(found.group(1))


__all__ = ["MISSING", "available", "instructions"]
