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

import math
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
from lab.core.hardware import Chip
from lab.predict.collectives import collective_time
from lab.predict.roofline import roofline

KINDS = (
    "matmul",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "attention",
    "elementwise",
    "other",
)
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
        if instr.opcode == "dot":
            out.append(instr)
        elif depth < 8:
            for callee, _ in module.calls(instr):
                out += _dots_in(module, callee, depth + 1)
    return out


def _dot_flops(module: Module, d: Instruction) -> tuple[float, str]:
    ops = operand_shapes(module, d)
    lhs_c = d.attr("lhs_contracting_dims") or "{}"
    cdims = [int(x) for x in lhs_c.strip("{}").split(",") if x.strip()]
    k = math.prod(ops[0].dims[i] for i in cdims) if ops and cdims else 1
    out = d.result[0] if d.result else None
    dtype = ops[0].dtype if ops else (out.dtype if out else "f32")
    return (2.0 * out.elements * k if out else 0.0), dtype


def _peak_dtype(chip: Chip, hlo_dtype: str) -> str:
    dt = _LAB_DTYPE.get(hlo_dtype, "fp32")
    if dt in chip.peak_flops:
        return dt
    return "bf16" if "bf16" in chip.peak_flops else next(iter(chip.peak_flops))


def predict_ops(hlo_text: str, chip: Chip, mesh: dict[str, int]) -> list[PredictedOp]:
    """Price every op the program executes on ``chip`` (see the module docstring)."""
    module = parse_module(hlo_text)
    colls = {c.name: c for c in collectives(module)}
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
        if instr.name in colls:
            c = colls[instr.name]
            axes = (
                axes_of_pairs(list(c.pairs), mesh)
                if c.kind == "permute"
                else axes_of_groups([list(g) for g in c.groups], mesh)
            ) or ()
            sizes = [mesh[a] for a in axes] or [max(c.group_size, 1)]
            kind = "collective-permute" if c.kind == "permute" else c.kind
            t = collective_time(c.kind, c.bytes, sizes, chip).time_s if math.prod(sizes) > 1 and c.bytes > 0 else 0.0
            out.append(PredictedOp(instr.name, kind, t, 0.0, nbytes, c.bytes, times, tuple(axes), scope))
            continue
        dots = [instr] if instr.opcode == "dot" else []
        for callee, _ in module.calls(instr):
            dots += _dots_in(module, callee)
        if dots:
            flops, dtype = 0.0, "f32"
            for d in dots:
                f, dtype = _dot_flops(module, d)
                flops += f
            r = roofline(chip, flops, nbytes, _peak_dtype(chip, dtype), op=instr.name)
            kind = "attention" if "attention" in scope and "scores" in scope else "matmul"
            out.append(PredictedOp(instr.name, kind, r.time_s, flops, nbytes, 0.0, times, (), scope))
            continue
        kind = (
            "attention"
            if "attention" in scope
            else (
                "elementwise"
                if instr.opcode
                in (
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
                )
                else "other"
            )
        )
        out.append(PredictedOp(instr.name, kind, nbytes / chip.hbm_bandwidth, 0.0, nbytes, 0.0, times, (), scope))
    return out


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
        }


def join(predicted: list[PredictedOp], measured: dict[str, float]) -> tuple[list[LedgerRow], float]:
    """Rows by HLO name (predicted per execution times its count), and the coverage of measured time."""
    rows = []
    seen = set()
    for p in predicted:
        m = measured.get(p.name)
        seen.add(p.name)
        rows.append(
            LedgerRow(
                p.name,
                p.kind,
                p.predicted_s * p.times,
                m,
                p.flops * p.times,
                p.bytes * p.times,
                p.collective_bytes * p.times,
                p.scope,
            )
        )
    for name, m in measured.items():
        if name not in seen:
            rows.append(LedgerRow(name, "other", None, m, 0.0, 0.0, 0.0))
    total = sum(m for m in measured.values() if m)
    covered = sum(r.measured_s for r in rows if r.measured_s and r.predicted_s is not None)
    coverage = covered / total if total else 0.0
    return rows, coverage
