"""The ledger: one row per executed op, predicted beside measured.

:func:`predict_ops` walks the optimized HLO of a program (no JAX needed) and prices every op that runs
(fusions, dots, collectives, copies, custom calls) with the roofline of a hardware spec:

* **matmul**: a dot, or a fusion containing one: ``max(FLOPs / peak, bytes / W_hbm)`` at the dot's dtype;
* **collective**: the collective model (:func:`lab.predict.collectives.collective_time`) over the mesh axes its
  replica groups span, with V in the model's convention;
* **attention / elementwise / other**: memory-bound, ``bytes / W_hbm`` (operands read plus result
  written); ``attention`` when the op came from an ``attention`` named scope.

:func:`join` puts the profiler's per-op medians beside the predictions, by HLO instruction name, and
computes the coverage: the share of measured time spent in ops the ledger predicts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from lab.compile.hlo import (
    Instruction,
    Module,
    axes_of_groups,
    axes_of_pairs,
    collectives,
    operand_shapes,
    parse_module,
)
from lab.compile.hlo_dots import convolution_flops, custom_call_flops
from lab.core.collective_kinds import HLO_NAME, HLO_NAMES
from lab.core.hardware import Chip
from lab.predict.collectives import collective_time
from lab.predict.placement import on_mesh
from lab.predict.roofline import roofline

KINDS = ("matmul", *HLO_NAMES, "attention", "elementwise", "other")
_NO_WORK = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
    "copy-start",
    "copy-done",
    "add-dependency",
}
_LAB_DTYPE = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "s8": "int8", "f8e4m3fn": "fp8", "f8e5m2": "fp8"}


@dataclass(frozen=True)
class PredictedOp:
    name: str
    kind: str
    predicted_s: float
    flops: float
    bytes: float
    collective_bytes: float
    times: float = 1.0  # executions per program run (loop trip counts)
    axes: tuple[str, ...] = ()
    scope: str = ""


def _dots_in(module: Module, comp: str, depth: int = 0) -> list[Instruction]:
    out = []
    for instr in module.computations.get(comp, []):
        if instr.opcode in ("dot", "convolution"):  # the TPU compiler writes matmuls as convolutions
            out.append(instr)
        elif depth < 8:
            for callee, _ in module.calls(instr):
                out += _dots_in(module, callee, depth + 1)
    return out


def _dot_flops(module: Module, d: Instruction) -> tuple[float, str]:
    ops = operand_shapes(module, d)
    if d.opcode == "convolution":
        return convolution_flops(module, d) or 0.0, ops[0].dtype if ops else "f32"
    lhs_c = d.attr("lhs_contracting_dims") or "{}"
    cdims = [int(x) for x in lhs_c.strip("{}").split(",") if x.strip()]
    k = math.prod(ops[0].dims[i] for i in cdims) if ops and cdims else 1
    out = d.result[0] if d.result else None
    dtype = ops[0].dtype if ops else (out.dtype if out else "f32")
    return (2.0 * out.elements * k if out else 0.0), dtype


def _collectives_inside_fusions(module: Module, found: list) -> dict[str, list]:
    """Computation name -> the collectives inside it, for computations a fusion calls (not the entry nor a loop
    body, whose collectives are ops of their own): the TPU compiler wraps its all-gathers in fusions."""
    where = {instr.name: instr.computation for instr, _ in module.walk()}
    out: dict[str, list] = {}
    for c in found:
        comp = where.get(c.name)
        if comp and comp != module.entry and not _is_loop_body(module, comp):
            out.setdefault(comp, []).append(c)
    return out


def _collective_price(held: list, chip: Chip, mesh: dict[str, int], slow: tuple[str, ...]):
    """Seconds for these collectives one after another, and the mesh axes of the first."""
    total, first_axes = 0.0, None
    for c in held:
        axes = (
            axes_of_pairs(list(c.pairs), mesh)
            if c.kind == "permute"
            else axes_of_groups([list(g) for g in c.groups], mesh)
        ) or ()
        first_axes = tuple(axes) if first_axes is None else first_axes
        sizes = [mesh[a] for a in axes] or [max(c.group_size, 1)]
        if math.prod(sizes) > 1 and c.bytes:
            total += collective_time(c.kind, c.bytes, sizes, chip, **on_mesh(axes, mesh, slow)).time_s
    return total, first_axes or ()


def _peak_dtype(chip: Chip, hlo_dtype: str) -> str:
    dt = _LAB_DTYPE.get(hlo_dtype, "fp32")
    if dt in chip.peak_flops:
        return dt
    return "bf16" if "bf16" in chip.peak_flops else next(iter(chip.peak_flops))


def predict_ops(hlo_text: str, chip: Chip, mesh: dict[str, int], slow: tuple[str, ...] = ()) -> list[PredictedOp]:
    """Price every op the program executes on ``chip`` (see the module docstring); a collective over one of the
    ``slow`` axes is priced across nodes, on the scale-out (DCN) bandwidth, as the estimator prices it."""
    module = parse_module(hlo_text)
    found = collectives(module)
    colls = {c.name: c for c in found}
    inside = _collectives_inside_fusions(module, found)
    out: list[PredictedOp] = []
    for instr, times in module.walk():
        if instr.opcode in _NO_WORK or instr.opcode in ("while", "call", "conditional"):
            continue
        parent_is_fusion = instr.computation != module.entry and not _is_loop_body(module, instr.computation)
        if parent_is_fusion:
            continue  # inside a fusion: priced with the fusion
        op_name = module.op_name(instr)
        scope = op_name
        result_bytes = sum(s.bytes for s in instr.result)
        operand_bytes = sum(s.bytes for s in operand_shapes(module, instr))
        nbytes = result_bytes + operand_bytes
        held = [colls[instr.name]] if instr.name in colls else []
        held = held or [c for callee, _ in module.calls(instr) for c in inside.get(callee, ())]
        dots = [instr] if instr.opcode in ("dot", "convolution") else []
        for callee, _ in module.calls(instr):
            dots += _dots_in(module, callee)
        coll_t, axes = _collective_price(held, chip, mesh, slow) if held else (0.0, ())
        v = sum(c.bytes for c in held)
        if held and not dots:  # a collective, or a fusion around collectives (the TPU's async collective fusions)
            kind = HLO_NAME[held[0].kind]
            out.append(PredictedOp(instr.name, kind, coll_t, 0.0, nbytes, v, times, axes, scope))
            continue
        if dots:  # a matmul; fused with a collective (a TPU collective matmul) it overlaps the collective
            flops, dtype = 0.0, "f32"
            for d in dots:
                f, dtype = _dot_flops(module, d)
                flops += f
            r = roofline(chip, flops, nbytes, _peak_dtype(chip, dtype), op=instr.name)
            # A fusion's own metadata can be empty where its dot's is not (XLA:CPU's library fusions); some backward
            # dots carry none at all, and a batched one of those is attention's (the only batched products here).
            scope = scope or next((n for n in map(module.op_name, dots) if n), "")
            batched = any(d.attr("lhs_batch_dims") for d in dots)
            kind = "attention" if ("attention" in scope and "scores" in scope) or (not scope and batched) else "matmul"
            out.append(PredictedOp(instr.name, kind, max(r.time_s, coll_t), flops, nbytes, v, times, axes, scope))
            continue
        kernel = custom_call_flops(module, instr) if instr.opcode == "custom-call" else None
        if kernel:  # a Pallas kernel's call: the FLOPs the audit counts for it, at the roofline of its inputs' dtype
            floats = (s.dtype for s in operand_shapes(module, instr) if s.dtype in _LAB_DTYPE and s.dtype != "s8")
            dtype = next(floats, "f32")  # the first float operand (splash's first are its int8 block masks)
            r = roofline(chip, kernel, nbytes, _peak_dtype(chip, dtype), op=instr.name)
            kind = "attention" if "attention" in scope else "matmul"
            out.append(PredictedOp(instr.name, kind, r.time_s, kernel, nbytes, 0.0, times, (), scope))
            continue
        kind = _kind(instr.opcode, scope)
        out.append(PredictedOp(instr.name, kind, nbytes / chip.hbm_bandwidth, 0.0, nbytes, 0.0, times, (), scope))
    return out


_ELEMENTWISE = frozenset(
    [
        "fusion",
        "add",
        "multiply",
        "subtract",
        "divide",
        "exponential",
        "convert",
        "copy",
        "select",
        "maximum",
        "minimum",
        "negate",
        "reduce",
        "broadcast",
        "transpose",
        "concatenate",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "compare",
        "rsqrt",
        "tanh",
        "log",
        "pad",
        "iota",
        "reshape",
    ]
)


def _kind(opcode: str, scope: str) -> str:
    """A memory-bound op's kind: ``attention`` inside an attention scope, ``elementwise`` for data movement and
    arithmetic, ``other`` for the rest (custom calls, sorts, ...)."""
    if "attention" in scope:
        return "attention"
    return "elementwise" if opcode in _ELEMENTWISE else "other"


def _is_loop_body(module: Module, comp: str) -> bool:
    cache = module.__dict__.setdefault("_loop_bodies", None)
    if cache is None:
        cache = set()
        for instrs in module.computations.values():
            for i in instrs:
                if i.opcode in ("while", "call", "conditional"):
                    cache |= {c for c, _ in module.calls(i)}
                    cond = i.attr("condition")
                    if cond:
                        cache.add(cond.lstrip("%"))
        module.__dict__["_loop_bodies"] = cache
    return comp in cache


@dataclass(frozen=True)
class LedgerRow:
    name: str
    kind: str
    predicted_s: float | None
    measured_s: float | None
    flops: float
    bytes: float
    collective_bytes: float
    scope: str = ""
    estimate_op: str | None = None  # the estimator's named op this HLO op belongs to
    spread: float | None = None  # the slowest of its traced repeats over the fastest
    axes: tuple[str, ...] = ()  # a collective's mesh axes

    @property
    def ratio(self) -> float | None:
        if not self.predicted_s or self.measured_s is None:
            return None
        return self.measured_s / self.predicted_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "ratio": self.ratio,
            "flops": self.flops,
            "bytes": self.bytes,
            "collective_bytes": self.collective_bytes,
            "scope": self.scope,
            "estimate_op": self.estimate_op,
            "spread": self.spread,
            "axes": list(self.axes),
        }


def join(
    predicted: list[PredictedOp], measured: dict[str, float], spreads: dict[str, float] | None = None
) -> tuple[list[LedgerRow], float]:
    """Rows by HLO name (predicted per execution times its count), and the coverage of measured time."""
    rows = []
    seen = set()
    spreads = spreads or {}
    for p in predicted:
        seen.add(p.name)
        rows.append(
            LedgerRow(
                p.name,
                p.kind,
                p.predicted_s * p.times,
                measured.get(p.name),
                p.flops * p.times,
                p.bytes * p.times,
                p.collective_bytes * p.times,
                p.scope,
                spread=spreads.get(p.name),
                axes=p.axes,
            )
        )
    for name, m in measured.items():
        if name not in seen:
            rows.append(LedgerRow(name, "other", None, m, 0.0, 0.0, 0.0, spread=spreads.get(name)))
    total = sum(m for m in measured.values() if m)
    covered = sum(r.measured_s for r in rows if r.measured_s and r.predicted_s is not None)
    coverage = covered / total if total else 0.0
    return rows, coverage


# ----- the estimator's column -------------------------------------------------------------------------------------

COLLECTIVE_ROWS = HLO_NAMES


def _segments(op_name: str) -> str:
    """The name stack without JAX's transformation wrappers: ``jit(step)/transpose(jvp(logits))/dot_general`` ->
    ``step/logits/dot_general`` (a scope outside a loop is wrapped, ``jvp(norm)``; one inside is not)."""
    return "/".join(re.sub(r"^(?:[\w.]+\()+", "", seg).rstrip(")") for seg in op_name.split("/"))


def _in_scope(scope: str, op_name: str) -> bool:
    """``scope`` (``attention/qkv``) names consecutive segments of the HLO op's name stack."""
    return re.search(rf"(^|/){re.escape(scope)}(/|$)", _segments(op_name)) is not None


def _estimate_of(row: LedgerRow, scoped: list[Any], by_kind: dict[str, Any], entries: dict[str, str]) -> str | None:
    """The estimator op an HLO row belongs to: collectives by the audit's matching, compute by named scope (the
    longest that fits), else an unscoped op of the same kind."""
    if row.kind in COLLECTIVE_ROWS:
        return entries.get(row.name)
    for op in scoped:  # longest scope first
        if _in_scope(op.scope, row.scope):
            return op.name
    op = by_kind.get("matmul" if row.flops > 0 and row.kind != "attention" else row.kind)
    if op is None and not row.scope:  # XLA kept no name stack: the one scoped op of its kind, if there is one
        same = [o for o in scoped if o.kind == row.kind]
        op = same[0] if len(same) == 1 else None
    return op.name if op is not None else None


def join_estimates(rows: list[LedgerRow], estimate, audit_entries: list[dict[str, Any]]) -> tuple[list, list, float]:
    """Put the estimator's column beside the compiled and measured ones.

    Args:
        rows: the ledger's HLO rows (:func:`join`).
        estimate: the :class:`lab.predict.program.estimate.ProgramEstimate` of the same Plan.
        audit_entries: the audit's entries (``to_dict()``): which HLO collectives each expected collective matched.

    Returns:
        ``(rows, named, coverage)``: the rows with ``estimate_op`` set; one row per named op (estimated_s,
        predicted_s and measured_s summed over its HLO ops, FLOPs estimated and compiled); and the share of
        measured matmul and collective time that falls in ops with an estimate.
    """
    compute = [o for o in estimate.ops if not o.is_collective]
    scoped = sorted((o for o in compute if o.scope), key=lambda o: -len(o.scope))
    by_kind = {o.kind: o for o in compute if not o.scope}
    entry_of = {name: e["op"] for e in audit_entries for name in e.get("instructions", ())}
    out = [dataclasses.replace(r, estimate_op=_estimate_of(r, scoped, by_kind, entry_of)) for r in rows]
    named: dict[str, dict[str, Any]] = {}
    for o in compute:
        named[o.name] = _named_row(o.name, o.kind, o.time_s, o.flops)
        named[o.name]["bytes_estimated"] = o.bytes
    for e in audit_entries:
        named[e["op"]] = _named_row(e["op"], e["kind"], e.get("predicted_time_s") or 0.0, 0.0)
        named[e["op"]]["bytes_estimated"] = e["predicted_bytes"]
    for r in out:
        if r.estimate_op in named:
            n = named[r.estimate_op]
            n["hlo_ops"] += 1
            n["predicted_s"] += r.predicted_s or 0.0
            n["flops_compiled"] += r.flops
            n["bytes_compiled"] += r.collective_bytes or r.bytes
            if r.measured_s is not None:
                n["measured_s"] = (n["measured_s"] or 0.0) + r.measured_s
    for n in named.values():
        n["ratio"] = n["measured_s"] / n["estimated_s"] if n["measured_s"] and n["estimated_s"] else None
    heavy = [r for r in out if r.measured_s and (r.flops > 0 or r.kind in COLLECTIVE_ROWS)]
    total = sum(r.measured_s for r in heavy)
    covered = sum(r.measured_s for r in heavy if r.estimate_op)
    return out, list(named.values()), (covered / total if total else 0.0)


def _named_row(name: str, kind: str, estimated_s: float, flops: float) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "estimated_s": estimated_s,
        "predicted_s": 0.0,
        "measured_s": None,
        "ratio": None,
        "flops_estimated": flops,
        "flops_compiled": 0.0,
        "bytes_estimated": 0.0,
        "bytes_compiled": 0.0,
        "hlo_ops": 0,
    }
