"""The compiled-program audit: did XLA emit the communication the model predicted?

For a kernel on a mesh, :func:`audit_kernel` builds it (``kernels.registry``), lowers and compiles it,
parses the optimized HLO (:mod:`lab.compile.hlo`) and compares with the analytic prediction for the same plan:

* **Collectives**, grouped by kind and mesh axes, bytes summed in the collective model's convention
  (V: AllGather output, ReduceScatter and AllReduce operand, AllToAll operand x group, permute
  operand), times the trip count of enclosing loops. An entry matches when the bytes agree exactly.
  Known backend differences are named, not hidden: when XLA moved a collective to another element
  type (XLA:CPU runs some bf16 collectives in f32) the entry compares element counts and says so.
  A predicted AllReduce that XLA split into ReduceScatter + AllGather over the same axes matches too,
  with a note.
* **Unexpected collectives** (a reshard nobody predicted) are listed by HLO name with their source line.
* **FLOPs**: every dot in the program (fusions and loops included) against the predicted per-device
  matmul FLOPs; they must agree within 1%. ``cost_analysis()`` and ``memory_analysis()`` ride along.

Predictions come from the analytic side alone: :func:`lab.predict.sharded_matmul.plan_sharded_matmul` for
kernels written in the book's notation, the ring schedule for collective matmuls (``Y - 1`` permute
steps of one chunk), and the collective's own definition for the microkernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from lab.compile.hlo import CompiledCollective, axes_of_groups, axes_of_pairs, collectives, dots, parse_module
from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.table import render
from lab.core.units import dtype_bytes, fmt_bytes, fmt_seconds
from lab.predict.collectives import collective_time
from lab.predict.sharded_matmul import plan_sharded_matmul

FLOP_TOLERANCE = 0.01
HLO_TO_LAB = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "s8": "int8", "f8e4m3fn": "fp8", "f8e5m2": "fp8"}


@dataclass(frozen=True)
class Predicted:
    kind: str
    axes: tuple[str, ...]
    bytes: float
    dtype: str
    op: str
    steps: int = 1  # issued as this many equal collectives (a ring schedule)


@dataclass(frozen=True)
class AuditEntry:
    op: str
    kind: str
    axes: tuple[str, ...]
    predicted_bytes: float
    compiled_bytes: float
    match: bool
    instructions: tuple[str, ...] = ()
    note: str = ""
    predicted_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes"], d["instructions"] = list(self.axes), list(self.instructions)
        return d


@dataclass(frozen=True)
class AuditResult:
    target: str
    mesh: dict[str, int]
    sizes: dict[str, int]
    dtype: str
    backend: str
    entries: tuple[AuditEntry, ...]
    unexpected: tuple[dict[str, Any], ...]
    flops_predicted: float
    flops_compiled: float
    cost_analysis: dict[str, float] = field(default_factory=dict)
    memory_analysis: dict[str, float] = field(default_factory=dict)
    hlo_text: str = ""
    hardware: str | None = None

    @property
    def flops_match(self) -> bool:
        if self.flops_predicted == 0:
            return self.flops_compiled == 0
        return abs(self.flops_compiled / self.flops_predicted - 1) <= FLOP_TOLERANCE

    @property
    def all_match(self) -> bool:
        return all(e.match for e in self.entries) and not self.unexpected and self.flops_match

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mesh": self.mesh,
            "sizes": self.sizes,
            "dtype": self.dtype,
            "backend": self.backend,
            "emulated": self.backend == "cpu",
            "hardware": self.hardware,
            "entries": [e.to_dict() for e in self.entries],
            "unexpected": list(self.unexpected),
            "flops_predicted": self.flops_predicted,
            "flops_compiled": self.flops_compiled,
            "flops_match": self.flops_match,
            "all_match": self.all_match,
            "cost_analysis": self.cost_analysis,
            "memory_analysis": self.memory_analysis,
        }

    def table(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        sizes = ",".join(f"{k}={v}" for k, v in self.sizes.items())
        where = f"{self.backend}, emulated" if self.backend == "cpu" else self.backend
        head = f"audit {self.target} on mesh {mesh} ({where}), sizes {sizes}, {self.dtype}"
        on = f"time on {self.hardware}" if self.hardware else "time"
        rows = []
        for e in self.entries:
            axes = "".join(e.axes) if all(len(a) == 1 for a in e.axes) else ",".join(e.axes)
            t = fmt_seconds(e.predicted_time_s) if e.predicted_time_s is not None else "-"
            rows.append(
                [
                    e.op,
                    e.kind,
                    axes,
                    fmt_bytes(e.predicted_bytes),
                    fmt_bytes(e.compiled_bytes),
                    "yes" if e.match else "NO",
                    t,
                    e.note,
                ]
            )
        headers = ["predicted op", "kind", "axes", "predicted", "compiled", "match", on, "note"]
        out = head + "\n" + (render(headers, rows) if rows else "no collectives predicted")
        for u in self.unexpected:
            axes = ",".join(u["axes"]) if u["axes"] else "?"
            out += (
                f"\nUNEXPECTED {u['kind']} over {axes} ({fmt_bytes(u['bytes'])}): {u['name']} at "
                f"{u['source'] or u['op_name'] or '?'}"
            )
        verdict = "match" if self.flops_match else "MISMATCH"
        out += (
            f"\nFLOPs per device: predicted {self.flops_predicted:.6g}, compiled {self.flops_compiled:.6g} "
            f"({verdict}, tolerance {100 * FLOP_TOLERANCE:g}%)"
        )
        return out + f"\nresult: {'all match' if self.all_match else 'MISMATCH'}"


# ----- predictions -------------------------------------------------------------------------


def _live_axes(axes: tuple[str, ...], mesh: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.get(a, 1) > 1)


def _from_plan(notation: str, sizes: dict[str, int], mesh: dict[str, int], dtype: str) -> tuple[list[Predicted], float]:
    plan = plan_sharded_matmul(notation, sizes, mesh, get_chip("cpu"), dtype)
    out = []
    for c in plan.collectives:
        axes = _live_axes(c.axes, mesh)
        if axes:
            out.append(Predicted(c.kind, axes, c.bytes, dtype, c.describe()))
    return out, plan.local.flops


def predict(
    kernel, mesh: dict[str, int], sizes: dict[str, int], dtype: str, axes: tuple[str, ...] | None = None
) -> tuple[list[Predicted], float]:
    """Predicted collectives and per-device matmul FLOPs of a registry kernel, from the analytic side."""
    b = dtype_bytes(dtype)
    if kernel.family == "collective":
        kind = kernel.name.removeprefix("collective_").replace("_", "-")
        ax = _live_axes(tuple(axes or mesh), mesh)
        g = math.prod(mesh[a] for a in ax)
        n = sizes["N"]
        v = {"all-gather": n * g, "reduce-scatter": n, "all-reduce": n, "all-to-all": n * g, "permute": n}[kind] * b
        return ([Predicted(kind, ax, v, dtype, f"{kind} over {','.join(ax)}")] if g > 1 else []), 0.0
    if kernel.family == "collective_matmul" and kernel.name.startswith("collective_matmul_"):
        y = mesh.get("Y", 1)
        i, j, k = sizes["I"], sizes["J"], sizes["K"]
        if "allgather" in kernel.name:  # A[I_X, J_Y] chunks travel the Y ring
            chunk = i / mesh.get("X", 1) * j / y * b
            flops = 2.0 * i / mesh.get("X", 1) * j * k / y
        else:  # partial Out[I, K_Y] accumulators travel the Y ring
            chunk = i * k / y * b
            flops = 2.0 * i * j / y * k
        preds = [Predicted("permute", ("Y",), (y - 1) * chunk, dtype, f"{y - 1} ring steps over Y", steps=y - 1)]
        preds = preds if y > 1 else []
        return preds, flops
    if kernel.notation is None:
        raise UserError(f"no prediction rule for kernel {kernel.name!r}")
    preds: list[Predicted] = []
    flops = 0.0
    for part in kernel.notation.split(";"):  # a block is several matmuls in sequence
        p, f = _from_plan(part.strip(), sizes, mesh, dtype)
        preds += p
        flops += f
    return preds, flops


# ----- comparison --------------------------------------------------------------------------


def _axes_of(c: CompiledCollective, mesh: dict[str, int]) -> tuple[str, ...] | None:
    if c.kind == "permute":
        return axes_of_pairs(list(c.pairs), mesh)
    return axes_of_groups([list(g) for g in c.groups], mesh)


def _same(a: float, b: float) -> bool:
    """Byte counts agree: exactly, up to the rounding of predictions computed in floating point."""
    return abs(a - b) <= max(0.5, 1e-9 * max(abs(a), abs(b)))


def _lowered(label: str, key: tuple, nbytes: float, used: list, how: str) -> AuditEntry:
    """A match through another lowering that moves the same V (XLA's choice, not a layout error)."""
    return AuditEntry(label, key[0], key[1], nbytes, nbytes, True, tuple(c.name for c in used), how)


def compare(
    predicted: list[Predicted], compiled: list[CompiledCollective], mesh: dict[str, int]
) -> tuple[list[AuditEntry], list[dict[str, Any]]]:
    """Match predicted and compiled collectives per (kind, axes); list what nobody predicted."""
    groups: dict[tuple[str, tuple[str, ...]], list[CompiledCollective]] = defaultdict(list)
    for c in compiled:
        axes = _axes_of(c, mesh)
        key = (c.kind, _live_axes(axes, mesh) if axes is not None else ("?",))
        if key[1] == ():
            continue  # a collective over size-1 axes moves nothing
        groups[key].append(c)
    order = {a: i for i, a in enumerate(mesh)}
    want: dict[tuple[str, tuple[str, ...]], list[Predicted]] = defaultdict(list)
    for p in predicted:  # groups are sets of devices: the order axes are named in is not visible in HLO
        want[(p.kind, tuple(sorted(p.axes, key=order.get)))].append(p)

    entries, used = [], set()
    for key, preds in list(want.items()):
        if key not in want:  # absorbed by an earlier entry (an AllReduce combined with a ReduceScatter)
            continue
        kind, axes = key
        pred_bytes = sum(p.bytes for p in preds)
        pdtype = preds[0].dtype
        label = " + ".join(p.op for p in preds)
        got = groups.get(key, [])
        note = ""
        if not got and kind == "all-reduce":  # XLA may split an AllReduce into ReduceScatter + AllGather
            rs, ag = groups.get(("reduce-scatter", axes), []), groups.get(("all-gather", axes), [])
            rs_b, ag_b = sum(c.bytes * c.times for c in rs), sum(c.bytes * c.times for c in ag)
            if rs and ag and _same(rs_b, pred_bytes) and _same(ag_b, pred_bytes):
                used |= {("reduce-scatter", axes), ("all-gather", axes)}
                entries.append(_lowered(label, key, pred_bytes, rs + ag, "XLA split it into ReduceScatter + AllGather"))
                continue
        if not got and kind == "reduce-scatter":  # XLA:CPU may lower it as AllReduce + local slice
            ar = groups.get(("all-reduce", axes), [])
            also = sum(p.bytes for p in want.get(("all-reduce", axes), []))  # AllReduces predicted there anyway
            if ar and _same(sum(c.bytes * c.times for c in ar), pred_bytes + also):
                if also:
                    want.pop(("all-reduce", axes))
                    entries.append(
                        _lowered(
                            "AllReduces predicted over these axes",
                            ("all-reduce", axes),
                            also,
                            [],
                            "combined with the ReduceScatter below",
                        )
                    )
                used.add(("all-reduce", axes))
                entries.append(
                    _lowered(
                        label,
                        key,
                        pred_bytes,
                        ar,
                        "lowered as AllReduce + local slice: same V, twice the traffic of a ReduceScatter",
                    )
                )
                continue
        comp_bytes = sum(c.bytes * c.times for c in got)
        match = bool(got) and _same(comp_bytes, pred_bytes)
        if got and not match:
            cdtypes = {c.dtype for c in got}
            lab_dtypes = {HLO_TO_LAB.get(d, d) for d in cdtypes}
            if lab_dtypes != {pdtype}:
                elems = sum(c.elements * c.times for c in got)
                if _same(elems * dtype_bytes(pdtype), pred_bytes):
                    match = True
                    note = (
                        f"XLA ran it in {'/'.join(sorted(cdtypes))}, predicted {pdtype}; compared element counts "
                        f"({elems:.0f})"
                    )
        if got:
            used.add(key)
        elif not note:
            note = "not in the compiled program"
        entries.append(
            AuditEntry(
                label,
                kind,
                axes,
                pred_bytes,
                comp_bytes,
                match,
                tuple(c.name for c in got),
                note,
            )
        )
    unexpected = []
    for key, cs in groups.items():
        if key in used:
            continue
        for c in cs:
            unexpected.append(
                {
                    "name": c.name,
                    "kind": c.kind,
                    "axes": list(key[1]),
                    "bytes": c.bytes * c.times,
                    "dtype": c.dtype,
                    "source": c.source,
                    "op_name": c.op_name,
                }
            )
    return entries, unexpected


def audit_compiled(
    target: str,
    compiled,
    predicted: list[Predicted],
    flops_predicted: float,
    mesh: dict[str, int],
    sizes: dict[str, int],
    dtype: str,
    backend: str,
) -> AuditResult:
    """Audit an already-compiled program (``jax.jit(f).lower(...).compile()``) against a prediction."""
    text = compiled.as_text()
    module = parse_module(text)
    compiled_colls = collectives(module)
    entries, unexpected = compare(predicted, compiled_colls, mesh)
    flops = sum(d.flops * d.times for d in dots(module))
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    cost = {k: float(v) for k, v in (cost or {}).items() if k in ("flops", "bytes accessed", "transcendentals")}
    mem = compiled.memory_analysis()
    mem_d = {}
    for name in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    ):
        if hasattr(mem, name):
            mem_d[name] = float(getattr(mem, name))
    return AuditResult(
        target=target,
        mesh=dict(mesh),
        sizes=dict(sizes),
        dtype=dtype,
        backend=backend,
        entries=tuple(entries),
        unexpected=tuple(unexpected),
        flops_predicted=flops_predicted,
        flops_compiled=flops,
        cost_analysis=cost,
        memory_analysis=mem_d,
        hlo_text=text,
    )


def audit_kernel(
    name: str,
    mesh: dict[str, int],
    sizes: dict[str, int],
    dtype: str = "fp32",
    axes: tuple[str, ...] | None = None,
    chip=None,
) -> AuditResult:
    """Build, compile and audit a registry kernel on a mesh of this process's devices.

    ``chip`` (a catalog chip) prices each predicted collective on that hardware (``predicted_time_s``).
    """
    import jax

    from kernels.mesh import make_mesh
    from kernels.registry import get_kernel

    kernel = get_kernel(name)
    jmesh = make_mesh(mesh)
    built = kernel.build(jmesh, sizes, dtype, axes)
    compiled = built.fn.lower(*built.args).compile()
    predicted, flops = predict(kernel, mesh, sizes, dtype, axes)
    result = audit_compiled(name, compiled, predicted, flops, mesh, sizes, dtype, jax.devices()[0].platform)
    if chip is None:
        return result
    order = {a: i for i, a in enumerate(mesh)}
    times: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    for p in predicted:
        one = collective_time(p.kind, p.bytes / p.steps, [mesh[a] for a in p.axes], chip).time_s
        times[(p.kind, tuple(sorted(p.axes, key=order.get)))] += p.steps * one
    priced = tuple(dataclasses.replace(e, predicted_time_s=times.get((e.kind, e.axes))) for e in result.entries)
    return dataclasses.replace(result, entries=priced, hardware=chip.name)
