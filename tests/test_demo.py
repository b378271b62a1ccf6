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
def test_demo_for_other_targets(jax_devices, hw, tmp_path, monkeypatch):
    # An empty specs folder: another test's run may have calibrated this host in the session's folder already.
    monkeypatch.setenv("SHARDLAB_SPECS_DIR", str(tmp_path))
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


@pytest.mark.parametrize(("n", "mesh"), [(1, "X=1,Y=1"), (4, "X=1,Y=4"), (8, "X=2,Y=4")])
def test_the_main_job_on_an_accelerator_is_the_real_size_block_over_its_devices(monkeypatch, n, mesh):
    import jax

    from lab.cli.run import main_job

    class Device:
        device_kind = "NVIDIA H200"

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: n)
    monkeypatch.setattr(jax, "devices", lambda: [Device()] * n)
    job = main_job()
    assert job["backend"] == "gpu" and "NVIDIA H200" in job["where"] and f"on {n} gpu device" in job["where"]
    assert job["overrides"] == {"mesh": mesh, "sizes": "B=8192,D=4096,F=14336", "dtype": "bf16"}


def test_the_main_job_on_the_host_is_the_toy_experiment():
    from lab.cli.run import main_job

    assert main_job() == {"backend": "cpu", "where": "on the emulated mesh", "overrides": {}}
