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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Catalog, Chip, specs_dir
from lab.core.table import render
from lab.predict.collectives import KINDS as MODEL_KINDS
from lab.predict.collectives import collective_time

DEFAULT_MESH = {"X": 2, "Y": 4}

# Kernel names (kernels.collectives) for the collective model's kinds.
KERNEL_KIND = {
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-reduce": "all_reduce",
    "all-to-all": "all_to_all",
    "permute": "permute",
}

# Sweep settings: (full, quick).
MATMUL_SIZES = ((256, 512, 1024, 2048), (256, 512))
MEMORY_MIB = ((32, 64, 128, 256), (32, 64, 128))
COLLECTIVE_BYTES = (tuple(4096 * 4**i for i in range(7)), (16384, 262144, 2097152, 8388608))
REPEATS = (15, 3)
POINT_BUDGET_S = (1.5, 0.4)  # stop repeating one measurement after this long (once it has 3 repeats)
LATENCY_STEPS = ((1, 17), (1, 9))  # collectives per program in the two programs of a latency measurement
LATENCY_ELEMENTS = 1024  # per-device elements of a latency-regime message (4 KB of float32)


@dataclass(frozen=True)
class Fit:
    """One fitted (or measured) term of the calibrated chip.

    Attributes:
        term: the chip field or calibration entry (``peak_flops.fp32``, ``hbm_bandwidth``, ``link_bandwidth``,
            ``hop_latency_s``, ``launch_latency_s``, ``collective_factor.all-to-all``, ``hbm_bytes``).
        value: in SI units (FLOP/s, bytes/s, seconds, bytes) or a plain factor.
        r2: coefficient of determination where a line was fitted, else None.
        points: measurements behind the value.
        note: how it was obtained.
    """

    term: str
    value: float
    r2: float | None
    points: int
    note: str = ""


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


def _fmt(term: str, value: float) -> str:
    if term.startswith("peak_flops"):
        return f"{value / 1e9:.1f} GFLOP/s"
    if term.endswith("bandwidth"):
        return f"{value / 1e9:.2f} GB/s"
    if term.endswith("_s"):
        return f"{value * 1e6:.1f} us"
    if term == "hbm_bytes":
        return f"{value / 2**30:.2f} GiB"
    return f"{value:.3f}"


# ----- timing and fitting ----------------------------------------------------------------------------------------


def _measure(calls: Sequence[Callable[[], Any]], repeats: int, budget_s: float) -> list[list[float]]:
    """Seconds per call of each zero-argument callable: every one warmed up (compiled, run once) first, then timed
    round-robin (so a pair of programs shares the host's drift), ``block_until_ready`` on every result.
    At least three repeats; fewer than ``repeats`` once ``budget_s`` has passed."""
    import jax

    for call in calls:  # twice: the first call compiles, the second touches fresh buffers for the first time
        jax.block_until_ready(call())
        jax.block_until_ready(call())
    samples: list[list[float]] = [[] for _ in calls]
    start = time.perf_counter()
    for r in range(repeats):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            samples[i].append(time.perf_counter() - t0)
        if r + 1 >= 3 and time.perf_counter() - start > budget_s:
            break
    return samples


def _line(x: Sequence[float], y: Sequence[float], intercept: float | None = None) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x`` (``a`` fixed when ``intercept`` is given): ``(a, b, R^2)``."""
    n = len(x)
    if intercept is None:
        mx, my = sum(x) / n, sum(y) / n
        sxx = sum((xi - mx) ** 2 for xi in x)
        b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx if sxx else 0.0
        a = my - b * mx
    else:
        a = intercept
        sxx = sum(xi * xi for xi in x)
        b = sum(xi * (yi - a) for xi, yi in zip(x, y, strict=True)) / sxx if sxx else 0.0
    my = sum(y) / n
    ss_tot = sum((yi - my) ** 2 for yi in y)
    ss_res = sum((yi - a - b * xi) ** 2 for xi, yi in zip(x, y, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return a, b, r2


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ----- measurements ----------------------------------------------------------------------------------------------


def _matmuls(sizes: Sequence[int], repeats: int, budget: float, progress) -> dict[str, list[list[float]]]:
    """Per dtype: ``[n, seconds, FLOP/s]`` of an ``[n, n] @ [n, n]`` on device 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    mm = jax.jit(lambda a, b: a @ b)
    rng = np.random.default_rng(0)
    out: dict[str, list[list[float]]] = {}
    for short, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        rows = []
        for n in sizes:
            a = jax.device_put(rng.standard_normal((n, n), dtype=np.float32).astype(dtype), dev)
            b = jax.device_put(rng.standard_normal((n, n), dtype=np.float32).astype(dtype), dev)
            t = _median(_measure([lambda a=a, b=b: mm(a, b)], repeats, budget)[0])
            rows.append([n, t, 2.0 * n**3 / t])
        out[short] = rows
        best = max(r[2] for r in rows)
        progress(f"matmul {short}: best {best / 1e9:.1f} GFLOP/s over n={','.join(str(n) for n in sizes)}")
    return out


def _copies(mib: Sequence[int], repeats: int, budget: float, progress) -> dict[str, Any]:
    """In-place ``x * 1.0001`` (donated) on device 0: ``[bytes read + written, seconds]`` per size; and the
    same op writing a fresh output at the largest size."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    scale_inplace = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    scale_fresh = jax.jit(lambda x: x * 1.0001)
    points = []
    for m in mib:
        n = m * 2**20 // 4
        state = {"x": jax.device_put(jnp.ones((n,), jnp.float32), dev)}

        def step(state=state):
            state["x"] = scale_inplace(state["x"])
            return state["x"]

        t = _median(_measure([step], repeats, budget)[0])
        points.append([2.0 * n * 4, t])
        del state
    n = mib[-1] * 2**20 // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32), dev)
    t_fresh = _median(_measure([lambda x=x: scale_fresh(x)], repeats, budget)[0])
    progress(
        f"memory: in-place copy {points[-1][0] / points[-1][1] / 1e9:.1f} GB/s, "
        f"fresh-output copy {2.0 * n * 4 / t_fresh / 1e9:.1f} GB/s at {mib[-1]} MiB"
    )
    return {"inplace": points, "fresh": [2.0 * n * 4, t_fresh]}


def _concurrent(mesh, n: int, mib: int, repeats: int, budget: float) -> dict[str, Any]:
    """Per-device throughput when every device of the mesh runs the same matmul / in-place copy at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = tuple(mesh.axis_names)
    g = math.prod(mesh.shape.values())
    spec = P(axes)
    sharding = NamedSharding(mesh, spec)
    out: dict[str, Any] = {"devices": g}
    mm = jax.jit(jax.shard_map(jnp.matmul, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    rng = np.random.default_rng(1)
    for short, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jax.device_put(rng.standard_normal((g, n, n), dtype=np.float32).astype(dtype), sharding)
        t = _median(_measure([lambda a=a: mm(a, a)], repeats, budget)[0])
        out[f"peak_flops.{short}"] = 2.0 * n**3 / t
    scale = jax.jit(jax.shard_map(lambda x: x * 1.0001, mesh=mesh, in_specs=spec, out_specs=spec), donate_argnums=0)
    per = mib * 2**20 // 4
    state = {"x": jax.device_put(jnp.ones((g * per,), jnp.float32), sharding)}

    def step():
        state["x"] = scale(state["x"])
        return state["x"]

    t = _median(_measure([step], repeats, budget)[0])
    out["hbm_bandwidth"] = 2.0 * per * 4 / t
    out["matmul_n"] = n
    out["copy_bytes"] = 2.0 * per * 4
    return out


def _elements(kind: str, nbytes: int, g: int) -> int:
    """Per-device elements of the kernel input (float32) whose model byte count V is about ``nbytes``."""
    n = nbytes // 4 // (g if kind in ("all-gather", "all-to-all") else 1)
    multiple = g if kind in ("reduce-scatter", "all-to-all") else 1
    return max(multiple, (n // multiple) * multiple)


def _model_bytes(kind: str, n: int, g: int) -> float:
    """V of the collective model for a kernel with ``n`` float32 elements per device (lab.predict.collectives)."""
    if kind in ("all-gather", "all-to-all"):
        return 4.0 * n * g  # AllGather: the gathered output; AllToAll: the operand times the group
    return 4.0 * n  # ReduceScatter and AllReduce: the operand; permute: the buffer sent


def _dispatch_program(mesh):
    """A trivial program on every device of the mesh: its time is the dispatch every kernel pays."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P(tuple(mesh.axis_names))
    g = math.prod(mesh.shape.values())
    fn = jax.jit(jax.shard_map(lambda x: x * 1.0001, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((g * 256,), jnp.float32), NamedSharding(mesh, spec))
    return lambda: fn(x)


def _chained(mesh, kind: str, axes: tuple[str, ...], n: int):
    """``f(k)`` runs ``k`` dependent collectives of ``kind`` over ``axes`` inside one program (a loop, so
    nothing is combined), ``n`` float32 elements per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels import collectives as coll

    g = coll.group_size(mesh, axes)
    spec = P(coll.rest_axes(mesh, axes) + axes)
    perm = coll.ring_perm(mesh, axes)

    def step(i, x):
        if kind == "all-gather":  # keep a block that moves with i, so the gather cannot be simplified away
            y = jax.lax.all_gather(x, axes, axis=0, tiled=True)
            return jax.lax.dynamic_slice_in_dim(y, (i % g) * n, n)
        if kind == "reduce-scatter":
            return jnp.tile(jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True), g)
        if kind == "all-reduce":
            return jax.lax.psum(x, axes)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
        return jax.lax.ppermute(x, axes, perm)

    def body(x, k):
        return jax.lax.fori_loop(0, k[0], step, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False))
    x = jax.device_put(np.ones(math.prod(mesh.shape.values()) * n, np.float32), NamedSharding(mesh, spec))
    counts = {}

    def run(k: int):
        if k not in counts:
            counts[k] = jax.device_put(np.array([k], np.int32))
        return fn(x, counts[k])

    return run


def _latency(mesh, kind: str, axes: tuple[str, ...], steps: tuple[int, int], repeats: int, budget: float) -> float:
    """In-program seconds of one small collective: paired difference of a K2- and a K1-collective program."""
    g = math.prod(mesh.shape[a] for a in axes)
    run = _chained(mesh, kind, axes, g * math.ceil(LATENCY_ELEMENTS / g))  # ReduceScatter/AllToAll split by g
    k1, k2 = steps
    t1, t2 = _measure([lambda: run(k1), lambda: run(k2)], repeats, budget)
    return _median([(b - a) / (k2 - k1) for a, b in zip(t1, t2, strict=True)])


def _collective_points(mesh, kind: str, axes: tuple[str, ...] | None, sizes: Sequence[int], repeats: int) -> list:
    """``[V, seconds]`` per message size of the registry's collective microkernel over ``axes`` (None: every
    axis), each timed as ``shardlab run`` times an op: its own time in a ``jax.profiler`` trace, median over
    steps, slowest device, rendezvous waits excluded.

    Calibrating from the per-op measurement that runs report keeps predictions and measurements on one
    footing (under the profiler XLA:CPU's collectives run slower than timed from outside, and the per-op
    time leaves out the program's launch). Each size gets its own trace: timing all sizes of a kind in one
    trace measured them faster than runs of the same programs see them (in three validation passes 7-11 of
    25 runs stayed in [0.67, 1.5], against 12-20 in the passes with a trace per size;
    docs/validation/cpu-emulated.md).
    """
    import tempfile

    import numpy as np

    from kernels.registry import get_kernel
    from lab.compile.hlo import collectives, parse_module
    from lab.measure import trace

    g = math.prod(mesh.shape[a] for a in axes) if axes else math.prod(mesh.shape.values())
    kernel = get_kernel(f"collective_{KERNEL_KIND[kind]}")
    rows = []
    for nbytes in sizes:
        n = _elements(kind, nbytes, g)
        built = kernel.build(mesh, {"N": n}, np.float32, axes)
        names = {c.name for c in collectives(parse_module(built.fn.lower(*built.args).compile().as_text()))}
        with tempfile.TemporaryDirectory(prefix="shardlab-calibrate-") as logdir:
            files = trace.record(built.fn, built.args, logdir, warmup=1, repeats=max(2, min(repeats, 5)))
            stats = trace.parse(files, names).per_op()
        rows.append([_model_bytes(kind, n, g), sum(st.median_self_s for st in stats.values())])
        del built
    return rows


def _model_slopes(base: Chip, axis_sizes: tuple[int, ...]) -> dict[str, float]:
    """Seconds per byte of V for each kind on ``base`` with a 1 B/s link and factor 1 (the calibrated form)."""
    probe = dataclasses.replace(
        base,
        link_bandwidth=1.0,
        hop_latency_s=0.0,
        launch_latency_s=0.0,
        calibration={"collective_factor": dict.fromkeys(MODEL_KINDS, 1.0)},
    )
    return {k: collective_time(k, 1.0, axis_sizes, probe).bandwidth_s for k in MODEL_KINDS}


def _host_ram() -> tuple[float, str]:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "os.sysconf"
    except (ValueError, OSError, AttributeError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024, "/proc/meminfo"
    raise UserError("cannot read the host's RAM (no os.sysconf and no /proc/meminfo)")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# ----- calibration -----------------------------------------------------------------------------------------------


def calibrate(
    mesh: dict[str, int] | None = None, *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> Calibration:
    """Measure this host's emulated devices and fit a calibrated ``cpu`` chip (see the module docstring).

    Args:
        mesh: axis name to size, major first; default ``{"X": 2, "Y": 4}`` (8 devices). Collectives span
            every axis; single axes give the latency regime's smaller groups.
        quick: fewer and smaller sizes and repeats (about 15 s instead of about 60 s on 2 cores).
        progress: called with one line per phase.
    """
    import jax

    from kernels.mesh import make_mesh

    start = time.perf_counter()
    say = progress or (lambda _line: None)
    mesh = dict(DEFAULT_MESH if mesh is None else mesh)
    if not mesh or any(int(v) != v or v < 1 for v in mesh.values()):
        raise UserError(f"mesh {mesh!r} must map axis names to positive sizes, e.g. X=2,Y=4")
    mesh = {str(k): int(v) for k, v in mesh.items()}
    g = math.prod(mesh.values())
    if g < 2:
        raise UserError(f"mesh {mesh} has one device; collectives need at least 2, e.g. X=2,Y=4")
    jmesh = make_mesh(mesh)  # UserError when the host emulates too few devices
    q = 1 if quick else 0
    repeats, budget = REPEATS[q], POINT_BUDGET_S[q]
    today = datetime.date.today().isoformat()
    base = Catalog().get("cpu")  # the built-in placeholder, whatever specs/ holds
    measured = f"measured on this host by shardlab calibrate on {today}"
    fits: list[Fit] = []
    sources: dict[str, str] = {}

    def record(fit: Fit, source_key: str | None = None, how: str = "") -> None:
        fits.append(fit)
        if source_key:
            r2 = "n/a (not a line fit)" if fit.r2 is None else f"{fit.r2:.4f}"
            sources[source_key] = f"{measured}: {how or fit.note}, R^2={r2}"

    # 1. Matmul throughput on one device.
    matmul = _matmuls(MATMUL_SIZES[q], repeats, budget, say)
    peaks = {}
    for short, rows in matmul.items():
        best = max(rows, key=lambda r: r[2])
        peaks[short] = best[2]
        record(
            Fit(f"peak_flops.{short}", best[2], None, len(rows), f"best median of a@b on 1 device, n={best[0]}"),
            f"peak_flops.{short}",
            f"jitted [n,n]@[n,n] {short} on ONE emulated device, n in {[r[0] for r in rows]}; the best median "
            f"achieved FLOP/s (n={best[0]}); XLA:CPU may spread one device's dot over several host threads",
        )

    # 2. Memory bandwidth on one device.
    copies = _copies(MEMORY_MIB[q], repeats, budget, say)
    xs, ys = [p[0] for p in copies["inplace"]], [p[1] for p in copies["inplace"]]
    _, slope, r2 = _line(xs, ys)
    if slope > 0:
        hbm_bw, how = 1.0 / slope, "slope of time vs bytes"
    else:  # noise swamped the slope: fall back to the achieved bandwidth at the largest size
        hbm_bw, how, r2 = xs[-1] / ys[-1], "achieved at the largest size (slope not positive)", None
    record(
        Fit("hbm_bandwidth", hbm_bw, r2, len(xs), f"in-place x*1.0001 on 1 device, {how}"),
        "hbm_bandwidth",
        f"donated in-place x*1.0001 (float32) on ONE emulated device over {MEMORY_MIB[q][0]}-{MEMORY_MIB[q][-1]} MiB "
        f"arrays, {how} (bytes read + written)",
    )

    # 3. Memory capacity.
    ram, ram_src = _host_ram()
    n_dev = jax.device_count()
    record(
        Fit("hbm_bytes", ram / n_dev, None, 1, f"host RAM / {n_dev} emulated devices"),
        "hbm_bytes",
        f"host RAM {ram / 2**30:.1f} GiB ({ram_src}) divided by the {n_dev} emulated devices",
    )

    # 4. Latency regime: one small collective inside a program, per group size and per kind.
    say("collectives: latency regime (loops of small collectives inside one program)")
    axes_all = tuple(mesh)
    steps = LATENCY_STEPS[q]
    groups: list[tuple[tuple[str, ...], int]] = [((a,), s) for a, s in mesh.items() if s > 1]
    if g not in {size for _, size in groups}:
        groups.append((axes_all, g))
    ag_latency = [
        [list(axes), size, _latency(jmesh, "all-gather", axes, steps, repeats, budget)] for axes, size in groups
    ]
    kind_latency = {"all-gather": next(t for _, size, t in ag_latency if size == g)}
    for kind in MODEL_KINDS[1:]:
        kind_latency[kind] = _latency(jmesh, kind, axes_all, steps, repeats, budget)
    hops = [float(size - 1) for _, size, _ in ag_latency]
    lats = [t for _, _, t in ag_latency]
    launch, hop, r2_lat = _line(hops, lats) if len(hops) >= 2 else (0.0, 0.0, None)
    line_how = "line t = launch + (G-1)*hop"
    if not (hop > 0 and launch >= 0):  # not separable: charge the whole latency to the hops
        launch, r2_lat = 0.0, None
        hop = max(sum(t * h for t, h in zip(lats, hops, strict=True)) / sum(h * h for h in hops), 1e-9)
        line_how = "launch and hop not separable here, so launch = 0 and hop = t/(G-1)"
    sizes_txt = ", ".join(f"G={size}: {t * 1e6:.0f} us" for _, size, t in ag_latency)
    lat_how = (
        f"in-program time of one ~{LATENCY_ELEMENTS * 4 // 1024} KB-per-device AllGather (loop of {steps[1]} minus "
        f"loop of {steps[0]}, dispatch cancels) over groups {sizes_txt}; {line_how}"
    )
    record(
        Fit("launch_latency_s", launch, r2_lat, len(lats), "AllGather latency regime: intercept"),
        "launch_latency_s",
        lat_how,
    )
    record(
        Fit("hop_latency_s", hop, r2_lat, len(lats), "AllGather latency regime: per (G-1) step"),
        "hop_latency_s",
        lat_how,
    )

    # 5. Bandwidth regime: microkernels over every axis, each collective timed through the profiler.
    dispatch = _dispatch_program(jmesh)
    coll_sizes = COLLECTIVE_BYTES[q]
    axis_sizes = tuple(mesh.values())
    slopes_per_w = _model_slopes(base, axis_sizes)
    points: dict[str, list] = {}
    lines: dict[str, tuple[float, float, float]] = {}
    for kind in MODEL_KINDS:
        points[kind] = _collective_points(jmesh, kind, None, coll_sizes, repeats)
        vs, ts = [p[0] for p in points[kind]], [p[1] for p in points[kind]]
        lines[kind] = _line(vs, ts, intercept=launch)
        top = points[kind][-1]
        say(
            f"collectives: {kind} V={top[0] / 2**20:.0f} MiB in {top[1] * 1e3:.2f} ms, {top[0] / top[1] / 1e9:.2f} GB/s"
        )
    b_ag = lines["all-gather"][1]
    if not b_ag > 0:
        raise UserError("calibrate: the AllGather times did not grow with size; the host is too noisy, run it again")
    link_bw = slopes_per_w["all-gather"] / b_ag
    factors: dict[str, float] = {}
    span = f"{coll_sizes[0] // 1024} KB-{coll_sizes[-1] // 2**20} MB"
    for kind in MODEL_KINDS:
        _, b, r2 = lines[kind]
        if not b > 0:  # a flat kind: keep the model's own slope
            b = slopes_per_w[kind] / link_bw
        factors[kind] = b * link_bw / slopes_per_w[kind]
        if kind == "all-gather":
            record(
                Fit("link_bandwidth", link_bw, r2, len(points[kind]), f"AllGather over {g}: (G-1)/G / slope"),
                "link_bandwidth",
                f"AllGather over all {g} devices, V {span}, per-op time under the profiler; "
                f"t = launch + V(G-1)/(G*W) by least squares (large messages dominate)",
            )
        record(
            Fit(
                f"collective_factor.{kind}",
                factors[kind],
                r2,
                len(points[kind]),
                f"V/t {1 / b / 1e9:.2f} GB/s measured vs {link_bw / slopes_per_w[kind] / 1e9:.2f} modelled",
            )
        )

    # 5b. Each single mesh axis: on one host a smaller group is not proportionally cheaper (every device still
    # copies through the same memory), so each kind gets its own line per axis over the same message sizes.
    by_group: dict[str, dict[str, float]] = {kind: {str(g): factors[kind]} for kind in MODEL_KINDS}
    group_points: dict[str, dict[str, list]] = {kind: {str(g): points[kind]} for kind in MODEL_KINDS}
    for axis, size in mesh.items():
        if size < 2 or size == g:
            continue
        slopes = _model_slopes(base, (size,))  # seconds per byte of V on a 1 B/s link, for this group
        for kind in MODEL_KINDS:
            rows = _collective_points(jmesh, kind, (axis,), coll_sizes, repeats)
            _, b, r2 = _line([p[0] for p in rows], [p[1] for p in rows], intercept=launch)
            group_points[kind][str(size)] = rows
            if b > 0 and slopes[kind] > 0:
                by_group[kind][str(size)] = b * link_bw / slopes[kind]
                fits.append(
                    Fit(
                        f"collective_factor.{kind}@{axis}",
                        by_group[kind][str(size)],
                        r2,
                        len(rows),
                        f"over {axis} (G={size}): V/t {1 / b / 1e9:.2f} GB/s measured vs "
                        f"{link_bw / slopes[kind] / 1e9:.2f} modelled",
                    )
                )
        say(
            f"collectives over {axis} (G={size}): factors "
            + ", ".join(f"{k} {by_group[k].get(str(size), float('nan')):.2f}" for k in MODEL_KINDS)
        )

    # 6. Checks the model does not fit: other group sizes, all devices at once.
    checks: dict[str, Any] = {}
    if not quick and len(mesh) > 1:
        from kernels.registry import get_kernel

        say("checks: AllGather over single axes, all devices computing at once")
        singles = []
        for axis, size in mesh.items():
            if size < 2:
                continue
            n = _elements("all-gather", coll_sizes[-1], size)
            built = get_kernel("collective_all_gather").build(jmesh, {"N": n}, "float32", (axis,))
            t_k, t_d = _measure([lambda b=built: b.fn(*b.args), dispatch], repeats, budget)
            net = _median([a - b for a, b in zip(t_k, t_d, strict=True)])
            singles.append({"axes": [axis], "group": size, "bytes": 4.0 * n * size, "measured_s": net})
            del built
        checks["all_gather_single_axis"] = singles
    checks["concurrent"] = _concurrent(jmesh, 512 if quick else 1024, 32 if quick else 64, repeats, budget)
    # Sharded programs run every emulated device at once on the same cores, so the spec carries the
    # per-device figures measured with all of them busy; the single-device ones stay under checks.
    conc = checks["concurrent"]
    if conc["devices"] > 1:
        checks["single_device"] = {"peak_flops": dict(peaks), "hbm_bandwidth": hbm_bw}
        for dt in list(peaks):
            if f"peak_flops.{dt}" in conc:
                peaks[dt] = conc[f"peak_flops.{dt}"]
                sources[f"peak_flops.{dt}"] = (
                    f"measured on this host by shardlab calibrate on {today}: {conc['matmul_n']}^3 matmul on every "
                    f"one of the {conc['devices']} devices at once, per-device median, R^2=n/a"
                )
        hbm_bw = conc["hbm_bandwidth"]
        sources["hbm_bandwidth"] = (
            f"measured on this host by shardlab calibrate on {today}: in-place copy of "
            f"{conc['copy_bytes'] / 2**20:.0f} MiB read+write on all {conc['devices']} devices at once, per device, "
            f"R^2=n/a"
        )
        new_values = {f"peak_flops.{dt}": v for dt, v in peaks.items()} | {"hbm_bandwidth": hbm_bw}
        fits = [
            dataclasses.replace(
                f,
                value=new_values[f.term],
                r2=None,
                note=f"all {conc['devices']} devices at once (alone: {f.value:.3g})",
            )
            if f.term in new_values
            else f
            for f in fits
        ]

    # The chip.
    seconds = time.perf_counter() - start
    for key, text in (
        ("scaleout_bandwidth", "not measured: one host has no scale-out network (placeholder kept)"),
        ("scaleout_latency_s", "not measured: one host has no scale-out network (placeholder kept)"),
        ("node_size", "one host: every emulated device shares its memory (placeholder kept)"),
    ):
        sources[key] = text
    cpu = _cpu_model()
    notes = (
        f"Calibrated by shardlab calibrate on {today} on this host ({cpu}, {os.cpu_count()} logical CPUs, "
        f"jax {jax.__version__}), mesh {','.join(f'{k}={v}' for k, v in mesh.items())}"
        f"{', quick mode' if quick else ''}. The {n_dev} devices are emulated by XLA "
        f"(--xla_force_host_platform_device_count): they are threads of one host, the interconnect is memory "
        f"copies between threads of one host, and every timing is emulated, not an accelerator's. peak_flops and "
        f"hbm_bandwidth are per device with all {conc['devices']} devices busy at once (how sharded programs run); "
        f"one device alone reaches more (calibration.checks.single_device)."
    )
    calibration = {
        "date": today,
        "quick": quick,
        "mesh": dict(mesh),
        "seconds": seconds,
        "host": {"cpu": cpu, "logical_cpus": os.cpu_count(), "jax": jax.__version__, "devices": n_dev},
        "collective_factor": factors,
        "collective_factor_by_group": by_group,
        "collectives_by_group": group_points,
        "fits": [dataclasses.asdict(f) for f in fits],
        "matmul": {k: [list(r) for r in rows] for k, rows in matmul.items()},
        "memory": {"inplace": copies["inplace"], "fresh_output": copies["fresh"]},
        "latency": {"all-gather_by_group": ag_latency, "by_kind": kind_latency, "steps": list(steps)},
        "collectives": {
            kind: {"axes": list(axes_all), "axis_sizes": list(axis_sizes), "points": points[kind]}
            for kind in MODEL_KINDS
        },
        "points_columns": ["V bytes", "seconds (slowest device, traced)"],
        "checks": checks,
    }
    fields = dict(
        peak_flops=peaks,
        hbm_bytes=ram / n_dev,
        hbm_bandwidth=hbm_bw,
        link_bandwidth=link_bw,
        hop_latency_s=hop,
        launch_latency_s=launch,
        sources={**base.sources, **sources},
        calibrated=True,
        notes=notes,
    )
    provisional = dataclasses.replace(base, **fields, calibration={"collective_factor": factors})
    for check in checks.get("all_gather_single_axis", []):
        check["model_s"] = collective_time("all-gather", check["bytes"], check["group"], provisional).time_s
    chip = dataclasses.replace(base, **fields, calibration=_plain(calibration))
    return Calibration(chip=chip, fits=tuple(fits), mesh=dict(mesh), seconds=seconds)


def _plain(obj: Any) -> Any:
    """JSON-native values only (tuples become lists), so a written spec loads back to an equal chip."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj


def write_spec(cal: Calibration, path: str | os.PathLike | None = None) -> Path:
    """Write the calibrated chip in the hardware-file format (default ``specs_dir()/cpu.json``)."""
    p = Path(path) if path is not None else specs_dir() / "cpu.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal.chip.fields(), indent=2, allow_nan=False) + "\n")
    return p


__all__ = ["Calibration", "Fit", "calibrate", "write_spec"]
