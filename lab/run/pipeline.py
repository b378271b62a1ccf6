"""``shardlab run``: one experiment end to end, every point of it, into a run directory nothing half-writes.

Each point goes through :func:`lab.run.point.run_point` (estimate, compile + audit, profile, join per op,
report). A sweep runs each combination into ``points/<label>/``. Each run writes ``runs/<id>/``: the experiment
file as run, ``env.json`` (jax/jaxlib versions, XLA flags, device kind and count, the lab's git commit),
``spec.json`` (the hardware spec used), ``hlo.txt``, ``tensorboard/`` (open with ``tensorboard --logdir
runs/<id>/tensorboard``; a Perfetto trace sits in it too), ``report.json``, ``report.md``, ``ops.csv`` and three
PNG plots. Runs and points are staged and moved into place complete; an interrupted sweep keeps the finished
points and ``--resume`` continues it. ``--compile-only`` stops after the audit (no profile), and turns a Plan
that does not fit the chip's memory from an error into a warning. As one of several processes
(:mod:`lab.run.distributed`) process 0 writes the run and the others ``<id>.rank<k>/`` beside it.
"""
# Over 500 lines on purpose: a run's lifecycle (lock, resume, sweep, atomic writes): the promise that nothing is
# half-written spans these functions.

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import Interrupted, UserError, interrupt_in, raise_if_interrupted
from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.core.table import dumps
from lab.run import distributed as dist
from lab.run import store
from lab.run.environment import MAX_EMULATED, Progress, ensure_devices, environment, require_devices, resolve_hardware
from lab.run.experiment import CALLS_AT_LEAST, WARMUP, Experiment, check_calls, load_experiment
from lab.run.overrides import describe, override, override_flags, scale_to_host
from lab.run.point import LARGE_BYTES, estimate_or_refuse, host_bytes_per_device, run_point
from lab.run.store import plain_name


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    report: dict[str, Any]
    files: tuple[str, ...]


def _point_summary(exp: Experiment, rid: str, points, reports, emulated: bool) -> dict[str, Any]:
    return {
        "experiment": exp.name,
        "run_id": rid,
        "points": [
            {
                "label": label,
                "sizes": r["sizes"],
                "step_time_measured_s": r["step_time_measured_s"],
                "step_time_predicted_s": r["step_time_predicted_s"],
                "step_time_estimated_s": r["step_time_estimated_s"],
                "coverage": r["coverage"],
                "median_ratio_large": r["summary"]["median_ratio_large"],
                "all_match": r["audit"]["all_match"],
                "trust": r["summary"].get("trust", {}).get("verdict"),
            }
            for (label, _), r in zip(points, reports, strict=True)
        ],
        "emulated": emulated,
    }


def _sweep_report(summary: dict[str, Any], run_dir: Path) -> None:
    """The sweep's own summary.md and sweep.png beside its points (each written whole or not at all)."""
    from lab.report import sweep

    store.write_atomic(run_dir / "summary.md", sweep.markdown(summary))
    tmp = run_dir / ".sweep.png.tmp.png"
    if sweep.save_figure(summary, tmp):
        tmp.replace(run_dir / "sweep.png")


def run_experiment(
    path: str,
    out: str = "runs",
    *,
    resume: bool = False,
    quiet: bool = False,
    hardware: str | None = None,
    hardware_file: str | None = None,
    run_id: str | None = None,
    compile_only: bool = False,
    devices: int | None = None,
    distributed: bool = False,
    target: str | None = None,
    overrides: dict[str, Any] | None = None,
    scale_to_host: bool = False,
) -> RunResult:
    """Run one experiment file (every sweep point) and write its reports; nothing half-written is left behind.

    As one of several processes (``distributed``, or detected: see :mod:`lab.run.distributed`) every process runs
    the same program over the global mesh and profiles its own devices; process 0 writes the report, with every
    process's step times and the ledger of the slowest, the others their traces and a small ``report.json``.

    Raises:
        UserError: a bad experiment, option or run directory (before anything is written where possible).
        Interrupted: Ctrl-C, saying what was kept and how to resume.
    """
    from lab.run.environment import process_age_s

    started = process_age_s()  # the process's start-up, apart from what this run does before its points
    progress = Progress(quiet)
    exp, changed = _experiment(path, hardware, overrides, compile_only)
    name = plain_name(run_id) if run_id else plain_name(exp.name, "[experiment].name")
    points = _checked_points(exp, scale_to_host, target)
    base = Path(out)
    chip_flags = _chip_flags(hardware, hardware_file)
    if resume:
        _check_resumable(base, name, path, bool(exp.sweep), changed, chip_flags, compile_only)
    _check_devices(devices, exp)
    store.check_out(base)  # before JAX starts or the host is calibrated
    if target is not None:
        return _run_for_target(exp, path, base, name, points, target, hardware, hardware_file, progress, compile_only)
    cluster = dist.detect(explicit=distributed)
    if cluster is not None and resume:
        raise UserError("--resume continues a run of one process; run the processes again without it")
    if cluster is None:
        ensure_devices(devices or exp.devices, exact=devices is not None)
    else:
        dist.initialize(cluster)
        _check_global_mesh(exp)
    require_devices(exp.mesh)
    env = environment()
    chip = resolve_hardware(
        exp.plan.hardware,
        env["backend"],
        env["device_kind"],
        hardware_file,
        progress,
        exp.mesh,
        cluster is None,
        env.get("device_memory_bytes"),
    )
    host = host_bytes_per_device()
    env["started_age_s"] = started
    env["chip_flags"] = chip_flags
    env["compile_only"] = compile_only  # a resume is held to it
    if changed:
        env["overrides"] = changed
    if scale_to_host:
        exp, points, env["scaled_to_host"] = _scale_to_host(exp, chip, host, env["backend"])
    for label, plan in points:  # a Plan that does not fit is refused before anything compiles
        try:
            estimate_or_refuse(plan, chip, compile_only, host_bytes=host)
        except UserError as exc:
            raise UserError(f"{exp.path}: point {label}: {exc}" if label else str(exc)) from None
    import jax

    ctx = _Context(exp, path, chip, env, progress, compile_only, jax.process_index(), jax.process_count())
    return _dispatch(ctx, base, name, points, resume)


def _checked_points(exp: Experiment, scale_to_host: bool, target: str | None) -> list[tuple[str, Plan]]:
    """The experiment's points, each checked for what the kernels need before JAX starts (and --scale-to-host
    refused where it cannot apply)."""
    if scale_to_host and (exp.sweep or target is not None):
        why = (
            "drop --target (a cross-compiled run needs no host memory)"
            if target
            else ("a sweep's points would scale differently: run one point (--sizes)")
        )
        raise UserError(f"--scale-to-host scales one Plan on this host; {why}")
    points = exp.points()
    for label, plan in points:
        try:
            plan.validate()
        except UserError as exc:
            raise UserError(f"{exp.path}: {label + ': ' if label else ''}{exc}") from None
    return points


def _experiment(path: str, hardware: str | None, overrides: dict[str, Any] | None, compile_only: bool):
    """The experiment as the command line changes it (``--hardware``, ``--mesh``, ``--sizes``, ``--dtype``,
    ``--model``, ``--warmup``, ``--repeats``), and the record of what changed."""
    exp = load_experiment(path)
    if hardware:
        exp = dataclasses.replace(exp, plan=dataclasses.replace(exp.plan, hardware=hardware))
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    calls = check_calls({k: overrides.pop(k) for k in CALLS_AT_LEAST if k in overrides}, compile_only)
    exp = dataclasses.replace(exp, **calls)
    if not overrides:
        return exp, dict(calls)
    try:
        plan, changed = override(exp.plan, **overrides)
    except UserError as exc:
        raise UserError(f"{exp.path}: {exc}") from None
    return dataclasses.replace(exp, plan=plan), changed | calls


def _check_devices(devices: int | None, exp: Experiment) -> None:
    """``--devices N``: emulable, and at least the mesh's."""
    if devices is not None and devices > MAX_EMULATED:
        raise UserError(
            f"--devices {devices}: at most {MAX_EMULATED} host devices can be emulated; give a smaller mesh"
        )
    if devices is not None and devices < exp.devices:
        raise UserError(
            f"--devices {devices} is fewer than the {exp.devices} devices of the mesh {exp.mesh}; "
            f"give --devices {exp.devices} or more, or leave it out"
        )


def _dispatch(ctx: _Context, base: Path, name: str, points, resume: bool) -> RunResult:
    """One point or a sweep, into the run directory; a directory that cannot be written is the user's to fix."""
    try:
        if not ctx.exp.sweep:
            return _run_single(ctx, base, name, resume)
        return _run_sweep(ctx, base, name, points, resume)
    except OSError as exc:
        raise UserError(
            f"cannot write the run directory under {str(base)!r}: {exc.strerror} ({exc.filename}); pass --out DIR"
        ) from None


def _run_for_target(
    exp: Experiment,
    path: str,
    base: Path,
    name: str,
    points,
    target: str,
    hardware,
    hardware_file,
    progress,
    compile_only,
) -> RunResult:
    """``--compile-only --target v5e:2x4``: every point compiled for a TPU topology that is not here (nothing
    runs), audited, and reported with XLA's memory and cost analyses beside the lab's predictions."""
    from lab.compile.target import parse_target, quiet_absent_tpu, require_compiler
    from lab.core.hardware import default_catalog

    topology = parse_target(target)
    if not compile_only:
        raise UserError(
            f"--target {topology.name} compiles for {topology.backend.upper()} chips that are not here; add "
            "--compile-only"
        )
    for label, plan in points:
        if plan.devices != topology.chips:
            raise UserError(
                f"{exp.path}: {label + ': ' if label else ''}the mesh {plan.shape} has {plan.devices} devices and "
                f"{topology.name} has {topology.chips} chips; give a topology of {plan.devices} chips"
            )
    require_compiler(topology)
    chip = default_catalog(hardware_file).get(hardware or topology.chip)
    for label, plan in points:
        if plan.dtype not in chip.peak_flops:
            raise UserError(
                f"{exp.path}: {label + ': ' if label else ''}{chip.name} has no {plan.dtype} peak; set dtype = "
                '"bfloat16" in the experiment (TPUs multiply in bf16) or price with --hardware NAME'
            )
    if topology.backend == "tpu":
        quiet_absent_tpu()
    env = environment() | {
        "backend": topology.backend,
        "device_kind": topology.device_kind,
        "device_count": topology.chips,
        "compiled_for": topology.to_dict(),
    }
    return _dispatch(_Context(exp, path, chip, env, progress, True, target=topology), base, name, points, False)


# --scale-to-host: what "fits this host" means. XLA:CPU holds up to about 3x the estimator's bytes at small sizes
# (its temporaries; the toy train step's audit: 2.98x), so the estimate gets a quarter of the host's share; and
# a step should take seconds, not hours, on this host's calibration, or the profile's repeats never finish.
HOST_MEMORY_SHARE = 0.25
HOST_STEP_S = 2.0


def _scale_to_host(exp: Experiment, chip: Chip, host: float | None, backend: str):
    """``--scale-to-host``: on emulated devices, the Plan divided until the estimator's memory per device fits
    the host's share (unchanged when it fits already), said on stderr whatever --quiet says, and recorded."""
    from lab.predict.program.estimate import estimate_program

    if backend != "cpu" or host is None:
        raise UserError(f"--scale-to-host scales a Plan down for emulated CPU devices; this run is on {backend}")

    def fits(plan) -> bool:
        try:
            est = estimate_program(plan, chip)
        except UserError:
            return False
        return bool(est.memory) and est.memory["total"] <= host * HOST_MEMORY_SHARE and est.step_time_s <= HOST_STEP_S

    if fits(exp.plan):
        record = {"factor": 1, "fields": {}}
        print(f"shardlab: note: --scale-to-host: {exp.name} fits this host as it is; not scaled", file=sys.stderr)
    else:
        plan, record = scale_to_host(exp.plan, fits)
        exp = dataclasses.replace(exp, plan=plan)
        print(f"shardlab: note: {exp.name}: {describe(record)}", file=sys.stderr)
    return exp, exp.points(), record


def _check_global_mesh(exp: Experiment) -> None:
    """Several processes run one mesh over all their devices: it must use every one of them."""
    import jax

    have, procs = jax.device_count(), jax.process_count()
    if have != exp.devices:
        raise UserError(
            f"the mesh {exp.mesh} of {exp.path} has {exp.devices} devices but the {procs} processes have {have} "
            f"({jax.local_device_count()} each); give the mesh {have} devices, or each process "
            f"{exp.devices / procs:g} ({dist.LOCAL_DEVICES} or the accelerators per host)"
        )


@dataclass(frozen=True)
class _Context:
    exp: Experiment
    path: str
    chip: Chip
    env: dict[str, Any]
    progress: Callable[[str], None]
    compile_only: bool
    rank: int = 0
    processes: int = 1
    target: Any = None  # a lab.compile.target.Target compiled for ahead of time (nothing runs)

    def name(self, base: Path, wanted: str) -> str:
        """The run's name, chosen by process 0 and agreed by all; other processes write beside it."""
        chosen = store.free_name(base, wanted) if self.rank == 0 else ""
        if self.processes > 1:
            chosen = dist.agree(chosen)
        return chosen if self.rank == 0 else f"{chosen}.rank{self.rank}"


def _chip_flags(hardware: str | None, hardware_file: str | None) -> dict[str, str]:
    """The chip a run is priced for, as the command line chose it: a sweep resumed for another would mix two in one
    table. A catalog name or alias as the catalog names it (``H100``, ``h100-sxm``: ``h100``), a file by its whole
    path; a name the catalog does not know as given (refused later, where the chip is looked up)."""
    flags: dict[str, str] = {}
    if hardware:
        from lab.core.hardware import default_catalog

        try:
            flags["hardware"] = default_catalog(hardware_file).resolve(hardware)
        except UserError:
            flags["hardware"] = hardware
    if hardware_file:
        flags["hardware-file"] = str(Path(hardware_file).resolve())
    return flags


def _run_flags(chip_flags: dict[str, str], changed: dict[str, Any]) -> str:
    """The options a run was started with, as flags (what a resume must repeat): the chip's, then the Plan's."""
    return override_flags(chip_flags | changed)


def _check_resumable(
    base: Path,
    name: str,
    path: str,
    sweep: bool,
    changed: dict[str, Any],
    chip_flags: dict[str, str],
    compile_only: bool = False,
) -> None:
    run_dir = base / name
    if not run_dir.is_dir():
        raise UserError(f"no run {name!r} under {str(base)!r} to resume; start it without --resume (or pass --run-id)")
    kept = run_dir / "experiment.toml"
    if kept.is_file() and kept.read_bytes() != Path(path).read_bytes():
        raise UserError(
            f"run {str(run_dir)!r} was started from another version of {path}; resume with the same file, or start "
            "a new run without --resume"
        )
    env = store.read_record(run_dir / "env.json") if (run_dir / "env.json").is_file() else {}
    if env and env.get("compile_only", compile_only) != compile_only:
        raise UserError(
            f"run {str(run_dir)!r} was started {'with' if env['compile_only'] else 'without'} --compile-only; resume "
            "it the same way, or start a new run without --resume"
        )
    started = env.get("overrides", {}) if env else changed
    # chip_flags: recorded since 2026-12-01; a run from before is not checked for them
    started_chip = env.get("chip_flags", chip_flags) if env else chip_flags
    if (started_chip, started) != (chip_flags, changed):  # the points still to run: another program or chip
        was = _run_flags(started_chip, started) or "no changes"
        now = _run_flags(chip_flags, changed) or "none"
        raise UserError(
            f"run {str(run_dir)!r} was started with {was}; resume with the same options (not {now}), or start a new "
            "run without --resume"
        )
    if not sweep and not store.is_complete(run_dir):
        raise UserError(f"{str(run_dir)!r} is not a finished run of {path}; start it again without --resume")


def _provenance(ctx: _Context, directory: Path) -> None:
    shutil.copyfile(ctx.path, directory / "experiment.toml")
    (directory / "env.json").write_text(json.dumps(ctx.env, indent=2))
    (directory / "spec.json").write_text(dumps(ctx.chip.to_dict()))


def _run_single(ctx: _Context, base: Path, name: str, resume: bool) -> RunResult:
    """One point: staged in a hidden directory and moved into place, complete, at the end."""
    if resume:  # _check_resumable found it complete
        ctx.progress(f"{base / name} is complete already: nothing to do")
        report = json.loads((base / name / "report.json").read_text())
        return RunResult(base / name, report, tuple(sorted(p.name for p in (base / name).iterdir())))
    final = base / ctx.name(base, name)
    tmp = store.staging(final)
    try:
        if ctx.rank == 0:
            _provenance(ctx, tmp)
        report = run_point(
            ctx.exp,
            ctx.exp.plan,
            tmp,
            ctx.chip,
            ctx.progress,
            ctx.env,
            compile_only=ctx.compile_only,
            final_dir=final,
            target=ctx.target,
        )
        store.mark_complete(tmp)
        final = _commit_run(tmp, final, report)
    except BaseException as exc:
        store.discard(tmp)
        if interrupt_in(exc) is not None:
            raise Interrupted(f"the run had not finished and nothing was kept; run {ctx.path} again") from None
        raise
    return RunResult(final, report, tuple(sorted(p.name for p in final.iterdir())))


def _commit_run(tmp: Path, final: Path, report: dict[str, Any]) -> Path:
    """Move a finished run into place under a name nobody took meanwhile (a run started at the same moment)."""
    from lab.report import writer

    while True:
        try:
            os.rename(tmp, final)
            return final
        except OSError:
            if not final.exists():
                raise
            moved = final.parent / store.free_name(final.parent, final.name)
            for key in ("tensorboard", "perfetto_trace"):
                if report.get(key):
                    report[key] = str(moved / Path(report[key]).relative_to(final))
            report["run_id"] = moved.name
            if "ops" in report:
                writer.write_reports(report, tmp)
            else:  # another process's small report
                (tmp / "report.json").write_text(dumps(report))
            final = moved


def _say_waiting(text: str) -> None:
    print(f"shardlab: note: {text}", file=sys.stderr, flush=True)


def _run_sweep(ctx: _Context, base: Path, name: str, points, resume: bool) -> RunResult:
    """Every point staged and moved into ``points/<label>/`` when complete, under the run's lock."""
    run_dir = base / name if resume else store.reserve(base, ctx.name(base, name))
    created = not resume
    if (
        resume
        and (run_dir / "sweep.json").is_file()
        and all(store.is_complete(run_dir / "points" / lb) for lb, _ in points)
    ):
        ctx.progress(f"{run_dir} is complete already: nothing to do")
        summary = store.read_record(run_dir / "sweep.json")
        return RunResult(
            run_dir, summary, tuple(sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")))
        )
    reports: dict[str, dict[str, Any]] = {}
    try:
        with store.RunLock(run_dir, wait=_say_waiting if resume else None):  # two resumes take turns
            if created and ctx.rank == 0:
                _provenance(ctx, run_dir)
            started, ran = time.perf_counter(), 0
            for i, (label, plan) in enumerate(points, start=1):
                point = run_dir / "points" / label
                if store.is_complete(point):
                    ctx.progress(f"{label}: done already, kept")
                    reports[label] = json.loads((point / "report.json").read_text())
                    continue
                if len(points) > 1 and hasattr(ctx.progress, "point"):
                    ctx.progress.point(i, len(points), label, started, ran)
                ran += 1
                tmp = store.staging(point)
                try:
                    reports[label] = run_point(
                        ctx.exp,
                        plan,
                        tmp,
                        ctx.chip,
                        ctx.progress,
                        ctx.env,
                        compile_only=ctx.compile_only,
                        final_dir=point,
                        target=ctx.target,
                    )
                    store.mark_complete(tmp)
                    store.commit(tmp, point)
                    raise_if_interrupted()  # the point is kept; the next one does not start
                finally:
                    store.discard(tmp if tmp.exists() else None)
            summary = (
                _point_summary(
                    ctx.exp, run_dir.name, points, [reports[label] for label, _ in points], ctx.env["backend"] == "cpu"
                )
                if ctx.rank == 0
                else {"experiment": ctx.exp.name, "run_id": run_dir.name, "rank": ctx.rank}
            )
            store.write_atomic(run_dir / "sweep.json", dumps(summary))
            if ctx.rank == 0:
                _sweep_report(summary, run_dir)
    except UserError:
        if created and not reports:  # a run that fails before any point finished leaves nothing behind
            store.discard(run_dir)
        raise
    except BaseException as exc:
        if interrupt_in(exc) is None:
            raise
        flags = _run_flags(ctx.env.get("chip_flags", {}), ctx.env.get("overrides", {}))
        raise Interrupted(
            f"{len(reports)} of {len(points)} points are complete in {run_dir}; continue with "
            f"`shardlab run {ctx.path} --resume --run-id {run_dir.name}{' ' + flags if flags else ''}` (with the "
            "same --out)"
        ) from None
    return RunResult(run_dir, summary, tuple(sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("."))))


__all__ = ["LARGE_BYTES", "WARMUP", "RunResult", "ensure_devices", "run_experiment", "run_point"]
