"""Calibrate the ``cpu`` chip: measure this host's emulated devices and fit the chip's numbers.

On a laptop the "hardware" is N CPU devices emulated by XLA (``--xla_force_host_platform_device_count``):
threads of one host whose "links" are memory copies. The catalog's ``cpu`` entry holds placeholders until
this module measures the host and :func:`write_spec` saves the result as ``specs/cpu.json``, which
:func:`lab.core.hardware.default_catalog` then loads over the placeholder.

What is measured (one timing helper: warm up and compile first, ``jax.block_until_ready`` on every timed
call, a few repeats interleaved round-robin when two programs are compared, medians):

* **peak_flops** per dtype (fp32, bf16): a jitted ``a @ b`` on square shapes on ONE device; the peak is
  the best median FLOP/s over the shapes (XLA:CPU may run one device's dot on several host threads).
* **hbm_bandwidth**: an in-place (donated) ``x * 1.0001`` on one device over arrays past the last-level
  cache; the slope of time against bytes read + written. The same op writing a fresh buffer is recorded
  too: above glibc's mmap threshold (32 MiB) every fresh output is page-faulted in, which is much slower.
* **collectives** on the mesh (default ``X=2, Y=4``, every axis): the registry's microkernels at sizes
  from ~4 KB to ~16 MB of ``V`` (the collective model's byte convention, :mod:`lab.predict.collectives`), each
  timed as ``shardlab run`` measures ops: its own time in a ``jax.profiler`` trace (slowest device,
  rendezvous waits excluded, no program launch), because XLA:CPU's collectives run slower under the
  profiler than timed from outside and predictions must be compared on the footing they are measured
  on. The latency regime is measured inside one program (a loop of K collectives, so dispatch
  cancels): AllGather over each single axis and over all axes gives ``launch + (G - 1) * hop`` on the
  switch model, hence ``launch_latency_s`` and ``hop_latency_s``. The bandwidth line ``t = launch + b V``
  is fitted per kind and per group: over all axes and over each single mesh axis, at the same sizes
  (least squares, so the large messages dominate). AllGather's slope over all axes fixes
  ``link_bandwidth``; every kind gets ``collective_factor[kind] = b / model slope`` over all axes and
  ``collective_factor_by_group[kind][G]`` per axis, so that :func:`lab.predict.collectives.collective_time`
  reproduces the large-message measurements of each group.
* **hbm_bytes**: host RAM divided by the number of emulated devices.

The numbers are those of emulated devices: use them to compare predictions with measurements on this
host, never as an accelerator's.

This module measures and describes (the spec's ``sources``, ``notes`` and ``calibration``); the fits in
between are :mod:`lab.measure.fit`'s, pure functions of the timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.files import write_atomic
from lab.core.hardware import SPECS_DIR_ENV, Catalog, Chip, specs_dir
from lab.core.heartbeat import still
from lab.core.limits import HOST_BUSY
from lab.core.table import render
from lab.measure import fit
from lab.measure import microbench as mb
from lab.measure.calibrate_describe import _describe, _fmt, _host_ram
from lab.measure.fit import Fit
from lab.measure.fit import line as _line  # noqa: F401  (kept importable here: tests fit lines with it)
from lab.predict.collectives import KINDS as MODEL_KINDS

DEFAULT_MESH = {"X": 2, "Y": 4}
BUSY = HOST_BUSY  # a calibration is refused past it (lab.core.limits says why)


from lab.measure.calibrate_settings import (  # noqa: E402  (the sweep settings, full and quick)
    COLLECTIVE_BYTES,
    LATENCY_STEPS,
    MATMUL_SIZES,
    MEMORY_MIB,
    POINT_BUDGET_S,
    REPEATS,
)


@dataclass(frozen=True)
class Calibration:
    """A calibrated ``cpu`` chip, the fits behind it, the mesh measured and the wall time it took."""

    chip: Chip
    fits: tuple[Fit, ...]
    mesh: dict[str, int]
    seconds: float

    def fit(self, term: str) -> Fit:
        """The fit of ``term``; a :class:`UserError` listing the terms otherwise."""
        for f in self.fits:
            if f.term == term:
                return f
        raise UserError(f"no fit for {term!r}; fitted terms: {', '.join(f.term for f in self.fits)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "chip": self.chip.fields(),
            "fits": [dataclasses.asdict(f) for f in self.fits],
            "mesh": dict(self.mesh),
            "seconds": self.seconds,
        }

    def table(self) -> str:
        rows = [
            (f.term, _fmt(f.term, f.value), "-" if f.r2 is None else f"{f.r2:.4f}", f.points, f.note) for f in self.fits
        ]
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        mode = "quick" if self.chip.calibration.get("quick") else "full"
        title = f"calibrated {self.chip.name} on mesh {mesh} ({mode}, {self.seconds:.1f} s; timings are emulated)"
        return render(("term", "value", "R^2", "points", "how"), rows, title=title)


# ----- timing ----------------------------------------------------------------------------------------------------


# ----- one run: its settings, what it measured, what the fits made of it -----------------------------------------


@dataclass(frozen=True)
class _Run:
    """What every measurement of one calibration shares: the mesh (as given and as JAX's), the mode, progress."""

    mesh: dict[str, int]
    jmesh: Any
    quick: bool
    say: Callable[[str], None]

    @property
    def q(self) -> int:
        """Index into the (full, quick) sweep settings."""
        return 1 if self.quick else 0

    @property
    def repeats(self) -> int:
        return REPEATS[self.q]

    @property
    def budget(self) -> float:
        return POINT_BUDGET_S[self.q]

    @property
    def group(self) -> int:
        """Devices of the mesh, the group the collectives over every axis span."""
        return math.prod(self.mesh.values())


@dataclass(frozen=True)
class _Measured:
    """Every timing of one calibration, as the spec's ``calibration`` records it."""

    matmul: dict[str, list[list[float]]]  # per dtype: [n, seconds, FLOP/s] on one device
    copies: dict[str, Any]  # "inplace": [bytes, seconds] per size; "fresh": [bytes, seconds] at the largest
    ram: float  # bytes of host RAM
    ram_source: str
    devices: int  # emulated devices on the host
    latency_by_group: list  # [axes, G, seconds] of one small AllGather
    latency_by_kind: dict[str, float]  # seconds of one small collective over every axis
    points: dict[str, list]  # per kind: [V, seconds] over every axis
    group_points: dict[str, dict[str, list]]  # per kind and str(G): [V, seconds]
    checks: dict[str, Any]
    load: dict[str, Any] = dataclasses.field(default_factory=dict)  # the host's load before and after


@dataclass(frozen=True)
class _Fitted:
    """What the fits made of the timings: the chip's numbers and the terms behind them."""

    single_device: list[Fit]  # every fit, peak FLOP/s and memory bandwidth those of one device alone
    fits: list[Fit]  # as the spec carries them: those two with every device busy (fit.prefer_concurrent)
    values: dict[str, Any]  # the chip fields they set: peak_flops, hbm_bytes, ..., launch_latency_s
    hows: dict[str, str]  # how hbm_bandwidth and the latencies were obtained (fit.HBM_*, fit.LATENCY_*)
    factors: dict[str, float]  # collective_factor per kind, over every axis
    by_group: dict[str, dict[str, float]]  # collective_factor per kind and str(G)


def _checked_mesh(mesh: dict[str, int] | None) -> dict[str, int]:
    """The mesh to calibrate on (default ``X=2, Y=4``), refused before anything is measured."""
    mesh = dict(DEFAULT_MESH if mesh is None else mesh)
    if not mesh or any(int(v) != v or v < 1 for v in mesh.values()):
        raise UserError(f"mesh {mesh!r} must map axis names to positive sizes, e.g. X=2,Y=4")
    mesh = {str(k): int(v) for k, v in mesh.items()}
    if math.prod(mesh.values()) < 2:
        raise UserError(f"mesh {mesh} has one device; collectives need at least 2, e.g. X=2,Y=4")
    return mesh


# ----- measuring the mesh ----------------------------------------------------------------------------------------


def _latency_groups(mesh: dict[str, int]) -> list[tuple[tuple[str, ...], int]]:
    """The groups of the latency regime: each axis longer than 1, then every axis unless one axis spans them."""
    g = math.prod(mesh.values())
    groups: list[tuple[tuple[str, ...], int]] = [((a,), s) for a, s in mesh.items() if s > 1]
    if g not in {size for _, size in groups}:
        groups.append((tuple(mesh), g))
    return groups


def _measure_latency(run: _Run) -> tuple[list, dict[str, float]]:
    """Latency regime, a loop of small collectives inside one program: ``[axes, G, seconds]`` of one AllGather
    per latency group, and the seconds of one collective of every kind over every axis."""
    run.say("collectives: latency regime (loops of small collectives inside one program)")
    steps = LATENCY_STEPS[run.q]
    ag_latency = [
        [list(axes), size, mb.latency(run.jmesh, "all-gather", axes, steps, run.repeats, run.budget)]
        for axes, size in _latency_groups(run.mesh)
    ]
    kind_latency = {"all-gather": next(t for _, size, t in ag_latency if size == run.group)}
    for kind in MODEL_KINDS[1:]:
        kind_latency[kind] = mb.latency(run.jmesh, kind, tuple(run.mesh), steps, run.repeats, run.budget)
    return ag_latency, kind_latency


class _Steps(contextlib.ExitStack):
    """Numbered phases of a calibration, each announced as step i of n with the time since the first, and a line
    at least every 5 s while one runs (:func:`lab.core.heartbeat.still`); leaving the ``with`` block stops it."""

    def __init__(self, say: Callable[[str], None], n: int):
        super().__init__()
        self.say, self.n, self.i, self.t0 = say, n, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.close()  # the previous step's heartbeat
        self.i += 1
        self.say(f"step {self.i} of {self.n} ({time.perf_counter() - self.t0:.0f} s elapsed): {what}")
        self.enter_context(still(self.say, f"in step {self.i} of {self.n}"))


def _collective_sweep(run: _Run, axes: tuple[str, ...] | None, *, report: bool = False) -> dict[str, list]:
    """Bandwidth regime: ``[V, seconds]`` per message size of every kind over ``axes`` (None: every axis), with a
    progress line per kind when ``report``."""
    points: dict[str, list] = {}
    for kind in MODEL_KINDS:
        points[kind] = mb.collective_points(run.jmesh, kind, axes, COLLECTIVE_BYTES[run.q], run.repeats)
        if report:
            top = points[kind][-1]
            run.say(
                f"collectives: {kind} V={top[0] / 2**20:.0f} MiB in {top[1] * 1e3:.2f} ms, "
                f"{top[0] / top[1] / 1e9:.2f} GB/s"
            )
    return points


def _single_axis_lines(
    run: _Run, base: Chip, points: dict[str, list], factors: dict[str, float], launch: float, link_bw: float
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list]], list[Fit]]:
    """Measure and fit each single mesh axis (neither 1 nor the whole mesh), a progress line per axis.

    Returns the factor and the points per kind and group size (``str(G)``; every axis' under the whole mesh's
    size) and the ``collective_factor.<kind>@<axis>`` fits. A kind an axis cannot fit keeps what it had, so two
    axes of one size share an entry, the later one's where it fitted.
    """
    by_group: dict[str, dict[str, float]] = {kind: {str(run.group): factors[kind]} for kind in MODEL_KINDS}
    group_points: dict[str, dict[str, list]] = {kind: {str(run.group): points[kind]} for kind in MODEL_KINDS}
    fits: list[Fit] = []
    for axis, size in run.mesh.items():
        if size < 2 or size == run.group:
            continue
        rows = _collective_sweep(run, (axis,))
        slopes = fit.model_slopes(base, (size,))  # seconds per byte of V on a 1 B/s link, for this group
        axis_factors, axis_fits = fit.axis_factors(rows, axis, size, slopes, launch, link_bw)
        for kind in MODEL_KINDS:
            group_points[kind][str(size)] = rows[kind]
            if kind in axis_factors:
                by_group[kind][str(size)] = axis_factors[kind]
        fits += axis_fits
        run.say(
            f"collectives over {axis} (G={size}): factors "
            + ", ".join(f"{k} {by_group[k].get(str(size), float('nan')):.2f}" for k in MODEL_KINDS)
        )
    return by_group, group_points, fits


def _single_axis_checks(run: _Run) -> list[dict[str, Any]]:
    """AllGather of the largest message over each single axis, timed from outside less a trivial program's
    dispatch: ``{"axes", "group", "bytes", "measured_s"}`` per axis longer than 1."""
    from kernels.registry import get_kernel

    dispatch = mb.dispatch_program(run.jmesh)
    singles = []
    for axis, size in run.mesh.items():
        if size < 2:
            continue
        n = mb.elements("all-gather", COLLECTIVE_BYTES[run.q][-1], size)
        built = get_kernel("collective_all_gather").build(run.jmesh, {"N": n}, "float32", (axis,))
        t_k, t_d = mb.measure([lambda b=built: b.fn(*b.args), dispatch], run.repeats, run.budget)
        net = mb.median([a - b for a, b in zip(t_k, t_d, strict=True)])
        singles.append({"axes": [axis], "group": size, "bytes": 4.0 * n * size, "measured_s": net})
        del built
    return singles


def _checks(run: _Run) -> dict[str, Any]:
    """Checks the model does not fit: other group sizes (full mode, several axes), all devices at once."""
    checks: dict[str, Any] = {}
    if not run.quick and len(run.mesh) > 1:
        run.say("checks: AllGather over single axes, all devices computing at once")
        checks["all_gather_single_axis"] = _single_axis_checks(run)
    n, mib = (512, 32) if run.quick else (1024, 64)
    checks["concurrent"] = mb.concurrent(run.jmesh, n, mib, run.repeats, run.budget)
    return checks


# ----- describing the result -------------------------------------------------------------------------------------


# ----- calibration -----------------------------------------------------------------------------------------------


class HostBusy(UserError):
    """The host was busy while calibrating: ``what`` says how busy; nothing was saved."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}; nothing saved: calibrate on an idle host, or --force to keep it marked as busy")
        self.what = what


def _busy(stage: str, force: bool, say: Callable[[str], None]) -> float | None:
    """The host's load now; a UserError when it is busy (other work would slow every number), unless ``force``."""
    load = mb.host_busy()
    if load is not None and load > BUSY:
        what = (
            f"the host is busy {stage}: {100 * load:.0f}% of its CPU time went to other work while calibration "
            f"waited (above {100 * BUSY:.0f}%), which would make every measured number too slow"
        )
        if not force:
            raise HostBusy(what)
        say(f"warning: {what}; kept (--force) and marked in the spec")
    return load


def calibrate(
    mesh: dict[str, int] | None = None,
    *,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
) -> Calibration:
    """Measure this host's emulated devices and fit a calibrated ``cpu`` chip (see the module docstring).

    One function of about 100 lines on purpose: its numbered phases run top to bottom in the order the progress
    lines name them, each handing its fits to the next; the measuring and the fitting themselves live in
    :mod:`lab.measure.microbench` and :mod:`lab.measure.fit`.

    Args:
        mesh: axis name to size, major first; default ``{"X": 2, "Y": 4}`` (8 devices). Collectives span
            every axis; single axes give the latency regime's smaller groups.
        quick: fewer and smaller sizes and repeats (11.5 s on an idle 2-core host on 2026-12-03; about 50 s
            with the test suite running beside it).
        progress: called with one line per phase.
        force: keep a calibration taken on a busy host (load before or after above :data:`BUSY`), marked so.

    Raises:
        UserError: the host is busy before or after measuring (without ``force``), or the mesh does not fit.
    """
    import jax

    from kernels.mesh import make_mesh

    say = progress or (lambda _text: None)
    mesh = _checked_mesh(mesh)
    jmesh = make_mesh(mesh)  # a UserError when the host emulates too few devices: before the load is sampled
    before = _busy("before calibrating", force, say)
    start = time.perf_counter()
    run = _Run(mesh, jmesh, quick, say)
    today = datetime.date.today().isoformat()
    base = Catalog().get("cpu")  # the built-in placeholder, whatever specs/ holds

    with _Steps(say, 5) as step:
        # 1-3. One device: matmul throughput and memory bandwidth; memory capacity from the host's RAM.
        step("one device: matmul throughput, memory bandwidth and capacity")
        matmul = mb.matmuls(MATMUL_SIZES[run.q], run.repeats, run.budget, say)
        copies = mb.copies(MEMORY_MIB[run.q], run.repeats, run.budget, say)
        ram, ram_source = _host_ram()
        n_dev = jax.device_count()
        peaks, fits = fit.peak_flops(matmul)
        hbm, hbm_how = fit.hbm_bandwidth(copies["inplace"])
        fits += [hbm, fit.hbm_bytes(ram, n_dev)]

        # 4. Latency regime: one small collective inside a program, per group size and per kind.
        step("collectives: the latency regime")
        ag_latency, kind_latency = _measure_latency(run)
        launch, hop, latency_how = fit.latency([size for _, size, _ in ag_latency], [t for _, _, t in ag_latency])
        fits += [launch, hop]

        # 5. Bandwidth regime: microkernels over every axis, each collective timed through the profiler; then each
        # single axis on its own line, since on one host a smaller group is not proportionally cheaper.
        step("collectives: the bandwidth regime over the whole mesh")
        points = _collective_sweep(run, None, report=True)
        slopes = fit.model_slopes(base, tuple(mesh.values()))
        link_bw, factors, coll_fits = fit.collective_factors(points, launch.value, slopes, run.group)
        step("collectives: each single mesh axis")
        by_group, group_points, axis_fits = _single_axis_lines(run, base, points, factors, launch.value, link_bw)
        fits += coll_fits + axis_fits

        # 6. Checks the model does not fit; the spec carries the figures with every device busy (fit.prefer_concurrent)
        # and the single-device ones stay under checks.
        step("checks with every device busy")
        checks = _checks(run)
        spec_fits, spec_peaks, hbm_bw = fit.prefer_concurrent(fits, peaks, hbm.value, checks["concurrent"])
        if fit.concurrent_terms(checks["concurrent"], list(peaks)):
            checks["single_device"] = {"peak_flops": dict(peaks), "hbm_bandwidth": hbm.value}

    seconds = time.perf_counter() - start
    after = _busy("after calibrating", force, say)
    busy = any(x is not None and x > BUSY for x in (before, after))
    measured = _Measured(
        matmul=matmul,
        copies=copies,
        ram=ram,
        ram_source=ram_source,
        devices=n_dev,
        latency_by_group=ag_latency,
        latency_by_kind=kind_latency,
        points=points,
        group_points=group_points,
        checks=checks,
        load={"before": before, "after": after, "threshold": BUSY, "busy": busy},
    )
    fitted = _Fitted(
        single_device=fits,
        fits=spec_fits,
        values=dict(
            peak_flops=spec_peaks,
            hbm_bytes=ram / n_dev,
            hbm_bandwidth=hbm_bw,
            link_bandwidth=link_bw,
            hop_latency_s=hop.value,
            launch_latency_s=launch.value,
        ),
        hows={"hbm_bandwidth": hbm_how, "latency": latency_how},
        factors=factors,
        by_group=by_group,
    )
    chip = _describe(today, run, base, measured, fitted, seconds)
    return Calibration(chip=chip, fits=tuple(spec_fits), mesh=dict(mesh), seconds=seconds)


def _spec_path(path: str | os.PathLike | None) -> Path:
    return Path(path) if path is not None else specs_dir() / "cpu.json"


def check_writable(path: str | os.PathLike | None = None) -> Path:
    """The spec's path, if a file can be written there (its folder existing or creatable); nothing is created.

    Raises:
        UserError: naming the path, and the setting it came from (``--out``, or ``$SHARDLAB_SPECS_DIR``).
    """
    from lab.core.paths import check_folder

    p = _spec_path(path)
    flag = "--out" if path is not None else f"${SPECS_DIR_ENV}"
    where = "pass --out PATH" if path is not None else f"set {SPECS_DIR_ENV} to a folder (or unset it for ./specs)"
    if p.is_dir():
        raise UserError(f"cannot write the spec to {str(p)!r}: it is a folder; {where}")
    check_folder(p.parent, flag, what="write the spec there", hint=where, shown=p)
    return p


def write_spec(cal: Calibration, path: str | os.PathLike | None = None) -> Path:
    """Write the calibrated chip in the hardware-file format (default ``specs_dir()/cpu.json``), atomically: a
    reader sees the old spec or the new one, never half of one."""
    p = check_writable(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, json.dumps(cal.chip.fields(), indent=2, allow_nan=False) + "\n")
    return p


__all__ = ["BUSY", "Calibration", "Fit", "HostBusy", "calibrate", "check_writable", "write_spec"]
