"""What a host calibration says of itself: each field's source (how it was measured and fitted, with its R^2), the
spec's notes, the record of every timing kept under ``calibration``, and the calibrated chip assembled from them.
Pure functions of :mod:`lab.measure.calibrate`'s measurements; nothing here measures."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.measure import fit
from lab.measure import microbench as mb
from lab.measure.calibrate_settings import COLLECTIVE_BYTES, LATENCY_STEPS, MEMORY_MIB
from lab.predict.collectives import KINDS as MODEL_KINDS
from lab.predict.collectives import collective_time

# run, m, f: lab.measure.calibrate's _Run (the mesh and sweep), _Measured (every timing) and _Fitted (the fits);
# typed Any here so that this module, which calibrate imports, imports nothing of it


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


def _sources(today: str, run: Any, m: Any, f: Any) -> dict[str, str]:
    """What ``sources`` says of each field calibrate sets: how it was measured and fitted, with its R^2.

    The R^2 are those of one device alone (before :func:`lab.measure.fit.prefer_concurrent`); the fields the
    spec takes from every device at once are described as such (:func:`_concurrent_sources`).
    """
    by_term = {term_fit.term: term_fit for term_fit in f.single_device}

    def measured(term: str, how: str) -> str:
        r2 = by_term[term].r2
        r2_text = "n/a (not a line fit)" if r2 is None else f"{r2:.4f}"
        return f"measured on this host by shardlab calibrate on {today}: {how}, R^2={r2_text}"

    sources: dict[str, str] = {}
    for short, rows in m.matmul.items():
        sources[f"peak_flops.{short}"] = measured(
            f"peak_flops.{short}",
            f"jitted [n,n]@[n,n] {short} on ONE emulated device, n in {[r[0] for r in rows]}; the best median "
            f"achieved FLOP/s (n={fit.best_matmul(rows)[0]}); XLA:CPU may spread one device's dot over several "
            f"host threads",
        )
    mib = MEMORY_MIB[run.q]
    sources["hbm_bandwidth"] = measured(
        "hbm_bandwidth",
        f"donated in-place x*1.0001 (float32) on ONE emulated device over {mib[0]}-{mib[-1]} MiB "
        f"arrays, {f.hows['hbm_bandwidth']} (bytes read + written)",
    )
    sources["hbm_bytes"] = measured(
        "hbm_bytes",
        f"host RAM {m.ram / 2**30:.1f} GiB ({m.ram_source}) divided by the {m.devices} emulated devices",
    )
    sizes_txt = ", ".join(f"G={size}: {t * 1e6:.0f} us" for _, size, t in m.latency_by_group)
    steps = LATENCY_STEPS[run.q]
    lat_how = (
        f"in-program time of one ~{mb.LATENCY_ELEMENTS * 4 // 1024} KB-per-device AllGather (loop of {steps[1]} minus "
        f"loop of {steps[0]}, dispatch cancels) over groups {sizes_txt}; {f.hows['latency']}"
    )
    sources["launch_latency_s"] = measured("launch_latency_s", lat_how)
    sources["hop_latency_s"] = measured("hop_latency_s", lat_how)
    coll_sizes = COLLECTIVE_BYTES[run.q]
    sources["link_bandwidth"] = measured(
        "link_bandwidth",
        f"AllGather over all {run.group} devices, V {coll_sizes[0] // 1024} KB-{coll_sizes[-1] // 2**20} MB, "
        f"per-op time under the profiler; t = launch + V(G-1)/(G*W) by least squares (large messages dominate)",
    )
    sources.update(_concurrent_sources(today, m.checks["concurrent"], list(m.matmul)))
    for key, text in (
        ("scaleout_bandwidth", "not measured: one host has no scale-out network (placeholder kept)"),
        ("scaleout_latency_s", "not measured: one host has no scale-out network (placeholder kept)"),
        ("node_size", "one host: every emulated device shares its memory (placeholder kept)"),
    ):
        sources[key] = text
    return sources


def _concurrent_sources(today: str, conc: dict[str, Any], dtypes: list[str]) -> dict[str, str]:
    """``sources`` of the terms the spec takes from all devices busy at once (:func:`fit.concurrent_terms`)."""
    measured = f"measured on this host by shardlab calibrate on {today}"
    sources = {}
    for term in fit.concurrent_terms(conc, dtypes):
        if term == "hbm_bandwidth":
            sources[term] = (
                f"{measured}: in-place copy of {conc['copy_bytes'] / 2**20:.0f} MiB read+write on all "
                f"{conc['devices']} devices at once, per device, R^2=n/a"
            )
        else:
            sources[term] = (
                f"{measured}: {conc['matmul_n']}^3 matmul on every one of the {conc['devices']} devices at once, "
                f"per-device median, R^2=n/a"
            )
    return sources


def _notes(today: str, run: Any, m: Any, cpu: str, jax_version: str) -> str:
    """The chip's ``notes``: what the emulated devices are and what the per-device figures mean."""
    return (
        f"Calibrated by shardlab calibrate on {today} on this host ({cpu}, {os.cpu_count()} logical CPUs, "
        f"jax {jax_version}), mesh {','.join(f'{k}={v}' for k, v in run.mesh.items())}"
        f"{', quick mode' if run.quick else ''}. The {m.devices} devices are emulated by XLA "
        f"(--xla_force_host_platform_device_count): they are threads of one host, the interconnect is memory "
        f"copies between threads of one host, and every timing is emulated, not an accelerator's. peak_flops and "
        f"hbm_bandwidth are per device with all {m.checks['concurrent']['devices']} devices busy at once (how "
        f"sharded programs run); one device alone reaches more (calibration.checks.single_device)."
        + (
            " TAKEN ON A BUSY HOST (--force): other work held the CPUs before or after measuring "
            "(calibration.host.load); its numbers are likely too slow."
            if m.load.get("busy")
            else ""
        )
    )


def _record(today: str, run: Any, m: Any, f: Any, seconds: float, host: dict[str, Any]) -> dict[str, Any]:
    """The chip's ``calibration``: the fits, the factors the collective model reads, and every timing."""
    return {
        "date": today,
        "quick": run.quick,
        "mesh": dict(run.mesh),
        "seconds": seconds,
        "host": host,
        "collective_factor": f.factors,
        "collective_factor_by_group": f.by_group,
        "collectives_by_group": m.group_points,
        "fits": [dataclasses.asdict(term_fit) for term_fit in f.fits],
        "matmul": {k: [list(r) for r in rows] for k, rows in m.matmul.items()},
        "memory": {"inplace": m.copies["inplace"], "fresh_output": m.copies["fresh"]},
        "latency": {
            "all-gather_by_group": m.latency_by_group,
            "by_kind": m.latency_by_kind,
            "steps": list(LATENCY_STEPS[run.q]),
        },
        "collectives": {
            kind: {"axes": list(run.mesh), "axis_sizes": list(run.mesh.values()), "points": m.points[kind]}
            for kind in MODEL_KINDS
        },
        "points_columns": ["V bytes", "seconds (slowest device, traced)"],
        "checks": m.checks,
    }


def _model_checks(checks: dict[str, Any], chip: Chip) -> None:
    """Put the model's time (on the calibrated ``chip``) beside each single-axis AllGather check."""
    for check in checks.get("all_gather_single_axis", []):
        check["model_s"] = collective_time("all-gather", check["bytes"], check["group"], chip).time_s


def _describe(today: str, run: Any, base: Chip, m: Any, f: Any, seconds: float) -> Chip:
    """The calibrated chip: ``base`` with the fitted numbers, where each came from, and every timing."""
    import jax

    cpu = _cpu_model()
    fields = dict(
        **f.values,
        sources={**base.sources, **_sources(today, run, m, f)},
        calibrated=True,
        notes=_notes(today, run, m, cpu, jax.__version__),
    )
    _model_checks(m.checks, dataclasses.replace(base, **fields, calibration={"collective_factor": f.factors}))
    host = {"cpu": cpu, "logical_cpus": os.cpu_count(), "jax": jax.__version__, "devices": m.devices, "load": m.load}
    calibration = _record(today, run, m, f, seconds, host)
    return dataclasses.replace(base, **fields, calibration=_plain(calibration))


def _plain(obj: Any) -> Any:
    """JSON-native values only (tuples become lists), so a written spec loads back to an equal chip."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj
