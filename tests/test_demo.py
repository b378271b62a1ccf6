import pytest

from lab.run.demo import CASES, run_demo


def test_demo_report_on_the_emulated_mesh(jax_devices):
    r = run_demo()
    check = r.data["placement_check"]
    assert check["ran"] and check["emulated"] and check["devices"] == 8
    assert check["operands"] == 2 * len(CASES) and check["mismatches"] == []
    for section in ("1. Roofline", "2. Sharded matmuls", "3. Collectives", "4. Emulated-mesh check"):
        assert section in r.text
    assert [p["cases"] for p in r.data["sharded_matmuls"]][:4] == [[1], [2], [3], [4]]


@pytest.mark.parametrize("hw", ["h100", "cpu", "tpu-v5p"])
def test_demo_for_other_targets(jax_devices, hw):
    r = run_demo(hardware=hw)
    assert r.data["hardware"]["name"] == hw
    if hw == "cpu":
        assert "uncalibrated placeholder" in r.text


def test_shardlab_demo_emulates_its_mesh_however_it_is_started(tmp_path):
    """`shardlab demo` without ./scripts/demo's XLA_FLAGS still gets its 8 devices (it had checked placement on
    one device and then refused to run the main job)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [sys.executable, "-m", "lab", "demo", "--analytic-only", "--json"],
        cwd=tmp_path,
        env=env | {"PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    check = json.loads(r.stdout)["placement_check"]
    assert check["ran"] and check["devices"] == 8 and check["mismatches"] == []
