"""scripts/validate_accelerator end to end on the emulated devices: calibrate, run scaled to the host, record."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab.run.validate_accelerator import mfu

ROOT = Path(__file__).resolve().parents[1]


def _script(tmp_path, *args):
    env = dict(os.environ)
    return subprocess.run(
        [
            str(ROOT / "scripts" / "validate_accelerator"),
            "--quick",
            "--doc",
            str(tmp_path / "cpu.md"),
            "--runs",
            str(tmp_path / "runs"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )


def test_mfu_is_model_flops_over_measured_step_and_peak():
    report = {"kernel": "train_step", "dtype": "bf16", "step_time_measured_s": 2.0, "estimate": {"flops": 4e14}}
    assert mfu(report, {"bf16": 1e15, "fp32": 1e14}) == pytest.approx(0.2)
    assert mfu(report | {"kernel": "decode"}, {"bf16": 1e15}) is None


@pytest.mark.slow  # about 45 s (a quick calibration of the host first); test_the_whole_record runs the same path
def test_the_record_of_an_emulated_run(tmp_path):
    done = _script(tmp_path, "--experiments", "llama3_8b_decode")
    assert done.returncode == 0, done.stderr[-2000:]
    doc = (tmp_path / "cpu.md").read_text()
    assert "EMULATED" in doc and "## llama3_8b_decode" in doc and "Scaled by 1/" in doc
    assert "calibrated spec" in doc and "catalog spec" in doc and "matmul" in doc
    raw = json.loads((tmp_path / "cpu" / "llama3_8b_decode" / "report.json").read_text())
    assert raw["scaled_to_host"]["factor"] > 1 and raw["emulated"] is True
    summary = json.loads((tmp_path / "cpu" / "summary.json").read_text())
    classes = {c["class"]: c for c in summary["llama3_8b_decode"]["classes"]}
    assert {"matmul", "all-reduce"} <= set(classes)
    m = classes["matmul"]["calibrated"]
    assert m["p25"] <= m["median"] <= m["p75"] and classes["matmul"]["ops"] >= 1
    assert "scaled down by 1/" in done.stderr


def test_an_unknown_experiment_is_refused(tmp_path):
    done = _script(tmp_path, "--experiments", "nope")
    assert done.returncode == 2 and "no experiments/nope.toml" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # about a minute: both real-size experiments, scaled
def test_the_whole_record(tmp_path):
    done = _script(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = (tmp_path / "cpu.md").read_text()
    assert "## llama3_8b_train_2layer" in doc and "MFU" in doc and "## llama3_8b_decode" in doc
