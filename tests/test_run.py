"""The main job end to end on the emulated mesh: files, report keys and the sweep/resume contract."""

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lab.core.errors import UserError
from lab.run.pipeline import WARMUP, run_experiment

KINDS = {
    "matmul",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "attention",
    "elementwise",
    "other",
}


def _experiment(tmp_path, body: str, name: str = "exp") -> str:
    f = tmp_path / f"{name}.toml"
    f.write_text(body)
    return str(f)


TP_MLP = """# a small TP MLP block
[experiment]
kernel = "tp_mlp"
dtype = "float32"
[mesh]
X = 2
Y = 4
[sizes]
B = 64
D = 128
F = 512
[run]
warmup = 1
repeats = 2
"""


def test_a_relative_out_folder_works_as_the_default_runs_does(jax_devices, tmp_path, monkeypatch):
    """`shardlab run EXP` writes under ./runs: relative paths throughout, the trace found inside the run."""
    monkeypatch.chdir(tmp_path)
    result = run_experiment(_experiment(tmp_path, TP_MLP), "runs", quiet=True, hardware="cpu")
    assert result.run_dir == Path("runs/exp")
    report = json.loads((tmp_path / "runs/exp/report.json").read_text())
    assert report["tensorboard"] == "runs/exp/tensorboard"
    assert report["perfetto_trace"].startswith("runs/exp/tensorboard/plugins/profile/")
    assert (tmp_path / report["perfetto_trace"]).is_file()
    # the process's start-up apart from what the run did before its point (devices, a calibration): a test
    # process is old, so start-up is most of its age, and the phases add up to that age
    t = report["timings"]
    assert t["startup_s"] > 0 and t["prepare_s"] >= 0
    phases = sum(t[k] for k in ("startup_s", "prepare_s", "build_s", "compile_s", "profile_s", "parse_s", "report_s"))
    assert phases == pytest.approx(t["total_s"], rel=0.01)


def test_warm_up_defaults_to_several_calls_when_the_experiment_names_none(jax_devices, tmp_path):
    # One warm-up call leaves XLA:CPU's first traced steps several times slower in a fresh process.
    body = TP_MLP.replace("warmup = 1\n", "").replace("D = 128", "D = 32").replace("F = 512", "F = 64")
    result = run_experiment(_experiment(tmp_path, body), str(tmp_path / "runs"), quiet=True, hardware="cpu")
    summary = json.loads((result.run_dir / "report.json").read_text())["summary"]
    assert summary["warmup"] == WARMUP >= 5 and summary["repeats"] == 2


def test_run_writes_the_report_the_issue_names(jax_devices, tmp_path):
    path = _experiment(tmp_path, TP_MLP)
    result = run_experiment(path, str(tmp_path / "runs"), quiet=True, hardware="cpu")
    d = result.run_dir
    for f in (
        "report.md",
        "report.json",
        "ops.csv",
        "roofline.png",
        "predicted_vs_measured.png",
        "breakdown.png",
        "experiment.toml",
        "env.json",
        "spec.json",
        "hlo.txt",
    ):
        assert (d / f).is_file(), f
    assert list((d / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    r = json.loads((d / "report.json").read_text())
    for key in (
        "backend",
        "emulated",
        "hardware",
        "ops",
        "coverage",
        "step_time_measured_s",
        "step_time_predicted_s",
        "audit",
    ):
        assert key in r
    assert r["backend"] == "cpu" and r["emulated"] is True and "calibrated" in r["hardware"]
    assert r["audit"]["all_match"]
    for op in r["ops"]:
        assert {"name", "kind", "predicted_s", "measured_s", "ratio", "flops", "bytes", "collective_bytes"} <= set(op)
        assert op["kind"] in KINDS
    kinds = {op["kind"] for op in r["ops"]}
    assert {"matmul", "all-reduce"} <= kinds
    assert 0 < r["coverage"] <= 1
    matmuls = [op for op in r["ops"] if op["kind"] == "matmul"]
    assert sum(op["flops"] for op in matmuls) == 2 * (64 // 2) * 128 * (512 // 4) * 2  # up and down projections
    env = json.loads((d / "env.json").read_text())
    assert env["device_count"] == 8 and env["versions"]["jax"]
    assert "Emulated" in (d / "report.md").read_text()


SWEEP = """# all-reduce over a sweep of sizes
[experiment]
kernel = "collective_all_reduce"
dtype = "float32"
axes = ["Y"]
[mesh]
X = 2
Y = 4
[sizes]
N = 1024
[run]
repeats = 1
[run.sweep]
N = [1024, 4096, 16384]
"""


def test_sweep_keeps_finished_points_and_resume_continues(jax_devices, tmp_path):
    path = _experiment(tmp_path, SWEEP, "sweep")
    out = str(tmp_path / "runs")
    first = run_experiment(path, out, quiet=True, hardware="cpu", run_id="s")
    points = sorted(p.name for p in (first.run_dir / "points").iterdir())
    assert points == ["N1024", "N16384", "N4096"]
    summary = json.loads((first.run_dir / "sweep.json").read_text())
    assert [p["sizes"]["N"] for p in summary["points"]] == [1024, 4096, 16384]
    # the sweep's own report: a row per point with its three step times and its timing verdict, and the plot
    text = (first.run_dir / "summary.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("N")]
    assert [r.split()[0] for r in rows] == ["N1024", "N4096", "N16384"]
    assert all(("steady" in r or "UNSTEADY" in r) and "all match" in r for r in rows)
    assert (first.run_dir / "sweep.png").stat().st_size > 5_000
    # Simulate an interruption after the first point: the others are gone, the first stays.
    kept = first.run_dir / "points" / "N1024" / "report.json"
    stamp = kept.stat().st_mtime_ns
    for name in ("N4096", "N16384"):
        shutil.rmtree(first.run_dir / "points" / name)
    time.sleep(0.01)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        again = run_experiment(path, out, quiet=False, hardware="cpu", run_id="s", resume=True)
    assert again.run_dir == first.run_dir
    assert kept.stat().st_mtime_ns == stamp  # not recomputed
    assert (again.run_dir / "points" / "N16384" / "report.json").is_file()
    # progress: the kept point said so, the others counted with the time left once one has run here
    lines = err.getvalue().splitlines()
    assert any(line.endswith("N1024: done already, kept") for line in lines)
    (second,) = [line for line in lines if "point 2 of 3 (N4096)" in line]
    (third,) = [line for line in lines if "point 3 of 3 (N16384)" in line]
    assert "left" not in second and re.search(r"s elapsed, about \d+ s left$", third), lines


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (TP_MLP.replace("X = 2\nY = 4", "X = 4\nY = 4"), "needs 16 devices but 8 are available"),
        (TP_MLP.replace('kernel = "tp_mlp"', 'kernel = "tp_mlpp"'), "unknown kernel 'tp_mlpp'"),
        (TP_MLP.replace("B = 64", "B = 63"), "does not divide"),
        (SWEEP.replace("N = [1024, 4096, 16384]", "M = [1]"), r"\[run.sweep\].M sweeps a size"),
    ],
)
def test_bad_experiments(jax_devices, tmp_path, body, match):
    with pytest.raises(UserError, match=match):
        run_experiment(_experiment(tmp_path, body), str(tmp_path / "runs"), quiet=True, hardware="cpu")


def test_unwritable_run_directory_is_refused_before_jax_starts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = (
        "import sys\nfrom lab.cli.main import main\n"
        f"rc = main(['run', {_experiment(tmp_path, TP_MLP)!r}, '--out', {str(blocker)!r}])\n"
        "assert 'jax' not in sys.modules\nsys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr == f"shardlab: error: --out {str(blocker)!r}: cannot write into it (it is a file); give a folder you "
        "can write\n"
    )


def test_cli_run_bad_input_is_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "lab", "run", "missing.toml"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "experiment file 'missing.toml' does not exist" in r.stderr
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1 and "Traceback" not in r.stderr


def test_calibrate_on_an_accelerator_writes_that_device_kinds_spec(jax_devices, monkeypatch, tmp_path):
    # No accelerator here: make JAX report one, and check that calibrate measures it with the device-side path
    # (stubbed: its measurements are tested in test_calibrate_device.py) and writes specs/<backend>-<kind>.json.
    import argparse

    import jax

    from lab.cli.run import cmd_calibrate
    from lab.core.hardware import SPECS_DIR_ENV, get_chip
    from lab.measure import calibrate_device as cd

    monkeypatch.setenv(SPECS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    seen = {}

    def fake(mesh, quick, progress):
        seen["mesh"], seen["quick"] = mesh, quick
        prov = {"backend": "gpu", "device_kind": "NVIDIA H200", "device_count": 8, "date": "2026-11-30"}
        mm = [{"dtype": "bf16", "m": 1, "k": 1, "n": 1, "seconds": 1.0, "flops_per_s": 8e14}]
        mem = [{"op": "copy", "bytes": 4e12, "seconds": 1.0}]
        return cd.fitted_chip(get_chip("h200"), mm, mem, [], mesh, prov), ["one warning"]

    monkeypatch.setattr(cd, "calibrate_device", fake)
    args = argparse.Namespace(mesh=None, quick=True, quiet=True, json=False, out=None, force=False)
    data, text = cmd_calibrate(args)
    assert seen == {"mesh": {"X": 8}, "quick": True}  # every device in one axis by default
    assert data["path"].endswith("gpu-nvidia-h200.json") and (tmp_path / "gpu-nvidia-h200.json").is_file()
    assert data["peak_flops"]["bf16"] == 8e14 and data["warnings"] == ["one warning"]
    assert "800 TFLOP/s" in text and "h200 calibrated on 8 gpu devices" in text


def _get_json(url: str):
    import gzip

    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip" or body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
    return json.loads(body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensorboard_lists_the_run_and_its_trace(jax_devices, tmp_path):
    """Start TensorBoard with the profile plugin on loopback against a run's logdir and ask its HTTP API."""
    import tensorboard_plugin_profile  # noqa: F401  (installed by the dev extra; fails loudly if missing)

    result = run_experiment(_experiment(tmp_path, TP_MLP), str(tmp_path / "runs"), quiet=True, hardware="cpu")
    logdir = result.run_dir / "tensorboard"
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    proc = subprocess.Popen(
        [exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        runs = None
        while time.time() < deadline:
            try:
                plugins = _get_json(f"{base}/data/plugins_listing")
                if "profile" in plugins:
                    runs = _get_json(f"{base}/data/plugin/profile/runs")
                    if runs:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(1)
        assert runs, "TensorBoard never listed a profile run"
        run = runs[0]
        tools = _get_json(f"{base}/data/plugin/profile/run_tools?run={run}")
        assert any("trace" in t for t in tools), tools
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _refused(tmp_path, body: str, *flags: str) -> str:
    """Run through the command line; assert exit 2, one line, and nothing written; return the line."""
    import io
    from contextlib import redirect_stderr

    from lab.cli.main import main

    err = io.StringIO()
    out = tmp_path / "runs"
    with redirect_stderr(err):
        code = main(["run", _experiment(tmp_path, body), "--out", str(out), "--hardware", "cpu", "--quiet", *flags])
    (line,) = err.getvalue().strip().splitlines()
    assert code == 2 and not out.exists(), line
    return line


def test_sizes_too_big_for_the_host_are_refused_before_anything_is_allocated(jax_devices, tmp_path):
    """A typo in a size used to reach numpy (16 PiB) or XLA (std::bad_alloc) as a crash."""
    line = _refused(tmp_path, TP_MLP.replace("F = 512", "F = 34359738368"))  # 2**35: under the cap on any size
    assert "GiB per device" in line and "--compile-only compiles it anyway" in line
    # past 2**36 a size is refused as it is read, whatever the host
    line = _refused(tmp_path, TP_MLP.replace("F = 512", "F = 4398046511104"))
    assert ":11: tp_mlp: size F = 4398046511104 is past any machine" in line and "give at most 68719476736" in line
    # a sweep is checked point by point before its first point runs
    line = _refused(tmp_path, SWEEP.replace("N = [1024, 4096, 16384]", "N = [1024, 68719476736]"))
    assert "point N68719476736" in line and "GiB per device" in line


def test_a_plan_the_estimator_refuses_is_refused_by_run(jax_devices, tmp_path):
    """run used to carry on with a note (and without the memory check the estimate gives)."""
    train = (Path(__file__).resolve().parent.parent / "experiments" / "train_fsdp_tp.toml").read_text()
    line = _refused(tmp_path, train.replace('remat = "none"', 'remat = "none"\nmicrobatch = 3'))
    assert "the estimator cannot price this Plan" in line and "microbatch" in line


def test_the_compiled_programs_memory_is_checked_against_the_host(monkeypatch, capsys):
    from types import SimpleNamespace

    from lab.core.hardware import get_chip
    from lab.run import point

    stats = SimpleNamespace(
        argument_size_in_bytes=3 * 2**30, output_size_in_bytes=2**30, temp_size_in_bytes=0, alias_size_in_bytes=0
    )
    compiled = SimpleNamespace(memory_analysis=lambda: stats)
    plan = SimpleNamespace(name="exp")
    monkeypatch.setattr(point, "host_bytes_per_device", lambda: 2 * 2**30)
    with pytest.raises(UserError, match=r"needs 4 GiB per device .* this host has 2 GiB"):
        point._check_compiled_memory(plan, compiled, get_chip("h100"), compile_only=False)
    point._check_compiled_memory(plan, compiled, get_chip("h100"), compile_only=True)  # a warning only
    assert "shardlab: warning: exp: the compiled program needs 4 GiB" in capsys.readouterr().err
    monkeypatch.setattr(point, "host_bytes_per_device", lambda: None)  # on an accelerator: the chip's 80 GB
    point._check_compiled_memory(plan, compiled, get_chip("h100"), compile_only=False)


def test_the_trace_starts_after_the_plots_import_has_finished(jax_devices, tmp_path, monkeypatch):
    """JAX's profiler records every thread's Python calls: an import still running on the preload thread when the
    trace starts filled tp_mlp's trace with 60,000 import events (12x its size, 10x its parse time)."""
    import threading

    from lab.measure import profile
    from lab.report import plots

    done, seen = threading.Event(), []

    def slow_load():
        time.sleep(2.0)  # an import slower than compiling this program
        done.set()

    real_record = profile.record

    def record(*args, **kwargs):
        loading = any(t.name == "shardlab-preload-plots" and t.is_alive() for t in threading.enumerate())
        seen.append(done.is_set() and not loading)
        return real_record(*args, **kwargs)

    monkeypatch.setattr(plots, "_load", slow_load)
    monkeypatch.setattr(profile, "record", record)
    exp = str(Path(__file__).resolve().parent.parent / "experiments" / "sharded_matmul_case2.toml")
    run_experiment(exp, str(tmp_path), quiet=True, hardware="cpu", overrides={"warmup": 0, "repeats": 1})
    assert seen == [True]
