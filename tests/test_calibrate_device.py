"""Calibrating an accelerator from device-side trace times; run here on the emulated devices (labelled so)."""

import json

import pytest

from lab.core.devices import spec_name
from lab.core.hardware import get_chip, load_hardware_file
from lab.measure import fit
from lab.measure.calibrate_device import calibrate_device, fitted_chip, write_device_spec

PROVENANCE = {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "device_count": 8, "date": "2026-11-30"}


def test_spec_names():
    assert spec_name("gpu", "NVIDIA H100 80GB HBM3") == "gpu-nvidia-h100-80gb-hbm3.json"
    assert spec_name("tpu", "TPU v5 lite") == "tpu-tpu-v5-lite.json"


def test_fitted_chip_takes_the_best_matmul_the_copy_slope_and_the_all_gather_link():
    base = get_chip("h100")
    mm = [
        {"dtype": "bf16", "m": 4096, "k": 4096, "n": 4096, "seconds": 2 * 4096**3 / 7e14, "flops_per_s": 7e14},
        {"dtype": "bf16", "m": 16, "k": 8192, "n": 8192, "seconds": 1.0, "flops_per_s": 1e13},
        {"dtype": "fp32", "m": 4096, "k": 4096, "n": 4096, "seconds": 1.0, "flops_per_s": 5e13},
    ]
    # t = 5 us + bytes / 3e12: the slope gives 3e12 B/s, whatever the intercept
    mem = [{"op": "copy", "bytes": b, "seconds": 5e-6 + b / 3e12} for b in (2**27, 2**29, 2**31)]
    mem += [{"op": "elementwise", "bytes": 2**31, "seconds": 1.0}]
    coll = [{"kind": "all-gather", "axes": ["X"], "group": 8, "latency_s": 8e-6, "bandwidth": 2e11, "points": []}]
    chip = fitted_chip(base, mm, mem, coll, {"X": 8}, PROVENANCE)
    assert chip.peak_flops["bf16"] == 7e14 and chip.peak_flops["fp32"] == 5e13
    assert chip.peak_flops["fp8"] == base.peak_flops["fp8"]  # not measured: the catalog's
    assert chip.hbm_bandwidth == pytest.approx(3e12, rel=1e-6)
    # V / t = 2e11 B/s of V over 8 devices: the model's all-gather moves (G-1)/G of V per link
    assert chip.link_bandwidth == pytest.approx(fit.model_slopes(base, (8,))["all-gather"] * 2e11)
    assert chip.link_bandwidth == pytest.approx(2e11 * 7 / 8, rel=1e-6)
    assert chip.launch_latency_s == 8e-6 and chip.calibrated
    assert "calibrated 2026-11-30" in chip.sources["hbm_bandwidth"]
    assert chip.calibration["provenance"]["device_kind"] == "NVIDIA H100 80GB HBM3"


def test_calibrate_on_emulated_devices_writes_a_spec_that_loads(jax_devices, tmp_path):
    chip, warnings = calibrate_device({"X": 2, "Y": 4}, quick=True)
    assert warnings == [] and chip.name == "cpu" and chip.calibrated and "EMULATED" in chip.notes
    c = chip.calibration
    assert c["provenance"]["backend"] == "cpu" and c["provenance"]["versions"]["jax"]
    assert {r["dtype"] for r in c["matmul"]} == {"bf16", "fp32"} and any(r["m"] == 16 for r in c["matmul"])
    assert {r["op"] for r in c["memory"]} == {"copy", "elementwise"}
    groups = {(r["kind"], tuple(r["axes"])) for r in c["collectives"]}
    assert ("all-gather", ("X", "Y")) in groups and ("all-to-all", ("Y",)) in groups and len(groups) == 12
    assert all(r["seconds"] > 0 for r in c["matmul"] + c["memory"])
    path = write_device_spec(chip, tmp_path / spec_name("cpu", "cpu"))
    loaded = load_hardware_file(path)[0]
    assert loaded.calibrated and loaded.hbm_bandwidth == chip.hbm_bandwidth
    assert json.loads(path.read_text())["calibration"]["provenance"]["mesh"] == {"X": 2, "Y": 4}


def test_one_device_measures_no_collectives_and_says_so(jax_devices):
    chip, warnings = calibrate_device({"X": 1}, quick=True)
    assert warnings and "no collectives" in warnings[0]
    assert chip.calibration["collectives"] == [] and chip.link_bandwidth == get_chip("cpu").link_bandwidth


def test_a_run_on_that_device_kind_prices_with_its_calibration(tmp_path, monkeypatch):
    from lab.core.hardware import SPECS_DIR_ENV
    from lab.run.environment import resolve_hardware

    monkeypatch.setenv(SPECS_DIR_ENV, str(tmp_path))
    said = []
    mm = [{"dtype": "bf16", "m": 1, "k": 1, "n": 1, "seconds": 1.0, "flops_per_s": 6e14}]
    mem = [{"op": "copy", "bytes": 3e12, "seconds": 1.0}]
    chip = fitted_chip(get_chip("h100"), mm, mem, [], {"X": 1}, PROVENANCE)
    write_device_spec(chip, tmp_path / spec_name("gpu", "NVIDIA H100 80GB HBM3"))
    got = resolve_hardware("calibrated", "gpu", "NVIDIA H100 80GB HBM3", None, said.append, {"X": 1})
    assert got.calibrated and got.peak_flops["bf16"] == 6e14 and got.hbm_bandwidth == 3e12
    assert "gpu-nvidia-h100-80gb-hbm3.json" in said[0]
    # another kind on the same backend: the catalog's chip of that kind
    other = resolve_hardware("calibrated", "gpu", "NVIDIA H200", None, said.append, {"X": 1})
    assert other.name == "h200" and not other.calibrated
