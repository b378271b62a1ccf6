"""Microbenchmarks of the emulated host: matmuls, memory copies, and collectives timed as ``run`` times ops.

One timing helper (:func:`measure`: warm up and compile first, ``jax.block_until_ready`` on every timed call,
repeats interleaved round-robin when programs are compared, medians); each benchmark returns raw timings for
:mod:`lab.measure.calibrate` to fit (:mod:`lab.measure.fit`) and describe.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

LATENCY_ELEMENTS = 1024  # per-device elements of a latency-regime message (4 KB of float32)
KERNEL_KIND = {
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-reduce": "all_reduce",
    "all-to-all": "all_to_all",
    "permute": "permute",
}


def measure(calls: Sequence[Callable[[], Any]], repeats: int, budget_s: float) -> list[list[float]]:
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


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ----- measurements ----------------------------------------------------------------------------------------------


def matmuls(sizes: Sequence[int], repeats: int, budget: float, progress) -> dict[str, list[list[float]]]:
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
            t = median(measure([lambda a=a, b=b: mm(a, b)], repeats, budget)[0])
            rows.append([n, t, 2.0 * n**3 / t])
        out[short] = rows
        best = max(r[2] for r in rows)
        progress(f"matmul {short}: best {best / 1e9:.1f} GFLOP/s over n={','.join(str(n) for n in sizes)}")
    return out


def copies(mib: Sequence[int], repeats: int, budget: float, progress) -> dict[str, Any]:
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

        t = median(measure([step], repeats, budget)[0])
        points.append([2.0 * n * 4, t])
        del state
    n = mib[-1] * 2**20 // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32), dev)
    t_fresh = median(measure([lambda x=x: scale_fresh(x)], repeats, budget)[0])
    progress(
        f"memory: in-place copy {points[-1][0] / points[-1][1] / 1e9:.1f} GB/s, "
        f"fresh-output copy {2.0 * n * 4 / t_fresh / 1e9:.1f} GB/s at {mib[-1]} MiB"
    )
    return {"inplace": points, "fresh": [2.0 * n * 4, t_fresh]}


def concurrent(mesh, n: int, mib: int, repeats: int, budget: float) -> dict[str, Any]:
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
        t = median(measure([lambda a=a: mm(a, a)], repeats, budget)[0])
        out[f"peak_flops.{short}"] = 2.0 * n**3 / t
    scale = jax.jit(jax.shard_map(lambda x: x * 1.0001, mesh=mesh, in_specs=spec, out_specs=spec), donate_argnums=0)
    per = mib * 2**20 // 4
    state = {"x": jax.device_put(jnp.ones((g * per,), jnp.float32), sharding)}

    def step():
        state["x"] = scale(state["x"])
        return state["x"]

    t = median(measure([step], repeats, budget)[0])
    out["hbm_bandwidth"] = 2.0 * per * 4 / t
    out["matmul_n"] = n
    out["copy_bytes"] = 2.0 * per * 4
    return out


def elements(kind: str, nbytes: int, g: int) -> int:
    """Per-device elements of the kernel input (float32) whose model byte count V is about ``nbytes``."""
    n = nbytes // 4 // (g if kind in ("all-gather", "all-to-all") else 1)
    multiple = g if kind in ("reduce-scatter", "all-to-all") else 1
    return max(multiple, (n // multiple) * multiple)


def model_bytes(kind: str, n: int, g: int) -> float:
    """V of the collective model for a kernel with ``n`` float32 elements per device (lab.predict.collectives)."""
    if kind in ("all-gather", "all-to-all"):
        return 4.0 * n * g  # AllGather: the gathered output; AllToAll: the operand times the group
    return 4.0 * n  # ReduceScatter and AllReduce: the operand; permute: the buffer sent


def dispatch_program(mesh):
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


def chained(mesh, kind: str, axes: tuple[str, ...], n: int):
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


def latency(mesh, kind: str, axes: tuple[str, ...], steps: tuple[int, int], repeats: int, budget: float) -> float:
    """In-program seconds of one small collective: paired difference of a K2- and a K1-collective program."""
    g = math.prod(mesh.shape[a] for a in axes)
    run = chained(mesh, kind, axes, g * math.ceil(LATENCY_ELEMENTS / g))  # ReduceScatter/AllToAll split by g
    k1, k2 = steps
    t1, t2 = measure([lambda: run(k1), lambda: run(k2)], repeats, budget)
    return median([(b - a) / (k2 - k1) for a, b in zip(t1, t2, strict=True)])


def collective_points(mesh, kind: str, axes: tuple[str, ...] | None, sizes: Sequence[int], repeats: int) -> list:
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
    from lab.measure import profile, trace

    g = math.prod(mesh.shape[a] for a in axes) if axes else math.prod(mesh.shape.values())
    kernel = get_kernel(f"collective_{KERNEL_KIND[kind]}")
    rows = []
    for nbytes in sizes:
        n = elements(kind, nbytes, g)
        built = kernel.build(mesh, {"N": n}, np.float32, axes)
        names = {c.name for c in collectives(parse_module(built.fn.lower(*built.args).compile().as_text()))}
        with tempfile.TemporaryDirectory(prefix="shardlab-calibrate-") as logdir:
            files = profile.record(built.fn, built.args, logdir, warmup=1, repeats=max(2, min(repeats, 5)))
            stats = trace.parse(files, names).per_op()
        rows.append([model_bytes(kind, n, g), sum(st.median_self_s for st in stats.values())])
        del built
    return rows


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores since boot, from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def host_busy(seconds: float = 1.0) -> float | None:
    """Fraction of the host's CPU time (all cores) that went to work during the next ``seconds``, while this
    process sleeps: what other processes take from a measurement. None where the kernel does not say."""
    first = _cpu_times()
    time.sleep(seconds)
    last = _cpu_times()
    if first is None or last is None or last[1] <= first[1]:
        return None
    return (last[0] - first[0]) / (last[1] - first[1])


class HostLoad:
    """The share of the host's CPU time that other processes took while a block ran (this process's own time
    taken out): ``with HostLoad() as load: ...; load.others``. None where ``/proc`` does not say."""

    def __enter__(self) -> HostLoad:
        self.others: float | None = None
        self._start, self._own = _cpu_times(), os.times()
        return self

    def __exit__(self, *exc) -> None:
        end, own = _cpu_times(), os.times()
        if self._start is None or end is None:
            return
        ticks = os.sysconf("SC_CLK_TCK")
        busy, total = end[0] - self._start[0], end[1] - self._start[1]
        mine = (own.user + own.system - self._own.user - self._own.system) * ticks
        if total > 0:
            self.others = min(1.0, max(0.0, (busy - mine) / total))
