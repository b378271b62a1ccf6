"""``shardlab run``: predict, compile and audit, profile, parse, join, report: one experiment end to end.

Each run writes ``runs/<id>/``: the experiment file as run, ``env.json`` (jax/jaxlib versions, XLA
flags, device kind and count, the lab's git commit), ``spec.json`` (the hardware spec used), ``hlo.txt``,
``tensorboard/`` (open with ``tensorboard --logdir runs/<id>/tensorboard``; a Perfetto trace sits in it
too), ``report.json``, ``report.md``, ``ops.csv`` and three PNG plots. A ``[sweep]`` table runs every
point into ``points/<label>/``; an interrupted sweep keeps the finished points and ``--resume``
continues it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip, default_catalog, specs_dir
from lab.core.table import dumps
from lab.run.experiment import Experiment, load_experiment

LARGE_BYTES = 1_000_000  # the "ops of at least 1 MB" the acceptance criteria talk about
# Untraced calls before the profiled ones when an experiment does not say. In a fresh process XLA:CPU's first
# several calls of a program run slower (measured on 2 cores: a 1 MB AllReduce, slowest device, took 1.8-2.8 ms
# in the first traced steps after one warm-up call and 0.53-0.61 ms after ten or thirty; see
# docs/validation/cpu-emulated.md), so one warm-up call is not enough.
WARMUP = 10
DEVICE_KIND_TO_CHIP = {
    "h200": "h200",
    "h100": "h100",
    "a100": "a100-80gb",
    "b200": "b200",
    "tpu v5 lite": "tpu-v5e",
    "tpu v5e": "tpu-v5e",
    "tpu v5p": "tpu-v5p",
    "tpu v5": "tpu-v5p",
    "tpu v4": "tpu-v4",
    "tpu v6": "tpu-v6e",
    "tpu v3": "tpu-v3",
}


class Progress:
    """One line per phase on stderr with the elapsed time (``quiet`` turns it off)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def ensure_devices(n: int) -> None:
    """Emulate ``n`` host devices when JAX has not started yet and the user set no count."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(8, n)}".strip()


def resolve_hardware(
    name: str,
    backend: str,
    device_kind: str,
    hardware_file: str | None,
    progress: Callable[[str], None],
    mesh: dict[str, int],
) -> Chip:
    """``calibrated`` (default): this backend's calibration (calibrating the host first on CPU when none
    exists); otherwise a catalog name."""
    catalog = default_catalog(hardware_file)
    if name != "calibrated":
        return catalog.get(name)
    spec = specs_dir() / f"{backend}.json"
    if backend == "cpu":
        chip = catalog.get("cpu")
        if chip.calibrated:
            return chip
        progress(f"no calibration for this host in {spec}: calibrating first (quick)")
        from lab.measure.calibrate import calibrate, write_spec

        cal = calibrate(mesh, quick=True, progress=progress)
        path = write_spec(cal)
        progress(f"wrote {path}")
        return default_catalog(hardware_file).get("cpu")
    if spec.is_file():
        from lab.core.hardware import load_hardware_file

        return load_hardware_file(spec, catalog)[0]
    kind = device_kind.lower()
    for key, chip_name in DEVICE_KIND_TO_CHIP.items():
        if key in kind:
            progress(
                f"no calibration for {backend}; pricing with the catalog's {chip_name} (device kind {device_kind!r})"
            )
            return catalog.get(chip_name)
    raise UserError(
        f"no calibration for backend {backend!r} (device kind {device_kind!r}) and no catalog match; "
        f'run `shardlab calibrate` or set hardware = "<catalog name>" in the experiment'
    )


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    import jax
    import jaxlib

    devs = jax.devices()
    import lab.measure.trace  # noqa: F401  (installs the filter for the profile plugin's import-time log line)

    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
    for mod in ("libtpu", "xprof", "tensorboard_plugin_profile"):
        with contextlib.suppress(ImportError, AttributeError):
            versions[mod] = __import__(mod).__version__
    return {
        "versions": versions,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "host": platform.node(),
        "lab_commit": _git_commit(),
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    report: dict[str, Any]
    files: tuple[str, ...]


def _sweep_points(exp: Experiment) -> list[tuple[str, dict[str, int]]]:
    sweep = exp.run.get("sweep") or {}
    if not sweep:
        return [("", dict(exp.sizes))]
    keys = list(sweep)
    for k in keys:
        if k not in exp.sizes:
            raise UserError(
                f"{exp.path}: [run.sweep].{k} sweeps a size the experiment does not have ({', '.join(exp.sizes)})"
            )
        if not isinstance(sweep[k], list) or not all(isinstance(v, int) and v > 0 for v in sweep[k]):
            raise UserError(f"{exp.path}: [run.sweep].{k} must be a list of positive integers")
    out = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        sizes = dict(exp.sizes) | dict(zip(keys, combo, strict=True))
        out.append(("-".join(f"{k}{v}" for k, v in zip(keys, combo, strict=True)), sizes))
    return out


MODEL_KERNELS = ("train_step", "decode")


def _build_model(exp: Experiment, sizes: dict[str, int], mesh: dict[str, int], progress):
    """The JAX Transformer's train step or greedy decode, its HLO and (train step) its audit."""
    from kernels import transformer as tf

    fields = dict(exp.model) | {"compute_dtype": "bfloat16" if exp.dtype == "bf16" else "float32"}
    try:
        cfg = tf.TransformerConfig(**fields)
    except TypeError as exc:
        raise UserError(f"{exp.path}: [model] {exc}") from None
    rules = str(exp.run.get("rules", "fsdp_tp"))
    if exp.kernel == "train_step":
        remat = str(exp.run.get("remat", "none"))
        for key in ("batch", "seq"):
            if key not in sizes:
                raise UserError(f"{exp.path}: [sizes] needs {key} for a train_step")
        step, args = tf.build_train(cfg, rules, mesh, sizes["batch"], sizes["seq"], remat)
        progress("compiling and auditing against the training estimator")
        hlo = step.lower(*args).compile().as_text()
        from lab.compile.model_audit import audit_train

        audit = audit_train(cfg, rules, mesh, sizes["batch"], sizes["seq"], remat).to_dict()
        state = {"args": args}

        def one_step():  # parameters and optimizer state are donated: carry them from step to step
            params, opt_state, loss = step(*state["args"])
            state["args"] = (params, opt_state, state["args"][2])
            return loss

        return one_step, (), hlo, audit
    for key in ("batch", "prompt_len", "steps"):
        if key not in sizes:
            raise UserError(f"{exp.path}: [sizes] needs {key} for decode")
    fn, args = tf.build_decode(cfg, rules, mesh, sizes["batch"], sizes["prompt_len"], sizes["steps"])
    progress("compiling (decode has no plan-level audit yet)")
    hlo = fn.lower(*args).compile().as_text()
    return fn, args, hlo, {"all_match": None, "note": "no plan-level prediction for decode: ledger only"}


def run_point(
    exp: Experiment,
    sizes: dict[str, int],
    out_dir: Path,
    chip: Chip,
    progress: Callable[[str], None],
    env: dict[str, Any],
) -> dict[str, Any]:
    """Compile + audit, profile, parse and join one (experiment, sizes) point; write its report."""

    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel
    from lab.compile.audit import audit_compiled, predict
    from lab.measure import trace
    from lab.report import ledger
    from lab.report import writer as report

    mesh = dict(exp.mesh)
    if exp.kernel in MODEL_KERNELS:
        progress(f"{exp.name} {sizes}: building the Transformer {exp.kernel} on mesh {mesh}")
        fn, args, hlo_text, audit_dict = _build_model(exp, sizes, mesh, progress)
    else:
        kernel = get_kernel(exp.kernel)
        if exp.kernel.startswith(("sharded_matmul", "collective_matmul", "matmul_", "tp_mlp")) and "Y" not in mesh:
            mesh["Y"] = 1
        progress(f"{exp.name} {sizes}: building on mesh {mesh}")
        built = kernel.build(make_mesh(mesh), sizes, exp.dtype, exp.axes)
        progress("compiling and auditing")
        compiled = built.fn.lower(*built.args).compile()
        predicted, flops = predict(kernel, mesh, sizes, exp.dtype, exp.axes)
        audit = audit_compiled(exp.kernel, compiled, predicted, flops, mesh, sizes, exp.dtype, env["backend"])
        fn, args, hlo_text, audit_dict = built.fn, built.args, audit.hlo_text, audit.to_dict()
    (out_dir / "hlo.txt").write_text(hlo_text)
    ops_pred = ledger.predict_ops(hlo_text, chip, mesh)

    warmup = int(exp.run.get("warmup", WARMUP))
    repeats = int(exp.run.get("repeats", 5))
    logdir = out_dir / "tensorboard"
    progress(f"profiling {repeats} repeats after {warmup} warm-up")
    files = trace.record(fn, args, str(logdir), warmup=warmup, repeats=repeats)
    progress("parsing the trace")
    tr = trace.parse(files, hlo_names={p.name for p in ops_pred})
    stats = tr.per_op()
    measured = {name: s.median_self_s for name, s in stats.items()}
    rows, coverage = ledger.join(ops_pred, measured)
    row_dicts = [r.to_dict() for r in rows]
    large = [
        r.ratio
        for r in rows
        if r.ratio is not None
        and r.kind != "other"
        and max(r.bytes, r.collective_bytes) >= LARGE_BYTES
        and r.kind not in ("elementwise",)
    ]
    steps = tr.step_times()
    report_data = {
        "experiment": exp.name,
        "run_id": out_dir.name if out_dir.parent.name != "points" else f"{out_dir.parent.parent.name}/{out_dir.name}",
        "kernel": exp.kernel,
        "mesh": mesh,
        "sizes": sizes,
        "dtype": exp.dtype,
        "backend": env["backend"],
        "emulated": env["backend"] == "cpu",
        "devices": env["device_count"],
        "hardware": chip.to_dict(),
        "ops": row_dicts,
        "coverage": coverage,
        "step_time_measured_s": report.median(steps) if steps else None,
        "step_time_predicted_s": sum(r.predicted_s or 0.0 for r in rows),
        "breakdown": report.breakdown(row_dicts),
        "summary": {
            "median_ratio_large": report.median(large),
            "ops_large": len(large),
            "ops": len(rows),
            "repeats": repeats,
            "warmup": warmup,
        },
        "audit": audit_dict,
        "tensorboard": str(logdir),
        "perfetto_trace": files.perfetto,
    }
    written = report.write_all(report_data, out_dir)
    progress(f"wrote {', '.join(written)} to {out_dir}")
    return report_data


def run_experiment(
    path: str,
    out: str = "runs",
    *,
    resume: bool = False,
    quiet: bool = False,
    hardware: str | None = None,
    hardware_file: str | None = None,
    run_id: str | None = None,
) -> RunResult:
    """Run one experiment file (every sweep point) and write its reports."""
    progress = Progress(quiet)
    exp = load_experiment(path)
    ensure_devices(exp.devices)
    import jax

    if jax.device_count() < exp.devices:
        raise UserError(
            f"mesh {','.join(f'{k}={v}' for k, v in exp.mesh.items())} needs {exp.devices} devices but "
            f"{jax.device_count()} are available; on a host set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={exp.devices}"
        )
    env = environment()
    chip = resolve_hardware(
        hardware or exp.hardware, env["backend"], env["device_kind"], hardware_file, progress, exp.mesh
    )
    base = Path(out)
    rid = run_id or exp.name
    run_dir = base / rid
    if run_dir.exists() and not resume:
        rid = f"{exp.name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        run_dir = base / rid
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, run_dir / "experiment.toml")
        (run_dir / "env.json").write_text(json.dumps(env, indent=2))
        (run_dir / "spec.json").write_text(dumps(chip.to_dict()))
    except OSError as exc:
        raise UserError(f"cannot write the run directory {str(run_dir)!r}: {exc.strerror}; pass --out DIR") from None

    points = _sweep_points(exp)
    reports = []
    for label, sizes in points:
        point_dir = run_dir / "points" / label if label else run_dir
        done = point_dir / "report.json"
        if label and resume and done.is_file():
            progress(f"{label}: already done, skipped (--resume)")
            reports.append(json.loads(done.read_text()))
            continue
        point_dir.mkdir(parents=True, exist_ok=True)
        reports.append(run_point(exp, sizes, point_dir, chip, progress, env))
    if len(points) == 1 and not points[0][0]:
        return RunResult(run_dir, reports[0], tuple(sorted(p.name for p in run_dir.iterdir())))
    summary = {
        "experiment": exp.name,
        "run_id": rid,
        "points": [
            {
                "label": label,
                "sizes": r["sizes"],
                "step_time_measured_s": r["step_time_measured_s"],
                "step_time_predicted_s": r["step_time_predicted_s"],
                "coverage": r["coverage"],
                "median_ratio_large": r["summary"]["median_ratio_large"],
                "all_match": r["audit"]["all_match"],
            }
            for (label, _), r in zip(points, reports, strict=True)
        ],
        "emulated": env["backend"] == "cpu",
    }
    (run_dir / "sweep.json").write_text(dumps(summary))
    return RunResult(run_dir, summary, tuple(sorted(p.name for p in run_dir.iterdir())))
