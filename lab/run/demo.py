"""The default scenario that ``./scripts/demo`` runs: one Transformer MLP, eight devices.

Until the measurement harness exists this is the analytic half of the main job: roofline, the
book's four sharded-matmul cases and the collectives of a LLaMA-3-8B-sized MLP block
(D = 4096, F = 14336; HF config of Meta-Llama-3-8B) on a 2x4 mesh of the target chip, plus a check
on the 8 emulated host devices that every operand's ``PartitionSpec`` gives the per-device shape the
notation predicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lab.core.hardware import Chip, default_catalog
from lab.core.notation import parse_matmul
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_rate, fmt_seconds
from lab.predict.collectives import collective_time
from lab.predict.program.sharded_matmul import plan_sharded_matmul
from lab.predict.roofline import matmul

D_MODEL, D_FF = 4096, 14336  # LLaMA-3 8B (HF config)
TOKENS = 8192  # global token batch of the scenario
MESH = {"X": 2, "Y": 4}
CASES = (
    ("1: no sharded contraction", "In[B_X, D] * W[D, F_Y]"),
    ("2: one side sharded on D", "In[B, D_X] * W[D, F]"),
    ("3: both sharded on D, scatter", "In[B, D_Y] * W[D_Y, F] -> Out[B, F_Y]"),
    ("4: same axis on both free dims", "In[B_X, D] * W[D, F_X]"),
    ("Megatron MLP, up-projection", "In[B_X, D] * Win[D, F_Y]"),
    ("Megatron MLP, down-projection", "H[B_X, F_Y] * Wout[F_Y, D] -> Out[B_X, D]"),
)
# Prime-ish sizes times the device count: a transposed or mis-sharded dim fails the check at once.
CHECK_SIZES = {"B": 7 * 8, "D": 11 * 8, "F": 13 * 8}


@dataclass(frozen=True)
class DemoReport:
    data: dict[str, Any]
    text: str


def _placement_check(exprs: list[str]) -> dict[str, Any]:
    """Lay every operand out on the emulated 2x4 mesh and compare shard shapes with the notation."""
    try:
        import jax

        from kernels.mesh import make_mesh, place_zeros
    except Exception as exc:
        return {"ran": False, "reason": f"JAX unavailable: {exc}"}
    if jax.device_count() < math.prod(MESH.values()):
        return {
            "ran": False,
            "reason": f"{jax.device_count()} device(s); set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 (./scripts/demo does)",
        }
    mesh = make_mesh(MESH)
    checked, bad = 0, []
    for text in exprs:
        e = parse_matmul(text)
        for arr in (e.lhs, e.rhs):
            x = place_zeros(arr, CHECK_SIZES, mesh)
            want = arr.local_shape(MESH, CHECK_SIZES)
            got = {tuple(s.data.shape) for s in x.addressable_shards}
            checked += 1
            if got != {want}:
                bad.append(f"{arr}: predicted {want}, JAX placed {sorted(got)}")
    return {
        "ran": True,
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "emulated": jax.devices()[0].platform == "cpu",
        "operands": checked,
        "mismatches": bad,
    }


def _header(chip: Chip, dtype: str) -> list[str]:
    """The scenario, what each section is, and the target chip's numbers."""
    return [
        f"shardlab demo: LLaMA-3-8B MLP block (D={D_MODEL}, F={D_FF}), {TOKENS} tokens, "
        f"mesh X={MESH['X']} x Y={MESH['Y']}, {dtype}, predicted for {chip.name}",
        "Sections 1-3 predict for the target chip; 4 checks placement on the emulated mesh; 5 is the main job.",
        f"{chip.name}: {fmt_rate(chip.flops(dtype), 'FLOP/s')} {dtype}, {fmt_bytes(chip.hbm_bytes)} HBM at "
        f"{fmt_rate(chip.hbm_bandwidth, 'B/s')} (critical intensity {chip.critical_intensity(dtype):.0f}), "
        f"link {fmt_rate(chip.link_bandwidth, 'B/s')} one way"
        + (" [uncalibrated placeholder numbers]" if chip.kind == "cpu" and not chip.calibrated else ""),
    ]


def _roofline(chip: Chip, dtype: str) -> tuple[list[dict[str, Any]], str]:
    """Section 1: the up-projection per chip over token batches, as data and as a table."""
    rows, rl = [], []
    for b in (16, 64, 256, 1024, 4096):
        r = matmul(chip, b, D_MODEL, D_FF, dtype=dtype)
        rl.append(r.to_dict())
        rows.append([b, f"{r.intensity:.0f}", r.bound, fmt_seconds(r.time_s), f"{100 * r.compute_s / r.time_s:.0f}%"])
    crit = matmul(chip, 1, D_MODEL, D_FF, dtype=dtype).critical_batch
    table = render(
        ["tokens/chip", "intensity", "bound", "time", "of peak FLOPs"],
        rows,
        title=f"1. Roofline: In[B, {D_MODEL}] @ W[{D_MODEL}, {D_FF}] on one chip (compute-bound above B = {crit:.0f})",
    )
    return rl, table


def _sharded_matmuls(chip: Chip, dtype: str) -> tuple[list[dict[str, Any]], str]:
    """Section 2: the book's four cases and a Megatron MLP planned on the mesh, as data and as a table."""
    sizes = {"B": TOKENS, "D": D_MODEL, "F": D_FF}
    rows, plans = [], []
    for label, expr in CASES:
        p = plan_sharded_matmul(expr, sizes, MESH, chip, dtype)
        plans.append({"case": label, **p.to_dict()})
        comm = "; ".join(c.describe().split(" ")[0] + f" {fmt_bytes(c.bytes)}" for c in p.collectives) or "none"
        rows.append(
            [label, expr, p.output, comm, fmt_seconds(p.compute_s), fmt_seconds(p.comm_s) if p.collectives else "-"]
        )
    table = render(
        ["case", "expression", "output", "collectives", "compute", "comm"],
        rows,
        title=f"2. Sharded matmuls on a {MESH['X']}x{MESH['Y']} mesh (B={TOKENS}, D={D_MODEL}, F={D_FF})",
    )
    return plans, table


def _collectives(chip: Chip) -> tuple[list[dict[str, Any]], str]:
    """Section 3: the layer's collectives, with and without wraparound on a torus, as data and as a table."""
    wbytes = D_MODEL * D_FF * 2
    abytes = TOKENS // MESH["X"] * D_MODEL * 2
    rows, colls = [], []
    items = (
        ("all-gather", "weights W[D, F] over Y (FSDP-style)", wbytes, (4,)),
        ("reduce-scatter", "weight grads over X x Y", wbytes, (2, 4)),
        ("all-reduce", "activations Out[B_X, D] over Y (TP)", abytes, (4,)),
        ("all-to-all", "activations over Y", abytes, (4,)),
        ("all-reduce", "a 32 kB message over Y", 32e3, (4,)),
    )
    torus = chip.topology == "torus"
    for kind, what, v, axes in items:
        a = collective_time(kind, v, axes, chip)
        b = collective_time(kind, v, axes, chip, wraparound=False) if torus else None
        colls.append({"what": what, "ring": a.to_dict(), "no_wraparound": b.to_dict() if b else None})
        rows.append(
            [
                kind,
                what,
                fmt_bytes(v),
                fmt_seconds(a.time_s),
                fmt_seconds(b.time_s) if b else "n/a",
                "yes" if a.latency_bound else "no",
            ]
        )
    table = render(
        ["collective", "what", "bytes (V)", "ring", "no wraparound", "latency-bound"],
        rows,
        title=f"3. Collectives ({'ICI torus' if torus else chip.topology}; latency-bound below "
        f"{fmt_bytes(chip.latency_bound_bytes)} per shard)",
    )
    return colls, table


def _placement_lines(check: dict[str, Any]) -> list[str]:
    """Section 4: what :func:`_placement_check` found, or why it did not run."""
    if not check["ran"]:
        return [f"4. Emulated-mesh check skipped: {check['reason']}"]
    ok = check["operands"] - len(check["mismatches"])
    label = "emulated CPU devices" if check["emulated"] else f"{check['platform']} devices"
    return [
        f"4. Emulated-mesh check ({check['devices']} {label}, mesh X=2 x Y=4): {ok}/{check['operands']} "
        f"operands placed by JAX with the per-device shapes the notation predicts",
        *(f"   MISMATCH {m}" for m in check["mismatches"]),
    ]


def run_demo(hardware: str = "tpu-v5e", hardware_file: str | None = None) -> DemoReport:
    """Build the default scenario's report for ``hardware``."""
    chip = default_catalog(hardware_file).get(hardware)
    dtype = "bf16" if "bf16" in chip.peak_flops else next(iter(chip.peak_flops))
    data: dict[str, Any] = {
        "scenario": {"d_model": D_MODEL, "d_ff": D_FF, "tokens": TOKENS, "mesh": MESH, "dtype": dtype},
        "hardware": chip.to_dict(),
    }
    out = _header(chip, dtype)

    # 1-3 predict for the target chip: roofline, the sharded matmuls, the layer's collectives.
    data["roofline"], roofline = _roofline(chip, dtype)
    data["sharded_matmuls"], sharded = _sharded_matmuls(chip, dtype)
    data["collectives"], collectives = _collectives(chip)
    out += ["", roofline, "", sharded, "", collectives]

    # 4. Structure on the emulated mesh.
    check = _placement_check([e for _, e in CASES])
    data["placement_check"] = check
    if check["ran"]:
        where = "8 emulated CPU devices" if check["emulated"] else f"{check['devices']} {check['platform']} devices"
        sizes = "the toy sizes of experiments/tp_mlp.toml" if check["emulated"] else "these sizes in bf16"
        out[1] = (
            f"Sections 1-3 predict for the target chip; 4 checks placement on {where}; 5 runs the MLP block there at "
            f"{sizes} (compile, audit, profile, the per-op ledger)."
        )
    out += ["", *_placement_lines(check)]
    return DemoReport(data=data, text="\n".join(out))
