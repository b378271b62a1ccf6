"""Reading what a buffer of the compiled program is for: its role in the Plan, the value that names it and the op
and source line that made it (:mod:`lab.compile.memory` lists them at the peak).

The optimized HLO gives each instruction's op name (JAX's scope, ``jit(step)/transpose(jvp())/.../mlp/up``) and
source line; the entry parameters carry their argument paths (``params['layers']['wq']``) as op names. The
temporary heap's values are grouped by place (one allocation, offset and size) and split where their live ranges
do not touch: a slot is one buffer over its span, whose values form a chain (a loop's initial value, its carried
copies, what the body writes into it, the loop's result).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lab.compile.hlo import Module, parse_shapes
from lab.compile.memory_dump import Allocation, LiveRanges, Value
from lab.core.collective_kinds import HLO_NAMES

COLLECTIVE_OPCODES = frozenset(f"{k}{s}" for k in (*HLO_NAMES, "ragged-all-to-all") for s in ("", "-start", "-done"))
_BOOKKEEPING = frozenset(
    ("constant", "parameter", "broadcast", "iota", "copy", "bitcast", "tuple", "get-tuple-element", "")
)


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


class Program:
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
        return relative(self.module.source(instr)) if instr else ""

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


def relative(source: str) -> str:
    """A source line without the checkout's or site-packages' leading folders."""
    for marker in ("/site-packages/", "/kernels/", "/lab/"):
        i = source.find(marker)
        if i >= 0:
            return source[i + len(marker) :] if marker == "/site-packages/" else source[i + 1 :]
    return source


def argument_role(path: str) -> str:
    head = re.split(r"[\[.]", path, maxsplit=1)[0]
    if head == "params":
        return "parameter"
    if head in ("opt_state", "optimizer"):
        return "optimizer state"
    if head in ("cache", "kv", "kv_cache", "pages"):
        return "kv cache"
    return "input"


def dims(shape: str) -> tuple[int, ...] | None:
    shapes = parse_shapes(shape)
    return shapes[0].dims if len(shapes) == 1 else None


def held(allocations: list[Allocation], program: Program) -> list[Buffer]:
    """The entry parameters and the outputs not written over one: held for the whole program."""
    out = []
    for a in allocations:
        if a.kind == "parameter":
            path = program.arguments.get(a.parameter, f"parameter {a.parameter}")
            out.append(Buffer(float(a.size), argument_role(path), path, path, "", a.shape))
        elif a.kind in ("output", "live-out") and a.color == 0:
            name = a.values[0].name if a.values else f"allocation {a.index}"
            scope = program.op_name(name)
            out.append(Buffer(float(a.size), "output", name, scope, program.source(name), a.values[0].shape))
    return out


@dataclass
class Slot:
    """Values of the temporary heap that share one place (aliases, or one value after another)."""

    values: list[tuple[Value, int, int]]

    @property
    def span(self) -> tuple[int, int]:
        return min(s for _, s, _ in self.values), max(e for _, _, e in self.values)


def heap_slots(allocations: list[Allocation], ranges: LiveRanges) -> list[Slot]:
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
                out.append(Slot(current))
                current = [item]
        out.append(Slot(current))
    return out


def role_at(slot: Slot, at: int, program: Program, params: set[tuple[int, ...]]) -> tuple[str, Value, Value]:
    """The role at position ``at`` of a temporary buffer live there, the value that names it, and the value whose
    op says what it holds.

    The values of one place form a chain (a loop's initial value, its carried copies, what the body writes, the
    loop's result); what the chain has held so far says what the buffer is for."""
    held = [(v, s) for v, s, _ in slot.values if s <= at]
    now = max(held, key=lambda x: x[1])[0]
    if program.opcode(now.name) in COLLECTIVE_OPCODES:
        return "collective", now, now
    named = [v for v, _ in held if program.op_name(v.name)]
    grads = [v for v, _, _ in slot.values if dims(v.shape) in params and "transpose(" in program.op_name(v.name)]
    if grads:  # a gradient's buffer from its zeros on: named by what it holds now, or the first gradient written
        return "gradient", now if program.op_name(now.name) else grads[0], grads[0]
    backward = program.backward_from
    if backward is not None and slot.span[0] < backward <= slot.span[1]:  # made in the forward, held for the backward
        saved = [v for v in named if "transpose(" not in program.op_name(v.name)]
        written = [v for v in saved if "dynamic_update_slice" in program.op_name(v.name)]
        return "activation", (saved or [now])[-1], (written or saved or [now])[-1]
    last = named[-1] if named else now
    return "temporary", last, last


def param_dims(held: list[Buffer]) -> set[tuple[int, ...]]:
    """Parameters' shapes per device, whole and one layer of a stacked one."""
    out: set[tuple[int, ...]] = set()
    for b in held:
        if b.role == "parameter" and (d := dims(b.shape)) is not None:
            out |= {d, d[1:]} if len(d) > 1 else {d}
    return out


__all__ = [
    "COLLECTIVE_OPCODES",
    "Buffer",
    "Program",
    "Slot",
    "argument_role",
    "dims",
    "heap_slots",
    "held",
    "param_dims",
    "relative",
    "role_at",
]
