"""scripts/bench_suite_compiles' plugin and report: every compile request of a test process logged, then summed."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_the_report_sums_by_program_file_and_test(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from _suite_compiles import report
    finally:
        sys.path.remove(str(SCRIPTS))
    rows = [
        {"seconds": 2.0, "cache": "miss", "program": "jit_step", "test": "tests/test_a.py::test_x"},
        {"seconds": 0.5, "cache": "hit", "program": "jit_step", "test": "tests/test_b.py::test_y"},
        {"seconds": 1.0, "cache": "none", "program": None, "test": "tests/test_b.py::test_y"},
    ]
    (tmp_path / "compiles.gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "compiles.gw1.jsonl").write_text(json.dumps(rows[2]) + "\n")
    lines = report(str(tmp_path)).splitlines()
    assert lines[0] == (
        "3 compile requests in the test processes, 4 s: 1 compiled (persistent-cache misses), 1 read from the cache, "
        "1 not looked up"
    )
    program = lines.index(" seconds compiles  by XLA program")
    assert lines[program + 1 : program + 3] == [
        "     2.5        2  jit_step",
        "     1.0        1  (not looked up: a cross-compilation)",
    ]
    by_file = lines.index(" seconds compiles  by test file")
    assert lines[by_file + 1 : by_file + 3] == [
        "     2.0        1  tests/test_a.py",
        "     1.5        2  tests/test_b.py",
    ]
    assert report(str(tmp_path / "empty")) == f"no compiles logged in {tmp_path / 'empty'}"


def test_the_plugin_logs_each_compile_with_its_cache_outcome(tmp_path):
    """A process with the plugin configured compiles one program twice through the persistent cache (a new jit
    object the second time, so JAX asks the cache again): one miss, then one hit, both named."""
    code = textwrap.dedent("""
        import types, jax, numpy as np
        import _suite_compiles
        _suite_compiles.pytest_configure(types.SimpleNamespace(getoption=lambda *a: None))
        for _ in range(2):
            jax.jit(lambda x: x * 3 + 1)(np.arange(4.0)).block_until_ready()
    """)
    env = os.environ | {
        "SHARDLAB_COMPILE_LOG": str(tmp_path),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "PYTHONPATH": str(SCRIPTS),
        "PYTEST_XDIST_WORKER": "gw7",
        "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y[a b] (call)",  # as pytest sets it: the phase after a space
    }
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "compiles.gw7.jsonl").read_text().splitlines()]
    assert [(row["cache"], row["program"]) for row in rows] == [("miss", "jit__lambda"), ("hit", "jit__lambda")]
    assert all(row["seconds"] > 0 and row["test"] == "tests/test_x.py::test_y[a b]" for row in rows)
