"""``shardlab run``: one experiment end to end, the three truths of one Plan joined per op.

For every point of the experiment (a sweep runs each combination into ``points/<label>/``): **estimate** the
Plan with the estimators users plan with (:mod:`lab.predict.program`); **compile** its program once, from abstract
arguments, and audit the HLO against that estimate; price every compiled op with the roofline (the ledger's
``predicted``); **profile** warm-up plus repeats of the same compiled executable under ``jax.profiler`` and parse
per-op times; **join** estimated | predicted | compiled | measured per op and write the reports.

Each run writes ``runs/<id>/``: the experiment file as run, ``env.json`` (jax/jaxlib versions, XLA flags, device
kind and count, the lab's git commit), ``spec.json`` (the hardware spec used), ``hlo.txt``, ``tensorboard/``
(open with ``tensorboard --logdir runs/<id>/tensorboard``; a Perfetto trace sits in it too), ``report.json``,
``report.md``, ``ops.csv`` and three PNG plots. An interrupted sweep keeps the finished points and ``--resume``
continues it. ``--compile-only`` stops after the audit (no profile), and turns a Plan that does not fit the
chip's memory from an error into a warning.
"""

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

from lab.core.errors import Interrupted, UserError
from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.core.table import dumps
from lab.predict.program import ProgramEstimate, estimate_program, memory_warning
from lab.report.plots import BAND
from lab.run import store
from lab.run.environment import Progress, ensure_devices, environment, require_devices, resolve_hardware
from lab.run.experiment import WARMUP, Experiment, load_experiment
from lab.run.store import plain_name

LARGE_BYTES = 1_000_000  # the "ops of at least 1 MB" the acceptance criteria talk about


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    report: dict[str, Any]
    files: tuple[str, ...]


def _estimate(plan: Plan, chip: Chip, compile_only: bool) -> tuple[ProgramEstimate | None, str | None]:
    """The Plan's estimate, or a note saying why there is none; a Plan that does not fit is refused here, before
    anything compiles (a warning under ``--compile-only``)."""
    try:
        est = estimate_program(plan, chip)
    except UserError as exc:
        return None, f"no estimate: {exc}"
    warning = memory_warning(plan, est, chip)
    if warning and not compile_only:
        raise UserError(warning + " (--compile-only compiles it anyway)")
    if warning:
        print(f"shardlab: warning: {warning}", file=sys.stderr)
    return est, None


def _compile_and_audit(plan: Plan, est: ProgramEstimate | None, env: dict[str, Any], progress, clock: _Clock):
    """Build the program (and place its inputs), compile it once from abstract arguments, audit the HLO against
    the estimate."""
    from kernels.registry import build
    from lab.compile.audit import audit_compiled

    progress(f"{plan.name} {dict(plan.sizes)}: building {plan.program} on mesh {plan.shape}")
    built = build(plan)
    built.args  # noqa: B018  (placed now, so that build_s holds it and profile_s only the profile)
    clock.lap("build_s")
    progress("compiling (abstract arguments) and auditing against the estimate")
    compiled = built.fn.lower(*built.abstract).compile()
    if est is None:
        return built, compiled, {"all_match": None, "note": "no estimate of this Plan: ledger only"}
    return built, compiled, audit_compiled(plan, compiled, est, env["backend"]).to_dict()


def _summary(rows: list[dict[str, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    from lab.report import writer as report

    large = [
        r["ratio"]
        for r in rows
        if r["ratio"] is not None
        and r["kind"] not in ("other", "elementwise")
        and max(r["bytes"], r["collective_bytes"]) >= LARGE_BYTES
    ]
    spreads = [
        r["spread"]
        for r in rows
        if r.get("spread")
        and r["kind"] not in ("other", "elementwise")
        and max(r["bytes"], r["collective_bytes"]) >= LARGE_BYTES
    ]
    spread = report.median(spreads)
    return {
        "median_ratio_large": report.median(large),
        "ops_large": len(large),
        "ops": len(rows),
        "repeats": repeats,
        "warmup": warmup,
        "spread_large": spread,
        # one trace's repeats disagree by more than the band a ratio is judged by: read its ratios as noise
        "unsteady": spread is not None and spread > BAND[1] / BAND[0],
    }


class _Clock:
    """Seconds per phase of one point (``timings`` in its report)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.t
        self.t = now


@dataclass(frozen=True)
class _Measured:
    """What one profile gave: its files, per-op medians and spreads, step times, and the host's other load."""

    files: Any = None
    medians: dict[str, float] = dataclasses.field(default_factory=dict)
    spreads: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: list[float] = dataclasses.field(default_factory=list)
    host_load: float | None = None


def _measure(exp: Experiment, built, compiled, out_dir: Path, names: set[str], progress, clock: _Clock) -> _Measured:
    """Profile the compiled executable (the host's other load sampled meanwhile) and parse its trace."""
    from lab.measure import trace
    from lab.measure.microbench import HostLoad

    progress(f"profiling {exp.repeats} repeats after {exp.warmup} warm-up")
    with HostLoad() as load:
        files = trace.record(
            built.runner(compiled), (), str(out_dir / "tensorboard"), warmup=exp.warmup, repeats=exp.repeats
        )
    clock.lap("profile_s")
    progress("parsing the trace")
    per_op = (stats := trace.parse(files, hlo_names=names)).per_op()
    return _Measured(
        files,
        {name: s.median_self_s for name, s in per_op.items()},
        {name: s.spread for name, s in per_op.items()},
        stats.step_times(),
        load.others,
    )


def run_point(
    exp: Experiment,
    plan: Plan,
    out_dir: Path,
    chip: Chip,
    progress: Callable[[str], None],
    env: dict[str, Any],
    *,
    compile_only: bool = False,
    final_dir: Path | None = None,
) -> dict[str, Any]:
    """Estimate, compile + audit, profile, parse and join one Plan; write its report into ``out_dir``.

    ``final_dir`` is where ``out_dir`` will be moved when it is complete (its paths are the ones the report names).
    """
    from lab.report import ledger
    from lab.report import writer as report

    final_dir = final_dir or out_dir
    clock = _Clock()
    est, note = _estimate(plan, chip, compile_only)
    built, compiled, audit = _compile_and_audit(plan, est, env, progress, clock)
    hlo_text = compiled.as_text()
    (out_dir / "hlo.txt").write_text(hlo_text)
    ops_pred = ledger.predict_ops(hlo_text, chip, plan.shape)
    clock.lap("compile_s")
    m = _Measured()
    if not compile_only:
        m = _measure(exp, built, compiled, out_dir, {p.name for p in ops_pred}, progress, clock)
    files = m.files
    rows, coverage = ledger.join(ops_pred, m.medians, m.spreads)
    named, est_coverage = [], None
    if est is not None:
        rows, named, est_coverage = ledger.join_estimates(rows, est, audit.get("entries", []))
    row_dicts = [r.to_dict() for r in rows]
    clock.lap("parse_s")
    data = {
        "experiment": exp.name,
        "run_id": _run_id(final_dir),
        "kernel": plan.program,
        "mesh": plan.shape,
        "sizes": dict(plan.sizes),
        "dtype": plan.dtype,
        "backend": env["backend"],
        "emulated": env["backend"] == "cpu",
        "devices": env["device_count"],
        "hardware": chip.to_dict(),
        "plan": plan.to_dict(),
        "compile_only": compile_only,
        "ops": row_dicts,
        "estimated_ops": named,
        "coverage": coverage,
        "estimate_coverage": est_coverage,
        "step_time_measured_s": report.median(m.steps) if m.steps else None,
        "step_time_predicted_s": sum(r.predicted_s or 0.0 for r in rows),
        "step_time_estimated_s": est.step_time_s if est is not None else None,
        "estimate": est.to_dict() if est is not None else {"note": note},
        "breakdown": report.breakdown(row_dicts, named),
        "summary": _summary(row_dicts, exp.warmup, exp.repeats) | {"host_load": m.host_load},
        "audit": audit,
        "tensorboard": str(final_dir / "tensorboard") if files else None,
        "perfetto_trace": str(final_dir / Path(files.perfetto).relative_to(out_dir))
        if files and files.perfetto
        else None,
    }
    written = report.write_all(data, out_dir, timings=lambda: _timings(clock))
    progress(f"wrote {', '.join(written)}")
    return data


def _timings(clock: _Clock) -> dict[str, float | None]:
    """Seconds per phase; ``startup_s`` is the process's age when the point started, ``total_s`` its age now."""
    from lab.run.environment import process_age_s

    clock.lap("report_s")
    out: dict[str, float | None] = {
        k: clock.phases.get(k, 0.0) for k in ("build_s", "compile_s", "profile_s", "parse_s", "report_s")
    }
    age = process_age_s()
    phases = sum(v for v in out.values() if v is not None)
    out["startup_s"] = None if age is None else max(0.0, age - phases)
    out["total_s"] = age
    return out


def _run_id(point_dir: Path) -> str:
    return point_dir.name if point_dir.parent.name != "points" else f"{point_dir.parent.parent.name}/{point_dir.name}"


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
            }
            for (label, _), r in zip(points, reports, strict=True)
        ],
        "emulated": emulated,
    }


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
) -> RunResult:
    """Run one experiment file (every sweep point) and write its reports; nothing half-written is left behind.

    Raises:
        UserError: a bad experiment, option or run directory (before anything is written where possible).
        Interrupted: Ctrl-C, saying what was kept and how to resume.
    """
    progress = Progress(quiet)
    exp = load_experiment(path)
    if hardware:
        exp = dataclasses.replace(exp, plan=dataclasses.replace(exp.plan, hardware=hardware))
    name = plain_name(run_id) if run_id else plain_name(exp.name, "[experiment].name")
    points = exp.points()
    for label, plan in points:  # every point checked for what the kernels need, before JAX starts
        try:
            plan.validate()
        except UserError as exc:
            raise UserError(f"{exp.path}: {label + ': ' if label else ''}{exc}") from None
    base = Path(out)
    if resume:
        _check_resumable(base, name, path, bool(exp.sweep))
    if devices is not None and devices < exp.devices:
        raise UserError(
            f"--devices {devices} is fewer than the {exp.devices} devices of the mesh {exp.mesh}; "
            f"give --devices {exp.devices} or more, or leave it out"
        )
    ensure_devices(devices or exp.devices, exact=devices is not None)
    require_devices(exp.mesh)
    env = environment()
    chip = resolve_hardware(exp.plan.hardware, env["backend"], env["device_kind"], hardware_file, progress, exp.mesh)
    for _, plan in points:  # a Plan that does not fit is refused before anything compiles
        _estimate(plan, chip, compile_only)
    ctx = _Context(exp, path, chip, env, progress, compile_only)
    try:
        if not exp.sweep:
            return _run_single(ctx, base, name, resume)
        return _run_sweep(ctx, base, name, points, resume)
    except OSError as exc:
        raise UserError(
            f"cannot write the run directory under {str(base)!r}: {exc.strerror} ({exc.filename}); pass --out DIR"
        ) from None


@dataclass(frozen=True)
class _Context:
    exp: Experiment
    path: str
    chip: Chip
    env: dict[str, Any]
    progress: Callable[[str], None]
    compile_only: bool


def _check_resumable(base: Path, name: str, path: str, sweep: bool) -> None:
    run_dir = base / name
    if not run_dir.is_dir():
        raise UserError(f"no run {name!r} under {str(base)!r} to resume; start it without --resume (or pass --run-id)")
    kept = run_dir / "experiment.toml"
    if kept.is_file() and kept.read_bytes() != Path(path).read_bytes():
        raise UserError(
            f"run {str(run_dir)!r} was started from another version of {path}; resume with the same file, or start "
            "a new run without --resume"
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
    final = base / store.free_name(base, name)
    tmp = store.staging(final)
    try:
        _provenance(ctx, tmp)
        report = run_point(
            ctx.exp, ctx.exp.plan, tmp, ctx.chip, ctx.progress, ctx.env, compile_only=ctx.compile_only, final_dir=final
        )
        store.mark_complete(tmp)
        final = _commit_run(tmp, final, report)
    except KeyboardInterrupt:
        store.discard(tmp)
        raise Interrupted(f"the run had not finished and nothing was kept; run {ctx.path} again") from None
    except BaseException:
        store.discard(tmp)
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
            writer.write_reports(report, tmp)
            final = moved


def _run_sweep(ctx: _Context, base: Path, name: str, points, resume: bool) -> RunResult:
    """Every point staged and moved into ``points/<label>/`` when complete, under the run's lock."""
    run_dir = base / name if resume else store.reserve(base, name)
    created = not resume
    if (
        resume
        and (run_dir / "sweep.json").is_file()
        and all(store.is_complete(run_dir / "points" / lb) for lb, _ in points)
    ):
        ctx.progress(f"{run_dir} is complete already: nothing to do")
        summary = json.loads((run_dir / "sweep.json").read_text())
        return RunResult(
            run_dir, summary, tuple(sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")))
        )
    reports: dict[str, dict[str, Any]] = {}
    try:
        with store.RunLock(run_dir):
            if created:
                _provenance(ctx, run_dir)
            for label, plan in points:
                point = run_dir / "points" / label
                if store.is_complete(point):
                    ctx.progress(f"{label}: done already, kept")
                    reports[label] = json.loads((point / "report.json").read_text())
                    continue
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
                    )
                    store.mark_complete(tmp)
                    store.commit(tmp, point)
                finally:
                    store.discard(tmp if tmp.exists() else None)
            summary = _point_summary(
                ctx.exp, run_dir.name, points, [reports[label] for label, _ in points], ctx.env["backend"] == "cpu"
            )
            store.write_atomic(run_dir / "sweep.json", dumps(summary))
    except KeyboardInterrupt:
        raise Interrupted(
            f"{len(reports)} of {len(points)} points are complete in {run_dir}; continue with "
            f"`shardlab run {ctx.path} --resume --run-id {run_dir.name}` (with the same --out)"
        ) from None
    except UserError:
        if created and not reports:  # a run that fails before any point finished leaves nothing behind
            store.discard(run_dir)
        raise
    return RunResult(run_dir, summary, tuple(sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("."))))


__all__ = ["LARGE_BYTES", "WARMUP", "RunResult", "ensure_devices", "run_experiment", "run_point"]
