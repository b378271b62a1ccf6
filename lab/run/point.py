"""One point of an experiment: its Plan estimated, compiled and audited, profiled, joined per op and reported.

:func:`run_point` is the lab's one path from a Plan to its three truths: **estimate** with the estimators users
plan with (:mod:`lab.predict.program.estimate`; a Plan that does not fit the chip is refused before anything compiles);
**compile** once from abstract arguments and audit the HLO against the estimate; price every compiled op with the
roofline (the ledger's ``predicted``); **profile** warm-up plus repeats of the same executable under
``jax.profiler`` and parse per-op times; **join** estimated | predicted | compiled | measured per op; write the
reports. As one of several processes it gathers every process's step times to process 0, whose ledger is the
slowest process's; the other processes keep their trace and a small ``report.json``.

About 500 lines on purpose: the phases of one point hand their results down in order (estimate -> compiled ->
measured -> the report's fields), and each helper here is used by that one path only.
"""
# Over 500 lines on purpose: the one path from a Plan to its three truths; its helpers are run_point's steps and are
# used nowhere else.

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from lab.compile.hlo import module_name
from lab.core.errors import UserError, raise_if_interrupted
from lab.core.hardware import Chip
from lab.core.heartbeat import still
from lab.core.plan import Plan
from lab.core.table import dumps
from lab.predict.program.estimate import ProgramEstimate, estimate_program, memory_warning
from lab.report.plots import BAND
from lab.report.plots import preload as preload_plots
from lab.report.plots import preloaded as plots_preloaded
from lab.report.trust import spec_busy
from lab.run import distributed as dist
from lab.run import store
from lab.run.experiment import Experiment

LARGE_BYTES = 1_000_000  # the "ops of at least 1 MB" the acceptance criteria talk about


def estimate_or_refuse(
    plan: Plan, chip: Chip, compile_only: bool, *, say: bool = True, host_bytes: float | None = None
) -> tuple[ProgramEstimate | None, str | None]:
    """The Plan's estimate; a Plan the estimator refuses, or one that does not fit the chip (or ``host_bytes``
    per device, the host memory emulated devices share), is refused here, before anything compiles. Under
    ``--compile-only`` both become a note or a warning (``say``: print it). A user's model has no estimate: its
    compiled ops are priced by the roofline alone."""
    if plan.spec.family == "user":
        return None, "a user model: no estimator describes it; each compiled op is priced by the roofline"
    try:
        est = estimate_program(plan, chip)
    except UserError as exc:
        if not compile_only:
            raise UserError(
                f"{plan.name}: the estimator cannot price this Plan: {exc} (--compile-only compiles it anyway)"
            ) from None
        return None, f"no estimate: {exc}"
    warning = fit_problem(plan, est, chip, host_bytes)
    if warning and not compile_only:
        hint = "; --scale-to-host runs it scaled down" if host_bytes is not None else ""
        raise UserError(warning + f" (--compile-only compiles it anyway{hint})")
    if warning and say:
        print(f"shardlab: warning: {warning}", file=sys.stderr)
    return est, None


def fit_problem(plan: Plan, est: ProgramEstimate, chip: Chip, host_bytes: float | None) -> str | None:
    """Why the estimate says ``plan`` does not fit the chip, or ``host_bytes`` per device (the host memory that
    emulated devices share); None when it fits."""
    warning = memory_warning(plan, est, chip)
    if not warning and est.memory and host_bytes is not None and est.memory["total"] > host_bytes:
        warning = (
            f"{plan.name}: the estimator puts {est.memory['total'] / 2**30:.3g} GiB per device and this host has "
            f"{host_bytes / 2**30:.3g} GiB for each emulated device; shrink the sizes or shard more"
        )
    return warning


def _compile_and_audit(
    plan: Plan,
    est: ProgramEstimate | None,
    chip: Chip,
    env: dict[str, Any],
    progress,
    clock: _Clock,
    compile_only,
    target=None,
):
    """Build the program, compile it once from abstract arguments, check that the compiler's memory per device
    fits the chip (before a byte is allocated), and audit the HLO against the estimate. With a ``target`` (a TPU
    topology) the mesh is the topology's devices and the compiler libtpu's."""
    from kernels.registry import build
    from lab.compile.audit import audit_compiled
    from lab.compile.target import compile_for, target_mesh

    where = f" for {target.backend.upper()} {target.name} (cross-compiled)" if target is not None else ""
    progress(f"{plan.name} {dict(plan.sizes)}: building {plan.program} on mesh {plan.shape}{where}")
    built = build(plan, target_mesh(plan.shape, target) if target is not None else None)
    clock.lap("build_s")
    progress("compiling (abstract arguments) and auditing against the estimate")
    with still(progress, "compiling"):
        compiled = compile_for(built, target)
    _check_compiled_memory(plan, compiled, chip, compile_only, host=target is None)
    if est is None:
        return built, compiled, {"all_match": None, "note": "no estimate of this Plan: ledger only"}
    with still(progress, "auditing"):
        result = audit_compiled(plan, compiled, est, env["backend"])
    if target is not None:
        result = dataclasses.replace(result, compiled_for=target.name, step_time_estimated_s=est.step_time_s)
    return built, compiled, result.to_dict()


def _check_compiled_memory(plan: Plan, compiled, chip: Chip, compile_only: bool, host: bool = True) -> None:
    """What XLA says one device holds (arguments, outputs and temporaries) against the chip's memory: refused,
    or a warning under ``--compile-only``, so that a typo in a size is an error and not an allocation."""
    try:
        m = compiled.memory_analysis()
        need = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    except (AttributeError, TypeError, NotImplementedError):  # a backend without the analysis
        return
    limit, what = chip.hbm_bytes, f"{chip.name} has"
    host = host_bytes_per_device() if host else None
    if host is not None and host < limit:  # emulated devices share the host's memory, whatever chip prices them
        limit, what = host, "this host has"
    if need <= limit:
        return
    message = (
        f"{plan.name}: the compiled program needs {need / 2**30:.3g} GiB per device (XLA's memory analysis) and "
        f"{what} {limit / 2**30:.3g} GiB; shrink the sizes or shard more"
    )
    if not compile_only:
        raise UserError(message + " (--compile-only compiles it anyway)")
    print(f"shardlab: warning: {message}", file=sys.stderr)


def host_bytes_per_device() -> float | None:
    """On emulated CPU devices, the host's memory divided between them; None on an accelerator."""
    import os

    import jax

    if jax.default_backend() != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total / max(1, jax.local_device_count())


def _interval(est: ProgramEstimate | None) -> list[float] | None:
    """The estimate's 80% interval (lab.predict.intervals): on a GPU or TPU only, where published runs validate
    the estimators; an emulated host's estimates are checked against its own measurement instead."""
    from lab.predict.intervals import for_program

    got = for_program(est) if est is not None else None
    return got.as_list() if got is not None else None


def _siblings(processes: dict[str, Any]) -> int:
    """This run's other processes on process 0's host: the host's "other" load counts them."""
    everyone = processes.get("processes") or []
    return sum(p["host"] == everyone[0]["host"] for p in everyone[1:]) if everyone else 0


def _summary(
    rows: list[dict[str, Any]],
    warmup: int,
    repeats: int,
    host_load: float | None,
    compile_only: bool,
    siblings: int = 0,
) -> dict[str, Any]:
    from lab.report import writer as report
    from lab.report.trust import verdict

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
    out = {
        "median_ratio_large": report.median(large),
        "ops_large": len(large),
        "ops": len(rows),
        "repeats": repeats,
        "warmup": warmup,
        "spread_large": report.median(spreads),
        "host_load": host_load,
    }
    # steady / UNSTEADY (its repeats disagree past the band, or other work held the host) / not measured
    trust = verdict(out, BAND[1] / BAND[0], compile_only, siblings)
    return out | {"trust": trust, "unsteady": trust["verdict"] == "UNSTEADY"}


class _Clock:
    """Seconds per phase of one point (``timings`` in its report)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        raise_if_interrupted()  # between phases: a Ctrl-C a finalizer swallowed stops the run here
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
    result: dict[str, float | int] | None = None  # kernels.program.digest of the last output
    events: tuple = ()  # the trace's op events (lab.measure.trace.OpEvent)
    device_tracks: str | None = None  # the Perfetto copy's process of per-device tracks, where it was added


def _measure(exp: Experiment, built, compiled, out_dir: Path, names: set[str], progress, clock: _Clock) -> _Measured:
    """Profile the compiled executable (the host's other load sampled meanwhile) and parse its trace."""
    from kernels.program import digest
    from lab.measure import profile, trace
    from lab.measure.microbench import HostLoad

    progress(f"profiling {exp.repeats} repeats after {exp.warmup} warm-up")
    run, last = built.runner(compiled), []

    def step():
        last[:] = [run()]
        return last[0]

    plots_preloaded()  # no import in the background while the profiler records every thread's Python calls
    with HostLoad() as load:
        files = profile.record(step, (), str(out_dir / "tensorboard"), warmup=exp.warmup, repeats=exp.repeats)
    clock.lap("profile_s")
    result = digest(last[0])
    progress("parsing the trace")
    per_op = (stats := trace.parse(files, hlo_names=names)).per_op()
    tracks = profile.add_device_tracks(files.perfetto, stats.events, stats.backend)  # emulated: one per device
    return _Measured(
        files,
        {name: s.median_self_s for name, s in per_op.items()},
        {name: s.spread for name, s in per_op.items()},
        stats.step_times(),
        load.others,
        result,
        stats.events,
        profile.DEVICES_PROCESS if tracks else None,
    )


def _bubble(plan: Plan, ops_pred, events) -> dict[str, Any]:
    """``{"pipeline_bubble": ...}`` for a pipelined program that was profiled (lab.measure.bubble), else empty."""
    axes = plan.rules.live("layers", plan.shape) if plan.rules is not None else ()
    if not axes and plan.program.startswith("pipeline") and "pipe" in plan.shape:
        axes = ("pipe",)
    if len(axes) != 1 or not events:
        return {}
    from kernels.mesh import make_mesh
    from lab.measure import bubble

    stage_of = bubble.stage_of_devices(make_mesh(plan.shape, slow=plan.slow_axes), axes[0])
    found = bubble.measure(events, bubble.step_of_ops((p.name, p.scope) for p in ops_pred), stage_of)
    return {"pipeline_bubble": found} if found else {}


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
    target=None,
) -> dict[str, Any]:
    """Estimate, compile + audit, profile, parse and join one Plan; write its report into ``out_dir``.

    ``final_dir`` is where ``out_dir`` will be moved when it is complete (its paths are the ones the report names).

    About 100 lines on purpose: the steps run top to bottom in the order of the run's progress lines, and the
    report's fields are listed once, in the order ``report.json`` has them; each step's work lives in a helper.
    """
    from lab.report import ledger
    from lab.report import writer as report

    final_dir = final_dir or out_dir
    clock = _Clock()
    if not compile_only:
        preload_plots()
    est, note = _estimate(plan, chip, compile_only, target)
    built, compiled, audit = _compile_and_audit(plan, est, chip, env, progress, clock, compile_only, target)
    hlo_text = compiled.as_text()
    rank = dist.rank()
    if rank == 0:
        (out_dir / "hlo.txt").write_text(hlo_text)
    ops_pred = ledger.predict_ops(hlo_text, chip, plan.shape, plan.slow_axes)
    clock.lap("compile_s")
    m = _Measured()
    if not compile_only:
        built.args  # noqa: B018  (placed now: after the memory check, and outside the profile's time)
        clock.lap("build_s")
        m = _measure(exp, built, compiled, out_dir, {p.name for p in ops_pred}, progress, clock)
    serving = None
    if plan.program == "serve" and not compile_only and dist.process_count() == 1:
        from lab.run.serve import serve_experiment

        serving = serve_experiment(exp, plan, chip, est.step_time_s, progress)
        clock.lap("serve_s")
    processes: dict[str, Any] = {}
    if dist.process_count() > 1:  # every process's step times; the ledger of the slowest
        everyone, slowest = dist.combine(_process_summary(m, final_dir, rank))
        processes = {"processes": everyone, "slowest_process": slowest["rank"]}
        if rank:
            return _rank_report(exp, final_dir, out_dir, m, processes)
        m = dataclasses.replace(
            m, medians=slowest["medians"], spreads=slowest["spreads"], steps=slowest["step_times_s"]
        )
    files = m.files
    rows, coverage = ledger.join(ops_pred, m.medians, m.spreads)
    named, est_coverage = [], None
    if est is not None:
        rows, named, est_coverage = ledger.join_estimates(rows, est, audit.get("entries", []))
    row_dicts = [r.to_dict() for r in rows]
    xprof = _xprof_rows(files, env["backend"])
    _add_xprof_times(row_dicts, xprof)
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
        "spec_busy": spec_busy(chip.to_dict()),  # calibrated on a busy host (calibrate --force): likely too slow
        "plan": plan.to_dict(),
        "compile_only": compile_only,
        **{k: env[k] for k in ("overrides", "scaled_to_host") if k in env},
        "ops": row_dicts,
        "estimated_ops": named,
        "coverage": coverage,
        "estimate_coverage": est_coverage,
        "step_time_measured_s": report.median(m.steps) if m.steps else None,
        "step_time_predicted_s": sum(r.predicted_s or 0.0 for r in rows),
        "step_time_estimated_s": est.step_time_s if est is not None else None,
        "step_time_estimated_interval_s": _interval(est),
        "estimate": est.to_dict() if est is not None else {"note": note},
        "breakdown": report.breakdown(row_dicts, named),
        "summary": _summary(row_dicts, exp.warmup, exp.repeats, m.host_load, compile_only, _siblings(processes)),
        "result": m.result,
        **(built.facts() if built.facts is not None else {}),
        **({} if processes else _bubble(plan, ops_pred, m.events)),
        **processes,
        "audit": audit,
        **({"compiled_for": env["compiled_for"], "xla": audit.get("xla")} if target is not None else {}),
        **_trace_fields(files, env["backend"], xprof, out_dir, final_dir),
        "hlo_module": module_name(hlo_text),  # what to pick in TensorBoard's memory and graph viewers
        "perfetto_device_tracks": m.device_tracks,
        **({"serving": serving} if serving is not None else {}),
    }
    written = report.write_all(data, out_dir, timings=lambda: _timings(clock, env.get("started_age_s")))
    progress(f"wrote {', '.join(written)}")
    return data


def _estimate(plan: Plan, chip: Chip, compile_only: bool, target) -> tuple[Any, str]:
    """The Plan's estimate (or why there is none), priced as the TPU compiler builds it for a ``target``
    (:func:`lab.compile.target.for_target`); the refusal is said once, before the first point."""
    if target is not None:
        from lab.compile.target import for_target

        plan = for_target(plan, target)
    return estimate_or_refuse(plan, chip, compile_only, say=False)


def _add_xprof_times(row_dicts: list[dict[str, Any]], xprof: list[dict[str, Any]] | None) -> None:
    """xprof's own per-op device times beside the lab's parse, where its converter has the data."""
    if xprof:
        by_op = xprof_self_times(xprof)
        for r in row_dicts:
            r["xprof_self_s"] = by_op.get(r["name"])


def _trace_fields(files, backend: str, xprof, out_dir: Path, final_dir: Path) -> dict[str, Any]:
    """Where the report's trace files are (named at ``final_dir``, where the finished run is moved)."""
    perfetto = files.perfetto if files else None
    where = str(final_dir / Path(perfetto).resolve().relative_to(out_dir.resolve())) if perfetto else None
    return {
        "tensorboard": str(final_dir / "tensorboard") if files else None,
        "tensorboard_tools": _tools(files, backend),
        "xprof_hlo_stats": _trim(xprof),
        "perfetto_trace": where,
    }


XPROF_COLUMNS = ("hlo_op_name", "category", "occurrences", "avg_self_time", "total_self_time", "bound_by")


def _xprof_rows(files, backend: str) -> list[dict[str, Any]] | None:
    """xprof's ``hlo_stats`` table of a device trace; None on emulated CPU devices (no device plane: the converter
    has nothing) and where the profile plugin is missing."""
    if not files or backend == "cpu" or not getattr(files, "xplane", None):
        return None
    from lab.measure.xprof_tools import hlo_stats

    try:
        return hlo_stats(files)
    except UserError:
        return None


def xprof_self_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """HLO op name -> xprof's mean self time per occurrence, in seconds (its table is in microseconds)."""
    out = {}
    for r in rows:
        name, t = r.get("hlo_op_name"), r.get("avg_self_time")
        if name and isinstance(t, int | float):
            out[str(name)] = float(t) * 1e-6
    return out


def _trim(rows: list[dict[str, Any]] | None, limit: int = 25) -> list[dict[str, Any]] | None:
    """The heaviest ``limit`` rows of xprof's table, with the columns a reader compares against the ledger."""
    if not rows:
        return None
    heavy = sorted(rows, key=lambda r: -float(r.get("total_self_time") or 0.0))[:limit]
    return [{k: r.get(k) for k in XPROF_COLUMNS} for r in heavy]


def _tools(files, backend: str) -> list[dict[str, Any]] | None:
    """Links to each TensorBoard profile tool for this run's trace (empty tools on CPU say why)."""
    if not files:
        return None
    from lab.measure.xprof_tools import tool_links

    try:
        return tool_links(files, backend)
    except UserError:  # a trace folder laid out otherwise: the report still names the logdir
        return None


def _process_summary(m: _Measured, final_dir: Path, rank: int) -> dict[str, Any]:
    import jax

    return {
        "rank": rank,
        "host": socket.gethostname(),
        "local_devices": jax.local_device_count(),
        "step_times_s": m.steps,
        "step_time_measured_s": median(m.steps) if m.steps else None,
        "tensorboard": str(final_dir / "tensorboard") if m.files else None,
        "medians": m.medians,
        "spreads": m.spreads,
    }


def _rank_report(exp: Experiment, final_dir: Path, out_dir: Path, m: _Measured, processes) -> dict[str, Any]:
    """What a process other than 0 keeps: its trace and this small JSON (process 0 writes the report)."""
    data = {
        "experiment": exp.name,
        "run_id": _run_id(final_dir),
        "rank": dist.rank(),
        "slowest_process": processes["slowest_process"],
        "process": processes["processes"][dist.rank()],
        "result": m.result,
    }
    store.write_atomic(out_dir / "report.json", dumps(data))
    return data


def _timings(clock: _Clock, started: float | None = None) -> dict[str, float | None]:
    """Seconds per phase. ``startup_s``: the process's age when the run began (the interpreter, imports and the
    command line; ``started``, taken by run_experiment), ``prepare_s`` from then to this point's first phase (JAX's
    devices, the host's calibration when one is taken, earlier points of a sweep), ``total_s`` the process's age now.
    Without ``started`` all that came before the point is ``startup_s``."""
    from lab.run.environment import process_age_s

    clock.lap("report_s")
    out: dict[str, float | None] = {
        k: clock.phases.get(k, 0.0) for k in ("build_s", "compile_s", "profile_s", "parse_s", "report_s")
    }
    age = process_age_s()
    phases = sum(v for v in out.values() if v is not None)
    before = None if age is None else max(0.0, age - phases)
    out["startup_s"] = before if started is None or before is None else min(started, before)
    out["prepare_s"] = None if before is None or started is None else max(0.0, before - started)
    out["total_s"] = age
    return out


def _run_id(point_dir: Path) -> str:
    return point_dir.name if point_dir.parent.name != "points" else f"{point_dir.parent.parent.name}/{point_dir.name}"


__all__ = ["LARGE_BYTES", "estimate_or_refuse", "fit_problem", "host_bytes_per_device", "run_point"]
