"""Calibrate a GPU or TPU: the pieces of the cost model measured from device-side trace times.

``shardlab calibrate`` on a CPU host fits the emulated devices (:mod:`lab.measure.calibrate`); on an accelerator
it runs this module. Every time is an op's own time in a ``jax.profiler`` trace (the device plane's kernel or
XLA-op events, median over the steps, slowest device; :mod:`lab.measure.trace`), so dispatch and launch gaps
are left out, as the ledger of a run measures ops:

* **matmul** throughput per dtype (bf16, fp32) over square shapes and skinny ones (a few rows against a large
  weight: decode's GEMMs); the peak is the best median FLOP/s.
* **HBM** bandwidth from a reversing copy (one read and one write per element) and an elementwise ``2x + 1``
  over sizes past the caches: the slope of time against bytes moved.
* **collectives**: each kind over each mesh axis (and over all of them) at message sizes from 64 KiB to the
  largest the quick or full sweep allows, fitted as ``t = latency + V / bandwidth`` per kind and axis; the
  all-gather over all axes fixes ``link_bandwidth`` through the collective model's slope. With one device there
  is nothing to measure, and the spec says so.

The result is the catalog chip of this device kind (:func:`lab.run.environment.chip_for_device`) with the
measured fields replaced and ``calibrated`` set, written to ``specs/<backend>-<kind>.json`` with its provenance
(device kind, jax, jaxlib, libtpu or CUDA plugin versions, date) and every measured point. The same code runs on
emulated CPU devices (that is its test), where the spec is labelled emulated.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from lab.core.devices import chip_for_device, spec_name
from lab.core.errors import UserError
from lab.core.files import write_atomic
from lab.core.hardware import Chip, default_catalog, specs_dir
from lab.measure import fit
from lab.measure import microbench as mb

SQUARE = {"quick": (1024, 2048), "full": (1024, 2048, 4096, 8192)}
SKINNY_ROWS = {"quick": (16,), "full": (16, 128)}
SKINNY_K = {"quick": 2048, "full": 8192}
HBM_MIB = {"quick": (16, 64), "full": (64, 256, 1024)}
COLLECTIVE_BYTES = {"quick": (2**16, 2**20, 2**22), "full": (2**16, 2**18, 2**20, 2**22, 2**24, 2**26)}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def device_seconds(fn: Callable, args, names: set[str] | None = None, repeats: int = 5) -> float:
    """One call's device time: the sum of its ops' median self times in a trace (``names``: only those ops)."""
    from lab.measure import profile, trace

    with tempfile.TemporaryDirectory(prefix="shardlab-calibrate-") as logdir:
        files = profile.record(fn, args, logdir, warmup=2, repeats=repeats)
        stats = trace.parse(files, names).per_op()
    if not stats:
        raise UserError("the trace held no device ops to time; is the profiler working on this backend?")
    return sum(s.median_self_s for s in stats.values())


def matmuls(size: str, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """``{dtype, m, k, n, seconds, flops_per_s}`` per shape: square ``n x n @ n x n`` and skinny ``m x k @ k x k``."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    mm = jax.jit(lambda a, b: a @ b)
    shapes = [(n, n, n) for n in SQUARE[size]] + [(m, SKINNY_K[size], SKINNY_K[size]) for m in SKINNY_ROWS[size]]
    rows = []
    for short, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        for m, k, n in shapes:
            a = jax.device_put(jnp.ones((m, k), dtype), dev)
            b = jax.device_put(jnp.ones((k, n), dtype), dev)
            t = device_seconds(mm, (a, b))
            rows.append({"dtype": short, "m": m, "k": k, "n": n, "seconds": t, "flops_per_s": 2.0 * m * k * n / t})
        best = max(r["flops_per_s"] for r in rows if r["dtype"] == short)
        say(f"matmul {short}: best {best / 1e12:.3g} TFLOP/s over {len(shapes)} shapes")
    return rows


def memory(size: str, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """``{op, bytes, seconds}``: a reversing copy and ``2x + 1`` (each reads and writes every element)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    ops = {"copy": jax.jit(lambda x: x[::-1]), "elementwise": jax.jit(lambda x: 2.0 * x + 1.0)}
    rows = []
    for mib in HBM_MIB[size]:
        x = jax.device_put(jnp.ones((mib * 2**20 // 4,), jnp.float32), dev)
        for name, f in ops.items():
            rows.append({"op": name, "bytes": 2.0 * x.nbytes, "seconds": device_seconds(f, (x,))})
        del x
    for name in ops:
        bw = _slope_bandwidth([r for r in rows if r["op"] == name])
        say(f"memory {name}: {bw / 1e9:.3g} GB/s")
    return rows


def _slope_bandwidth(rows: list[dict[str, Any]]) -> float:
    """Bytes per second from the slope of time against bytes (the largest size alone when there is one)."""
    if len(rows) == 1:
        return rows[0]["bytes"] / rows[0]["seconds"]
    _, b, _ = fit.line([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    return 1.0 / b if b > 0 else max(r["bytes"] / r["seconds"] for r in rows)


def collectives(mesh_shape: dict[str, int], size: str, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """``{kind, axes, group, points: [[V, seconds], ...], latency_s, bandwidth}`` per kind and axis group."""
    from kernels.mesh import make_mesh

    mesh = make_mesh(mesh_shape)
    groups = [(a,) for a, n in mesh_shape.items() if n > 1]
    if len(groups) > 1:
        groups.append(tuple(g[0] for g in groups))
    out = []
    for axes in groups:
        g = math.prod(mesh_shape[a] for a in axes)
        for kind in KINDS:
            points = mb.collective_points(mesh, kind, axes, COLLECTIVE_BYTES[size], repeats=5)
            a, b, r2 = fit.line([p[0] for p in points], [p[1] for p in points])
            out.append(
                {
                    "kind": kind,
                    "axes": list(axes),
                    "group": g,
                    "points": points,
                    "latency_s": max(a, 0.0),
                    "bandwidth": 1.0 / b if b > 0 else None,
                    "r2": r2,
                }
            )
        say(f"collectives over {','.join(axes)} ({g} devices): {', '.join(KINDS)}")
    return out


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-runtime-cu12"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def fitted_chip(base: Chip, mm: list, mem: list, coll: list, mesh_shape: dict[str, int], provenance: dict) -> Chip:
    """``base`` with the measured peak FLOP/s, HBM bandwidth, link bandwidth and collective latency."""
    peaks = dict(base.peak_flops)
    for dt in {r["dtype"] for r in mm}:
        peaks[dt] = max(r["flops_per_s"] for r in mm if r["dtype"] == dt)
    hbm = _slope_bandwidth([r for r in mem if r["op"] == "copy"])
    changes: dict[str, Any] = {"peak_flops": peaks, "hbm_bandwidth": hbm}
    day = provenance["date"]
    sources = dict(base.sources) | {f"peak_flops.{dt}": f"calibrated {day}: best matmul over shapes" for dt in peaks}
    sources["hbm_bandwidth"] = f"calibrated {day}: reversing copy, slope over sizes"
    whole = [
        c
        for c in coll
        if c["kind"] == "all-gather" and len(c["axes"]) == len([a for a in mesh_shape if mesh_shape[a] > 1])
    ]
    if whole and whole[0]["bandwidth"]:
        sizes = tuple(n for n in mesh_shape.values() if n > 1)
        model = fit.model_slopes(base, sizes)["all-gather"]  # seconds per byte of V with a 1 B/s link
        changes["link_bandwidth"] = model * whole[0]["bandwidth"]
        changes["launch_latency_s"] = whole[0]["latency_s"]
        sources["link_bandwidth"] = f"calibrated {day}: all-gather over every axis, slope against the model's"
        sources["launch_latency_s"] = f"calibrated {day}: all-gather over every axis, intercept"
    notes = (
        f"Calibrated {day} on {provenance['device_count']} {provenance['backend']} devices "
        f"({provenance['device_kind']!r})"
        + ("; EMULATED host devices, not an accelerator" if provenance["backend"] == "cpu" else "")
    )
    calibration = {"provenance": provenance, "matmul": mm, "memory": mem, "collectives": coll}
    return dataclasses.replace(base, **changes, sources=sources, calibrated=True, notes=notes, calibration=calibration)


def calibrate_device(
    mesh_shape: dict[str, int] | None = None,
    *,
    quick: bool = False,
    hardware: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Chip, list[str]]:
    """Measure this backend's devices; the fitted chip and warnings (one device: no collectives)."""
    import jax

    say = progress or (lambda _text: None)
    devs = jax.devices()
    backend, kind = devs[0].platform, devs[0].device_kind
    base = default_catalog().get(hardware or (chip_for_device(kind) if backend != "cpu" else "cpu"))
    size = "quick" if quick else "full"
    warnings: list[str] = []
    mesh_shape = mesh_shape or {"X": len(devs)}
    mm = matmuls(size, say)
    mem = memory(size, say)
    coll: list[dict[str, Any]] = []
    if math.prod(mesh_shape.values()) < 2:
        warnings.append(f"one {backend} device: no collectives to measure; link_bandwidth stays the catalog's")
    else:
        coll = collectives(mesh_shape, size, say)
    provenance = {
        "backend": backend,
        "device_kind": kind,
        "device_count": len(devs),
        "mesh": mesh_shape,
        "versions": _versions(),
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        "base": base.name,
    }
    return fitted_chip(base, mm, mem, coll, mesh_shape, provenance), warnings


def write_device_spec(chip: Chip, path: str | os.PathLike | None = None) -> Path:
    """``specs/<backend>-<kind>.json`` (or ``path``), written atomically."""
    prov = chip.calibration["provenance"]
    p = Path(path) if path is not None else specs_dir() / spec_name(prov["backend"], prov["device_kind"])
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, json.dumps(chip.fields(), indent=2, allow_nan=False) + "\n")
    return p


__all__ = ["calibrate_device", "device_seconds", "fitted_chip", "write_device_spec"]
