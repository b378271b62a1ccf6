"""The compiled-program audit: did XLA emit the communication and the FLOPs the estimate of the Plan says?

For any Plan (a kernel, the MLP block, the Transformer's train step or decode), :func:`audit_plan` builds the
program (``kernels.registry.build``), lowers it with abstract arguments (nothing allocated), compiles it, parses
the optimized HLO (:mod:`lab.compile.hlo`) and compares it with
:func:`lab.predict.program.estimate.estimate_program` of the same Plan, the estimate users plan with:

* **Collectives**, grouped by kind and mesh axes, bytes summed in the collective model's convention (V:
  AllGather output, ReduceScatter and AllReduce operand, AllToAll operand x group, permute operand), times the
  trip count of enclosing loops. An entry matches when the bytes agree exactly. Known backend differences are
  named, not hidden: when XLA moved a collective to another element type (XLA:CPU runs bf16 collectives in f32)
  the entry compares element counts and says so; a predicted AllReduce that XLA split into ReduceScatter +
  AllGather over the same axes matches too, and so does a ReduceScatter that XLA:CPU lowered as an AllReduce
  plus a local slice, each with a note.
* **Unexpected collectives** (a reshard nobody predicted) are listed by HLO name with their source line.
* **FLOPs**: every dot in the program (fusions and loops included) against the estimate's per-device matmul and
  attention FLOPs; they must agree within 1%. ``cost_analysis()`` and ``memory_analysis()`` ride along, and for
  the Transformer XLA's memory per device is put beside the estimator's.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from lab.compile.hlo import collectives, parse_module
from lab.compile.hlo_dots import dots
from lab.compile.match import FLOP_TOLERANCE, AuditEntry, Key, compare, group_compiled, listed, total_bytes
from lab.compile.target import Target, compile_for, for_target, target_mesh
from lab.compile.view import CompiledView
from lab.core.hardware import Chip
from lab.core.plan import Plan, kernel_plan
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_seconds
from lab.predict.program.estimate import ProgramEstimate, estimate_program


@dataclass(frozen=True)
class AuditResult(CompiledView):
    sizes: dict[str, int]
    dtype: str
    entries: tuple[AuditEntry, ...]
    unexpected: tuple[dict[str, Any], ...]
    flops_predicted: float
    flops_compiled: float
    cost_analysis: dict[str, float] = field(default_factory=dict)
    memory_analysis: dict[str, float] = field(default_factory=dict)
    hlo_text: str = ""
    explained: tuple[dict[str, Any], ...] = ()  # collectives no estimate lists, with the compiler's reason
    hardware: str | None = None
    memory: dict[str, float] = field(default_factory=dict)
    source: str = ""
    layout: dict[str, Any] = field(default_factory=dict)  # the Transformer's rules, batch, seq and remat
    step_time_estimated_s: float | None = None  # the estimator's step, beside XLA's optimal_seconds

    @property
    def flops_match(self) -> bool:
        if self.flops_predicted == 0:
            return self.flops_compiled == 0
        return abs(self.flops_compiled / self.flops_predicted - 1) <= FLOP_TOLERANCE

    @property
    def all_match(self) -> bool:
        return all(e.match for e in self.entries) and not self.unexpected and self.flops_match

    def to_dict(self) -> dict[str, Any]:
        return (
            self.view_dict()
            | {
                "sizes": self.sizes,
                "dtype": self.dtype,
                "hardware": self.hardware,
                "source": self.source,
                "entries": [e.to_dict() for e in self.entries],
                "unexpected": list(self.unexpected),
                "explained": list(self.explained),
                "flops_predicted": self.flops_predicted,
                "flops_compiled": self.flops_compiled,
                "flops_match": self.flops_match,
                "all_match": self.all_match,
                "cost_analysis": self.cost_analysis,
                "memory_analysis": self.memory_analysis,
                "memory": self.memory,
            }
            | self.layout
            | self._xla()
        )

    def _xla(self) -> dict[str, Any]:
        """For a cross-compiled TPU program: what XLA says beside what the lab predicts (``xla`` in reports)."""
        if self.compiled_for is None:
            return {}
        cost = self.cost_analysis
        return {
            "compiled_for": self.compiled_for,
            "xla": {
                "memory": self.memory_analysis,
                "cost": cost,
                "lab": {
                    "flops_per_device": self.flops_predicted,
                    "step_time_s": self.step_time_estimated_s,
                    "memory_per_device_bytes": self.memory.get("estimator_bytes"),
                },
                "optimal_over_estimated": (
                    cost["optimal_seconds"] / self.step_time_estimated_s
                    if cost.get("optimal_seconds") and self.step_time_estimated_s
                    else None
                ),
            },
        }

    def table(self) -> str:
        sizes = ",".join(f"{k}={v}" for k, v in self.sizes.items())
        head = f"audit {self.target} on mesh {self.mesh_text} ({self.where}), sizes {sizes}, {self.dtype}"
        if self.source:
            head += f"; expected: the {self.source}"
        on = f"time on {self.hardware}" if self.hardware else "time"
        rows = [_entry_row(e) for e in self.entries]
        headers = ["expected op", "kind", "axes", "expected", "compiled", "match", on, "note"]
        out = head + "\n" + (render(headers, rows) if rows else "no collectives expected")
        for u in self.unexpected:
            axes = ",".join(u["axes"]) if u["axes"] else "?"
            out += (
                f"\nUNEXPECTED {u['kind']} over {axes} ({fmt_bytes(u['bytes'])}): {u['name']} at "
                f"{u['source'] or u['op_name'] or '?'}"
            )
        for u in self.explained:
            over = ",".join(u["axes"])
            out += f"\nexplained: {u['kind']} over {over} ({fmt_bytes(u['bytes'])}), {u['name']}: {u['why']}"
        verdict = "match" if self.flops_match else "MISMATCH"
        out += (
            f"\nFLOPs per device: expected {self.flops_predicted:.6g}, compiled {self.flops_compiled:.6g} "
            f"({verdict}, tolerance {100 * FLOP_TOLERANCE:g}%)"
        )
        if self.memory:
            m = self.memory
            out += (
                f"\nmemory per device: compiled {fmt_bytes(m['compiled_bytes'])} (arguments, outputs and temporaries), "
                f"estimator {fmt_bytes(m['estimator_bytes'])}: ratio {m['ratio']:.2f}"
            )
            if "estimator_state_bytes" in m:
                out += (
                    "\n  state (weights, optimizer state): compiled arguments "
                    f"{fmt_bytes(m['compiled_argument_bytes'])}, estimator {fmt_bytes(m['estimator_state_bytes'])}; "
                    "working memory (gathered weights, gradients, activations): compiled temporaries "
                    f"{fmt_bytes(m['compiled_temp_bytes'])}, estimator {fmt_bytes(m['estimator_working_bytes'])}"
                )
        if self.compiled_for:
            out += "\n" + self._xla_lines()
        return out + f"\nresult: {'all match' if self.all_match else 'MISMATCH'}"

    def _xla_lines(self) -> str:
        mem, cost = self.memory_analysis, self.cost_analysis
        held = mem.get("argument_size_in_bytes", 0.0) + mem.get("temp_size_in_bytes", 0.0)
        compiler = "libtpu" if self.backend == "tpu" else self.backend.upper()
        line = (
            f"XLA ({compiler}) per device: arguments {fmt_bytes(mem.get('argument_size_in_bytes', 0.0))}, temporaries "
            f"{fmt_bytes(mem.get('temp_size_in_bytes', 0.0))}, output {fmt_bytes(mem.get('output_size_in_bytes', 0.0))}"
            f" (held {fmt_bytes(held)})"
        )
        if "flops" in cost:
            line += f"; cost: {cost['flops']:.6g} FLOPs, {fmt_bytes(cost.get('bytes accessed', 0.0))} accessed"
        if cost.get("optimal_seconds") and self.step_time_estimated_s:
            line += (
                f"\nXLA's time estimate {fmt_seconds(cost['optimal_seconds'])} against the estimator's "
                f"{fmt_seconds(self.step_time_estimated_s)} on {self.hardware}"
            )
        return line


def _entry_row(e: AuditEntry) -> list[str]:
    axes = "".join(e.axes) if all(len(a) == 1 for a in e.axes) else ",".join(e.axes)
    t = fmt_seconds(e.predicted_time_s) if e.predicted_time_s is not None else "-"
    return [
        e.op,
        e.kind,
        axes,
        fmt_bytes(e.predicted_bytes),
        fmt_bytes(e.compiled_bytes),
        "yes" if e.match else "NO",
        t,
        e.note,
    ]


# ----- comparison --------------------------------------------------------------------------


# ----- auditing a Plan ------------------------------------------------------------------------


def _analyses(compiled) -> tuple[dict[str, float], dict[str, float]]:
    """XLA's own account of the program: ``cost_analysis()`` (FLOPs, bytes, transcendentals, and on TPU its time
    estimate ``optimal_seconds``) and ``memory_analysis()`` per device, as plain floats."""
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):  # a backend without the analysis
        cost = {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    keep = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
    cost = {k: float(v) for k, v in (cost or {}).items() if k in keep}
    if cost.get("optimal_seconds", 0.0) <= 0:  # libtpu gives a negative sentinel where it has no estimate
        cost.pop("optimal_seconds", None)
    try:
        mem = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        mem = None
    names = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return cost, {n: float(getattr(mem, n)) for n in names if hasattr(mem, n)}


def _memory(est: ProgramEstimate, mem: dict[str, float]) -> dict[str, float]:
    """XLA's memory per device beside the estimator's: arguments, outputs and temporaries, less what outputs
    alias (a donated argument is held once)."""
    if not est.memory:
        return {}
    compiled = (
        mem.get("argument_size_in_bytes", 0.0)
        + mem.get("output_size_in_bytes", 0.0)
        + mem.get("temp_size_in_bytes", 0.0)
        - mem.get("alias_size_in_bytes", 0.0)
    )
    total = est.memory["total"]
    out = {
        "compiled_bytes": compiled,
        "estimator_bytes": total,
        "ratio": compiled / total if total else float("nan"),
        "compiled_temp_bytes": mem.get("temp_size_in_bytes", 0.0),
        "estimator_activation_bytes": est.memory.get("activations", est.memory.get("kv", 0.0)),
    }
    if "optimizer" in est.memory:  # a train step: the state it keeps is its arguments (weights, optimizer state)
        e = est.memory
        out["compiled_argument_bytes"] = mem.get("argument_size_in_bytes", 0.0)
        out["estimator_state_bytes"] = e["params"] - e.get("params_gathered", 0.0) + e["optimizer"]
        out["estimator_working_bytes"] = total - out["estimator_state_bytes"]
    return out


def audit_compiled(plan: Plan, compiled, est: ProgramEstimate, backend: str) -> AuditResult:
    """Audit an already-compiled program (``fn.lower(...).compile()``) against the estimate of its Plan."""
    text = compiled.as_text()
    module = parse_module(text)
    mesh = plan.shape
    expected = est.collectives()
    found = collectives(module)
    entries, unexpected = compare(expected, [c for c in found if not c.explained], mesh)
    explained = [listed(c, mesh) | {"why": c.explained} for c in found if c.explained]
    times: dict[Key, float] = defaultdict(float)
    order = {a: i for i, a in enumerate(mesh)}
    for o in est.ops:
        if o.is_collective and o.axes:
            times[(o.kind, tuple(sorted(o.axes, key=order.get)))] += o.time_s
    entries = [dataclasses.replace(e, predicted_time_s=times.get((e.kind, e.axes))) for e in entries]
    cost, mem = _analyses(compiled)
    return AuditResult(
        target=plan.name or plan.program,
        mesh=dict(mesh),
        sizes=dict(plan.sizes),
        dtype=plan.dtype,
        backend=backend,
        entries=tuple(entries),
        unexpected=tuple(unexpected),
        explained=tuple(explained),
        flops_predicted=est.flops,
        flops_compiled=sum(d.flops * d.times for d in dots(module)),
        cost_analysis=cost,
        memory_analysis=mem,
        hlo_text=text,
        hardware=est.hardware,
        memory=_memory(est, mem),
        source=est.source,
        layout=_layout(plan),
    )


def _layout(plan: Plan) -> dict[str, Any]:
    """The keys the Transformer's audit has always reported: its rules (preset, else per dim) and sizes."""
    if not plan.is_transformer:
        return {}
    rules = plan.rules_preset or (plan.rules.to_dict() if plan.rules else None)
    return {"rules": rules, "remat": plan.remat} | {k: v for k, v in plan.sizes.items() if k in ("batch", "seq")}


def compile_plan(plan: Plan, target: Target | None = None):
    """Build the Plan's program and compile it from abstract arguments: ``(built, compiled)``. With a ``target``
    (a TPU topology, :mod:`lab.compile.target`) the mesh is the topology's devices and the compiler libtpu's."""
    from kernels.registry import build

    mesh = target_mesh(plan.shape, target) if target is not None else None
    built = build(plan, mesh)
    return built, compile_for(built, target)


def audit_plan(plan: Plan, chip: Chip, target: Target | None = None) -> AuditResult:
    """Compile the Plan's program (nothing allocated) and audit it against its estimate on ``chip``; for a TPU
    ``target`` when one is given (cross-compiled: nothing runs)."""
    import jax

    est = estimate_program(for_target(plan, target) if target is not None else plan, chip)
    _, compiled = compile_plan(plan, target)
    backend = target.backend if target is not None else jax.devices()[0].platform
    result = audit_compiled(plan, compiled, est, backend)
    if target is not None:
        result = dataclasses.replace(result, compiled_for=target.name, step_time_estimated_s=est.step_time_s)
    return result


def inventory(plan: Plan, target: Target | None = None) -> tuple[dict[str, Any], str]:
    """A program no estimator describes (a user model): what it compiled to, with nothing to hold it to. Every
    collective by kind and mesh axes with its bytes and instructions, the matmuls' FLOPs, XLA's analyses."""
    import jax

    _, compiled = compile_plan(plan, target)
    text = compiled.as_text()
    module = parse_module(text)
    groups = group_compiled(collectives(module), plan.shape)
    rows = [
        {"kind": kind, "axes": list(axes), "bytes": total_bytes(cs), "instructions": [c.name for c in cs]}
        for (kind, axes), cs in sorted(groups.items())
    ]
    cost, mem = _analyses(compiled)
    backend = target.backend if target is not None else jax.devices()[0].platform
    data = {
        "target": plan.name or plan.program,
        "mesh": dict(plan.shape),
        "sizes": dict(plan.sizes),
        "backend": backend,
        "emulated": backend == "cpu",
        "compiled_for": target.name if target is not None else None,
        "collectives": rows,
        "flops_compiled": sum(d.flops * d.times for d in dots(module)),
        "cost_analysis": cost,
        "memory_analysis": mem,
        "all_match": None,
        "note": "no estimator describes this program: its compiled collectives and FLOPs, with nothing to match",
    }
    where = f"{backend.upper()} {target.name}, cross-compiled" if target is not None else backend
    where += ", emulated" if backend == "cpu" else ""
    head = f"compiled {data['target']} on mesh {','.join(f'{k}={v}' for k, v in plan.shape.items())} ({where})"
    table = render(
        ["kind", "axes", "bytes", "instructions"],
        [[r["kind"], ",".join(r["axes"]) or "?", fmt_bytes(r["bytes"]), len(r["instructions"])] for r in rows],
    )
    held = sum(mem.get(k, 0.0) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"))
    tail = (
        f"FLOPs per device: {data['flops_compiled']:.6g} (compiled; no estimate of a user model to compare)\n"
        f"XLA memory per device: {fmt_bytes(held - mem.get('alias_size_in_bytes', 0.0))}"
    )
    return data, f"{head}\n{table if rows else 'no collectives'}\n{tail}"


def audit_kernel(
    name: str,
    mesh: dict[str, int],
    sizes: dict[str, int],
    dtype: str = "fp32",
    axes: tuple[str, ...] | None = None,
    chip: Chip | None = None,
) -> AuditResult:
    """Build, compile and audit a registry kernel on a mesh of this process's devices.

    ``chip`` (a catalog chip) prices each expected collective on that hardware (``predicted_time_s``); without
    it the entries carry no time.
    """
    from lab.core.hardware import get_chip

    plan = kernel_plan(name, mesh, sizes, dtype, axes)
    result = audit_plan(plan, chip or get_chip("cpu"))
    if chip is None:
        entries = tuple(dataclasses.replace(e, predicted_time_s=None) for e in result.entries)
        return dataclasses.replace(result, entries=entries, hardware=None)
    return result


__all__ = [
    "AuditEntry",
    "AuditResult",
    "audit_compiled",
    "audit_kernel",
    "audit_plan",
    "compare",
    "compile_plan",
    "inventory",
]
