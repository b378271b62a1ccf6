"""What fills memory at the compiled program's peak, in the Plan's names, beside the estimator's memory model.

The Plan's program is compiled as the audit compiles it (on the host, or for a TPU topology that is not here) with
XLA's dump on, so its buffer assignment and live ranges can be read back (:mod:`lab.compile.memory_dump`).
Memory over the schedule is the entry parameters and outputs (held for the whole program, each its own allocation)
plus the values of the temporary heap live at each position; the peak is where that heap is fullest. Each buffer
live there gets a role:

* **parameter**, **optimizer state**, **input**, **kv cache**: an entry parameter, named by its argument path
  (``params['layers']['wq']``, ``opt_state[0].mu[...]``, ``tokens``), which XLA keeps as the op name;
* **collective**: the output of an all-gather, all-reduce, reduce-scatter, all-to-all or permute;
* **gradient**: made in the backward pass (op name under ``transpose(...)``) with a parameter's shape, whole or
  one layer of it;
* **activation**: made in the forward pass and still live once the backward has begun (saved for it);
* **temporary**: anything else, named by the op scope that made it (``jit(step)/.../attention/qkv``);
* **output**: a result not written over a donated argument.

The roles are read from names and shapes, so they are heuristics; the bytes are XLA's. Only the default memory
space is counted (a TPU's VMEM and SMEM scratch sit beside HBM, not in it).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab.compile.hlo import Module, parse_module, parse_shapes
from lab.compile.memory_dump import Allocation, LiveRanges, Value, read_dump
from lab.compile.target import Target, for_target, target_mesh, uncached
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.core.table import render
from lab.core.units import fmt_bytes
from lab.predict.program.estimate import estimate_program

ROLES = (
    "parameter",
    "optimizer state",
    "gradient",
    "activation",
    "kv cache",
    "collective",
    "temporary",
    "input",
    "output",
)
COLLECTIVE_OPCODES = frozenset(
    f"{k}{s}"
    for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
    for s in ("", "-start", "-done")
)
_BOOKKEEPING = frozenset(
    ("constant", "parameter", "broadcast", "iota", "copy", "bitcast", "tuple", "get-tuple-element", "")
)
# the estimator's terms each role is held to (training: lab.predict.training.memory; serving: params and kv)
ESTIMATED = {
    "parameter": "params_state",
    "optimizer state": "optimizer",
    "gradient": "grads",
    "activation": "activations",
    "kv cache": "kv",
    "collective": "params_gathered",
}


@dataclass(frozen=True)
class Buffer:
    """A buffer live at the peak: its bytes, role, HLO value (or argument path), op scope and source line."""

    bytes: float
    role: str
    name: str
    scope: str = ""
    source: str = ""
    shape: str = ""
    live: tuple[int, int] | None = None  # schedule positions, first and last; None: held for the whole program

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "role": self.role,
            "name": self.name,
            "scope": self.scope,
            "source": self.source,
            "shape": self.shape,
            "live": list(self.live) if self.live else None,
        }


@dataclass(frozen=True)
class MemoryExplanation:
    target: str
    mesh: dict[str, int]
    backend: str
    compiled_for: str | None
    peak_bytes: float
    xla_peak_bytes: float
    peak_position: int
    schedule_length: int
    buffers: tuple[Buffer, ...]
    by_role: dict[str, dict[str, float | None]]
    memory_analysis: dict[str, float]
    estimator: str = ""
    timeline: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # role -> live bytes per position

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mesh": self.mesh,
            "backend": self.backend,
            "emulated": self.backend == "cpu",
            "compiled_for": self.compiled_for,
            "peak_bytes": self.peak_bytes,
            "xla_peak_bytes": self.xla_peak_bytes,
            "peak_position": self.peak_position,
            "schedule_length": self.schedule_length,
            "estimator": self.estimator,
            "by_role": self.by_role,
            "memory_analysis": self.memory_analysis,
            "buffers": [b.to_dict() for b in self.buffers],
        }

    def table(self, top: int = 15) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        where = f"{self.backend}, emulated" if self.backend == "cpu" else self.backend
        if self.compiled_for:
            where = f"TPU {self.compiled_for}, cross-compiled: nothing ran"
        head = (
            f"memory at the peak of {self.target} on mesh {mesh} ({where}): position {self.peak_position} of "
            f"{self.schedule_length} in XLA's schedule, per device"
        )
        rows = [
            [fmt_bytes(b.bytes), b.role, _short(b.name, 40), _short(b.scope or "-", 56), _short(b.source or "-", 40)]
            for b in self.buffers[:top]
        ]
        out = head + "\n" + render(["bytes", "role", "buffer", "op scope", "source"], rows)
        rest = self.buffers[top:]
        if rest:
            out += f"\n... and {len(rest)} smaller buffers, {fmt_bytes(sum(b.bytes for b in rest))} together"
        out += "\n\n" + self._roles()
        gap = self.peak_bytes / self.xla_peak_bytes - 1 if self.xla_peak_bytes else float("nan")
        why = (
            "the rest is free space between buffers in XLA's heap"
            if abs(gap) <= 0.02
            else "NOT EXPLAINED: XLA's total holds what this reading of its default memory space does not"
        )
        return out + (
            f"\npeak: {fmt_bytes(self.peak_bytes)} live ({len(self.buffers)} buffers); XLA's memory_analysis "
            f"{fmt_bytes(self.xla_peak_bytes)} (arguments + outputs + temporaries - aliased): {100 * gap:+.2f}% ({why})"
        )

    def _roles(self) -> str:
        rows = []
        for role, v in self.by_role.items():
            est = v.get("estimated")
            diff = "-" if est is None else fmt_bytes(v["xla"] - est)
            rows.append([role, fmt_bytes(v["xla"]), "-" if est is None else fmt_bytes(est), diff])
        note = f"estimated: the {self.estimator}" if self.estimator else "no estimator describes this program"
        if "collective" in self.by_role and self.by_role["collective"].get("estimated") is not None:
            note += "; its collective row is the weights FSDP holds gathered"
        return render(["role", "XLA at the peak", "estimated", "XLA - estimated"], rows) + f"\n({note})"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


# ----- compiling with the dump ---------------------------------------------------------------


def compile_dumped(plan: Plan, target: Target | None, folder: str):
    """``(built, compiled)``: the Plan's program compiled as the audit compiles it, with XLA's dump in ``folder``
    (the persistent cache off: an executable read back from it would dump nothing). A program XLA refuses (too
    large for the chip, an unsupported op) is a :class:`UserError` with XLA's first line."""
    import jax

    from kernels.registry import build

    mesh = target_mesh(plan.shape, target) if target is not None else None
    built = build(plan, mesh)
    options = {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}
    with uncached():
        try:
            return built, built.fn.lower(*built.abstract).compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            where = f"for {target.name}" if target is not None else "on this host"
            raise UserError(f"XLA could not compile {plan.name or plan.program} {where}: {first[:300]}") from None


def xla_peak(compiled) -> tuple[float, dict[str, float]]:
    """XLA's memory per device as the audit states it: arguments + outputs + temporaries - what outputs alias."""
    mem = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    got = {n: float(getattr(mem, n, 0.0) or 0.0) for n in names}
    held = got["argument_size_in_bytes"] + got["output_size_in_bytes"] + got["temp_size_in_bytes"]
    return held - got["alias_size_in_bytes"], got


# ----- reading the program -------------------------------------------------------------------


class _Program:
    """The optimized HLO's instructions by name, and the entry parameters' argument paths by number."""

    def __init__(self, module: Module, ranges: LiveRanges):
        self.module = module
        self.by_name = {i.name: i for instrs in module.computations.values() for i in instrs}
        self.arguments = {}
        for i in module.computations.get(module.entry, []):
            if i.opcode == "parameter" and i.operands_text.strip().isdigit():
                self.arguments[int(i.operands_text)] = self.op_name(i.name)
        self.backward_from = self._backward_from(ranges.sequence)

    def _backward_from(self, sequence: tuple[str, ...]) -> int | None:
        """Where the backward pass begins in the schedule: the position that leaves the fewest computing ops on the
        wrong side (forward ops are under ``jvp(...)``, backward ones under ``transpose(...)``; XLA schedules a few
        of each early or late). None for a program with no backward pass."""
        marks = []
        for t, n in enumerate(sequence):
            scope = self.op_name(n) if self._computes(n) else ""
            if "transpose(" in scope:
                marks.append((t, -1))
            elif "jvp(" in scope:
                marks.append((t, 1))
        if not any(m < 0 for _, m in marks):
            return None
        # wrong(p) = backward ops before p + forward ops from p on; each mark moves it by one as p passes it
        best, at, wrong = None, 0, sum(1 for _, m in marks if m > 0)
        for t, m in marks:
            if best is None or wrong < best:
                best, at = wrong, t
            wrong += -1 if m > 0 else 1
        return at

    def _computes(self, name: str) -> bool:
        """An instruction that computes (not a constant, a parameter, a copy or a view) and so places the pass."""
        return self.opcode(name) not in _BOOKKEEPING

    def op_name(self, name: str) -> str:
        instr = self.by_name.get(name.split("{", 1)[0])
        return self.module.op_name(instr).replace("\\'", "'") if instr else ""

    def source(self, name: str) -> str:
        instr = self.by_name.get(name.split("{", 1)[0])
        return _relative(self.module.source(instr)) if instr else ""

    def origin(self, name: str) -> tuple[str, str]:
        """``(op scope, source)`` of what a value holds: its own, or for a value a loop stacks (a dynamic update
        slice), the op whose result is written into it, found through copies and views."""
        scope = self.op_name(name)
        if "dynamic_update_slice" in scope or "dynamic-update-slice" in name:
            instr = self.by_name.get(name.split("{", 1)[0])
            for operand in re.findall(r"%([\w.\-]+)", instr.operands_text if instr else ""):
                found, maker = self._made(operand, depth=4)
                if found:
                    return found, self.source(maker)
        return scope, self.source(name)

    def _made(self, name: str, depth: int) -> tuple[str, str]:
        """``(op scope, instruction)`` that computed ``name``, through copies and views without a scope; empty for
        an index or a constant."""
        scope = self.op_name(name)
        if scope and "dynamic_update_index" not in scope and "dynamic_index" not in scope:
            return (scope, name) if self.opcode(name) not in ("constant", "parameter") else ("", name)
        instr = self.by_name.get(name)
        if depth and instr is not None and instr.opcode in ("copy", "bitcast", "convert", "get-tuple-element"):
            operands = re.findall(r"%([\w.\-]+)", instr.operands_text)
            return self._made(operands[0], depth - 1) if operands else ("", name)
        return "", name

    def opcode(self, name: str) -> str:
        instr = self.by_name.get(name.split("{", 1)[0])
        return instr.opcode if instr else ""


def _relative(source: str) -> str:
    """A source line without the checkout's or site-packages' leading folders."""
    for marker in ("/site-packages/", "/kernels/", "/lab/"):
        i = source.find(marker)
        if i >= 0:
            return source[i + len(marker) :] if marker == "/site-packages/" else source[i + 1 :]
    return source


def _argument_role(path: str) -> str:
    head = re.split(r"[\[.]", path, maxsplit=1)[0]
    if head == "params":
        return "parameter"
    if head in ("opt_state", "optimizer"):
        return "optimizer state"
    if head in ("cache", "kv", "kv_cache", "pages"):
        return "kv cache"
    return "input"


def _dims(shape: str) -> tuple[int, ...] | None:
    shapes = parse_shapes(shape)
    return shapes[0].dims if len(shapes) == 1 else None


def _held(allocations: list[Allocation], program: _Program) -> list[Buffer]:
    """The entry parameters and the outputs not written over one: held for the whole program."""
    out = []
    for a in allocations:
        if a.kind == "parameter":
            path = program.arguments.get(a.parameter, f"parameter {a.parameter}")
            out.append(Buffer(float(a.size), _argument_role(path), path, path, "", a.shape))
        elif a.kind in ("output", "live-out") and a.color == 0:
            name = a.values[0].name if a.values else f"allocation {a.index}"
            scope = program.op_name(name)
            out.append(Buffer(float(a.size), "output", name, scope, program.source(name), a.values[0].shape))
    return out


@dataclass
class _Slot:
    """Values of the temporary heap that share one place (aliases, or one value after another)."""

    values: list[tuple[Value, int, int]]

    @property
    def span(self) -> tuple[int, int]:
        return min(s for _, s, _ in self.values), max(e for _, _, e in self.values)


def _slots(allocations: list[Allocation], ranges: LiveRanges) -> list[_Slot]:
    """Temporary values of the default memory space grouped by place, then split where their spans do not touch."""
    by_place: dict[tuple[int, int, int], list[tuple[Value, int, int]]] = {}
    for a in allocations:
        if a.kind != "temp" or a.color != 0:
            continue
        for v in a.values:
            span = ranges.spans.get(v.key)
            if span is not None:
                by_place.setdefault((a.index, v.offset, v.size), []).append((v, *span))
    out = []
    for vals in by_place.values():
        vals.sort(key=lambda x: (x[1], x[2]))
        current = [vals[0]]
        for item in vals[1:]:
            if item[1] <= max(e for _, _, e in current):
                current.append(item)
            else:
                out.append(_Slot(current))
                current = [item]
        out.append(_Slot(current))
    return out


def _role(slot: _Slot, at: int, program: _Program, params: set[tuple[int, ...]]) -> tuple[str, Value, Value]:
    """The role at position ``at`` of a temporary buffer live there, the value that names it, and the value whose
    op says what it holds.

    The values of one place form a chain (a loop's initial value, its carried copies, what the body writes, the
    loop's result); what the chain has held so far says what the buffer is for."""
    held = [(v, s) for v, s, _ in slot.values if s <= at]
    now = max(held, key=lambda x: x[1])[0]
    if program.opcode(now.name) in COLLECTIVE_OPCODES:
        return "collective", now, now
    named = [v for v, _ in held if program.op_name(v.name)]
    grads = [v for v, _, _ in slot.values if _dims(v.shape) in params and "transpose(" in program.op_name(v.name)]
    if grads:  # a gradient's buffer from its zeros on: named by what it holds now, or the first gradient written
        return "gradient", now if program.op_name(now.name) else grads[0], grads[0]
    backward = program.backward_from
    if backward is not None and slot.span[0] < backward <= slot.span[1]:  # made in the forward, held for the backward
        saved = [v for v in named if "transpose(" not in program.op_name(v.name)]
        written = [v for v in saved if "dynamic_update_slice" in program.op_name(v.name)]
        return "activation", (saved or [now])[-1], (written or saved or [now])[-1]
    last = named[-1] if named else now
    return "temporary", last, last


def _param_dims(held: list[Buffer]) -> set[tuple[int, ...]]:
    """Parameters' shapes per device, whole and one layer of a stacked one."""
    out: set[tuple[int, ...]] = set()
    for b in held:
        if b.role == "parameter" and (d := _dims(b.shape)) is not None:
            out |= {d, d[1:]} if len(d) > 1 else {d}
    return out


# ----- the explanation -----------------------------------------------------------------------


def explain_memory(plan: Plan, chip: Chip, target: Target | None = None) -> MemoryExplanation:
    """Compile the Plan's program and explain the memory at its peak, role by role, beside the estimator's."""
    import jax

    with tempfile.TemporaryDirectory(prefix="shardlab-xla-dump-") as folder:
        _, compiled = compile_dumped(plan, target, folder)
        allocations, ranges = read_dump(folder)
    program = _Program(parse_module(compiled.as_text()), ranges)
    xla_bytes, mem = xla_peak(compiled)
    held = _held(allocations, program)
    params = _param_dims(held)
    slots = _slots(allocations, ranges)
    length = max(ranges.length, 1)
    peak_at = int(np.argmax(_live(slots, held, length)))
    buffers = list(held)
    for slot in slots:
        start, end = slot.span
        if start <= peak_at <= end:
            role, named, made = _role(slot, peak_at, program, params)
            scope, source = program.origin(made.name)
            buffers.append(Buffer(float(named.size), role, named.name, scope, source, named.shape, slot.span))
    timeline = _timeline(slots, held, length, program, params)
    buffers.sort(key=lambda b: (-b.bytes, b.role, b.name))
    est = _estimate(plan, chip, target)
    return MemoryExplanation(
        target=plan.name or plan.program,
        mesh=dict(plan.shape),
        backend="tpu" if target is not None else jax.devices()[0].platform,
        compiled_for=target.name if target is not None else None,
        peak_bytes=float(sum(b.bytes for b in buffers)),
        xla_peak_bytes=xla_bytes,
        peak_position=peak_at,
        schedule_length=ranges.length,
        buffers=tuple(buffers),
        by_role=by_role(buffers, est.memory if est else {}),
        memory_analysis=mem,
        estimator=est.source if est else "",
        timeline=timeline,
    )


def _live(slots: list[_Slot], held: list[Buffer], length: int) -> np.ndarray:
    """Bytes live at each schedule position: the held buffers, and each temporary place over its span."""
    diff = np.zeros(length + 1)
    diff[0] += sum(b.bytes for b in held)
    for slot in slots:
        start, end = slot.span
        diff[min(start, length - 1)] += slot.values[0][0].size
        diff[min(end, length - 1) + 1] -= slot.values[0][0].size
    return np.cumsum(diff)[:length]


def _timeline(slots, held: list[Buffer], length: int, program: _Program, params) -> dict[str, np.ndarray]:
    """:func:`_live` by role: a place's role is read again where each of its values begins (a loop's carried
    buffer is a temporary in the forward pass and an activation saved for the backward once that begins)."""
    diff = {r: np.zeros(length + 1) for r in ROLES}
    for b in held:
        diff[b.role][0] += b.bytes
        diff[b.role][length] -= b.bytes
    cut = program.backward_from
    for slot in slots:
        start, end = slot.span
        starts = sorted({s for _, s, _ in slot.values} | ({cut} if cut is not None and start < cut <= end else set()))
        size = slot.values[0][0].size
        for a, b in zip(starts, [*starts[1:], end + 1], strict=True):
            role = _role(slot, a, program, params)[0]
            diff[role][min(a, length - 1)] += size
            diff[role][min(b, length)] -= size
    return {r: np.cumsum(d)[:length] for r, d in diff.items() if d.any()}


def _estimate(plan: Plan, chip: Chip, target: Target | None):
    """The estimate of the Plan (as the TPU compiler builds it, for a target), or None where none describes it."""
    if plan.spec.family == "user":
        return None
    est = estimate_program(for_target(plan) if target is not None else plan, chip)
    return est if est.memory else None


def by_role(buffers: list[Buffer], estimated: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """XLA's bytes at the peak per role beside the estimator's term for it (None where it has none)."""
    xla = {r: 0.0 for r in ROLES}
    for b in buffers:
        xla[b.role] += b.bytes
    terms = dict(estimated)
    if "params" in terms:  # the estimator's params include the gathered working copies; the state is the rest
        terms["params_state"] = terms["params"] - terms.get("params_gathered", 0.0)
    out: dict[str, dict[str, float | None]] = {}
    for role in ROLES:
        key = ESTIMATED.get(role)
        est = terms.get(key) if key else None
        if xla[role] or est:
            out[role] = {"xla": xla[role], "estimated": est if est is not None or not terms else 0.0}
    if terms:
        out["total"] = {"xla": sum(xla.values()), "estimated": terms.get("total")}
    return out


__all__ = ["ROLES", "Buffer", "MemoryExplanation", "by_role", "compile_dumped", "explain_memory", "xla_peak"]
