"""What fills memory at the compiled program's peak, in the Plan's names, beside the estimator's memory model.

The Plan's program is compiled as the audit compiles it (on the host, or for a TPU topology that is not here) with
XLA's dump on, so its buffer assignment, live ranges and heap simulator trace can be read back
(:mod:`lab.compile.memory_dump`). Memory over the schedule is the entry parameters and outputs (held for the whole
program, each its own allocation) plus the values of the temporary heap live at each position; the peak is where
the most bytes are live. Each buffer live there gets a role (:mod:`lab.compile.memory_roles`):

* **parameter**, **optimizer state**, **input**, **kv cache**: an entry parameter, named by its argument path
  (``params['layers']['wq']``, ``opt_state[0].mu[...]``, ``tokens``), which XLA keeps as the op name;
* **collective**: the output of an all-gather, all-reduce, reduce-scatter, all-to-all or permute;
* **gradient**: made in the backward pass (op name under ``transpose(...)``) with a parameter's shape, whole or
  one layer of it;
* **activation**: made in the forward pass and still live once the backward has begun (saved for it);
* **temporary**: anything else, named by the op scope that made it (``jit(step)/.../attention/qkv``);
* **output**: a result not written over a donated argument.

Two rows hold no buffer but complete what ``memory_analysis()`` counts (:mod:`lab.compile.memory_heap`):

* **heap free**: the bytes of the temporary heap (its size, on a TPU rounded up to the program's HBM alignment)
  that no buffer live at the peak holds: space between buffers and, on a TPU, the 16 KiB slots small values sit in;
* **fragmentation stat** (TPU only): the heap's size less XLA's no-fragmentation peak, which libtpu adds to
  ``temp_size_in_bytes`` on top of the heap.

The roles are read from names and shapes, so they are heuristics; the bytes are XLA's. Only the default memory
space is counted (a TPU's VMEM and SMEM scratch sit beside HBM, not in it).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab.compile.hlo import Module, parse_module
from lab.compile.memory_dump import Allocation, LiveRanges, read_dump, read_flag, read_heap_traces
from lab.compile.memory_heap import Heap, read_heap
from lab.compile.memory_roles import Buffer, Program, Slot, heap_slots, held, param_dims, role_at
from lab.compile.target import Target, for_target, target_mesh, uncached
from lab.compile.view import CompiledView
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
    "heap free",
    "fragmentation stat",
)
HEAP_ROLES = ("heap free", "fragmentation stat")  # rows that hold no buffer: never in the timeline

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
class MemoryExplanation(CompiledView):
    peak_bytes: float  # every row: the buffers live at the peak and the heap rows
    xla_peak_bytes: float
    peak_position: int
    schedule_length: int
    buffers: tuple[Buffer, ...]
    by_role: dict[str, dict[str, float | None]]
    memory_analysis: dict[str, float]
    estimator: str = ""
    timeline: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # role -> live bytes per position
    live_bytes: float = 0.0  # the buffers live at the peak alone
    heap: Heap = field(default_factory=Heap)
    beside: float = 0.0  # the temporary heaps of the other memory spaces (a TPU's VMEM, SMEM, sync flags)

    @property
    def held_bytes(self) -> float:
        """What the device holds at the peak: the buffers live there and the heap's free space between them (its
        reservation), not the fragmentation figure libtpu counts a second time in ``memory_analysis()``. libtpu's
        own HBM check agrees: llama3_8b_train_2layer at batch 24 compiles for v5e:2x4 (15.75 GiB of HBM) although
        memory_analysis' total is 18.26 GB (its peak_memory_in_bytes: 14.75 GB); batch 28 is refused."""
        return self.live_bytes + (self.by_role.get("heap free", {}).get("xla") or 0.0)

    @property
    def estimated_bytes(self) -> float | None:
        return self.by_role.get("total", {}).get("estimated")

    def to_dict(self) -> dict[str, Any]:
        est = self.estimated_bytes
        return self.view_dict() | {
            "peak_bytes": self.peak_bytes,
            "live_bytes": self.live_bytes,
            "xla_peak_bytes": self.xla_peak_bytes,
            "peak_position": self.peak_position,
            "schedule_length": self.schedule_length,
            "estimator": self.estimator,
            "held_bytes": self.held_bytes,
            "estimated_bytes": est,
            "held_over_estimated": self.held_bytes / est if est else None,
            "by_role": self.by_role,
            "memory_analysis": self.memory_analysis,
            "heap": self.heap.to_dict(),
            "other_memory_spaces": self.beside,
            "buffers": [b.to_dict() for b in self.buffers],
        }

    def table(self, top: int = 15) -> str:
        head = (
            f"memory at the peak of {self.target} on mesh {self.mesh_text} ({self.where}): position "
            f"{self.peak_position} of {self.schedule_length} in XLA's schedule, per device"
        )
        live = [b for b in self.buffers if b.role not in HEAP_ROLES]
        shown = live[:top] + [b for b in self.buffers if b.role in HEAP_ROLES]
        rows = [
            [fmt_bytes(b.bytes), b.role, shorten(b.name, 40), shorten(b.scope or "-", 56), shorten(b.source or "-", 40)]
            for b in shown
        ]
        out = head + "\n" + render(["bytes", "role", "buffer", "op scope", "source"], rows)
        rest = live[top:]
        if rest:
            out += f"\n... and {len(rest)} smaller buffers, {fmt_bytes(sum(b.bytes for b in rest))} together"
        return out + "\n\n" + self._roles() + "\n" + self._footer(len(live)) + self._against_estimate()

    def _against_estimate(self) -> str:
        """The estimator's total against what the device holds at the peak (and against memory_analysis' total)."""
        est = self.estimated_bytes
        if not est:
            return ""
        ratio = self.held_bytes / est
        verdict = "within 10%" if abs(ratio - 1) <= 0.10 else "NOT within 10%"
        out = f"\nthe device holds {ratio:.2f}x the estimator's {fmt_bytes(est)} at the peak ({verdict})"
        if self.heap.fragmentation:
            again = self.xla_peak_bytes / est
            out += f"; memory_analysis' total, with the fragmentation counted again, is {again:.2f}x"
        return out

    def _footer(self, n_live: int) -> str:
        gap = self.peak_bytes / self.xla_peak_bytes - 1 if self.xla_peak_bytes else float("nan")
        added = [f"{fmt_bytes(b.bytes)} {b.role}" for b in self.buffers if b.role in HEAP_ROLES]
        verdict = "adds up" if abs(gap) <= 0.01 else "NOT EXPLAINED: XLA's total holds what this reading does not"
        out = (
            f"peak: {fmt_bytes(self.live_bytes)} live in {n_live} buffers"
            + (f", with {' and '.join(added)}: {fmt_bytes(self.peak_bytes)}" if added else "")
            + f"; XLA's memory_analysis {fmt_bytes(self.xla_peak_bytes)} (arguments + outputs + temporaries - "
            f"aliased): {100 * gap:+.2f}% ({verdict})"
        )
        if self.compiled_for and self.backend == "tpu":
            libtpu = self.memory_analysis.get("peak_memory_in_bytes")
            out += "\n(TPU: " + (f"libtpu's peak_memory_in_bytes {fmt_bytes(libtpu)}; " if libtpu else "")
            out += (
                "the heap's temporaries were not counted: it holds only tuple index tables and scalars; "
                if not self.heap.counted
                else ""
            )
            out += f"beside HBM and not in memory_analysis: {fmt_bytes(self.beside)} of VMEM, SMEM and sync flags)"
        return out

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


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


# ----- compiling with the dump ---------------------------------------------------------------


def compile_dumped(plan: Plan, target: Target | None, folder: str):
    """``(built, compiled)``: the Plan's program compiled as the audit compiles it, with XLA's dump in ``folder``
    (as text, and as protos for the heap simulator's trace; the persistent cache off: an executable read back from
    it would dump nothing). A program XLA refuses (too large for the chip, an unsupported op) is a
    :class:`UserError` with XLA's first line."""
    import jax

    from kernels.registry import build

    mesh = target_mesh(plan.shape, target) if target is not None else None
    built = build(plan, mesh)
    options = {"xla_dump_to": folder, "xla_dump_hlo_as_text": True, "xla_dump_hlo_as_proto": True}
    with uncached():
        try:
            return built, built.fn.lower(*built.abstract).compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            where = f"for {target.name}" if target is not None else "on this host"
            raise UserError(f"XLA could not compile {plan.name or plan.program} {where}: {first[:300]}") from None


def xla_peak(compiled) -> tuple[float, dict[str, float]]:
    """XLA's memory per device as the audit states it: arguments + outputs + temporaries - what outputs alias
    (and, beside it, the backend's own ``peak_memory_in_bytes`` where it gives one)."""
    mem = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    got = {n: float(getattr(mem, n, 0.0) or 0.0) for n in names}
    held = got["argument_size_in_bytes"] + got["output_size_in_bytes"] + got["temp_size_in_bytes"]
    if getattr(mem, "peak_memory_in_bytes", None):
        got["peak_memory_in_bytes"] = float(mem.peak_memory_in_bytes)
    return held - got["alias_size_in_bytes"], got


# ----- the explanation -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What the dump says about the peak: every row (the buffers live there, then the heap rows), where it is, the
    live bytes alone and the timeline of the live buffers by role."""

    buffers: tuple[Buffer, ...]
    peak_position: int
    live_bytes: float
    timeline: dict[str, np.ndarray]


def read_peak(allocations: list[Allocation], ranges: LiveRanges, module: Module, heap: Heap) -> Reading:
    """The buffers live at the peak (where the most bytes are live), each with its role, then the heap's free space
    there and the fragmentation figure ``memory_analysis()`` adds (:mod:`lab.compile.memory_heap`)."""
    program = Program(module, ranges)
    kept = held(allocations, program)
    params = param_dims(kept)
    slots = heap_slots(allocations, ranges) if heap.counted else []
    length = max(ranges.length, 1)
    peak_at = int(np.argmax(_live(slots, kept, length)))
    buffers = list(kept)
    in_heap = 0.0
    for slot in slots:
        start, end = slot.span
        if start <= peak_at <= end:
            role, named, made = role_at(slot, peak_at, program, params)
            scope, source = program.origin(made.name)
            buffers.append(Buffer(float(named.size), role, named.name, scope, source, named.shape, slot.span))
            in_heap += named.size
    buffers.sort(key=lambda b: (-b.bytes, b.role, b.name))
    live = float(sum(b.bytes for b in buffers))
    rows = _heap_rows(heap, in_heap, len(buffers) - len(kept))
    timeline = _timeline(slots, kept, length, program, params)
    return Reading(tuple(buffers + rows), peak_at, live, timeline)


def _heap_rows(heap: Heap, in_heap: float, n: int) -> list[Buffer]:
    """The heap's free space at the peak, and on a TPU the fragmentation figure libtpu adds (none is a buffer)."""
    rows = []
    if heap.size:
        aligned = f" ({heap.alignment // 1024} KiB aligned)" if heap.alignment > 1 else ""
        scope = f"heap {fmt_bytes(heap.size)}{aligned} - {n} live buffers"
        rows.append(Buffer(heap.size - in_heap, "heap free", "free in the heap at the peak", scope))
    if heap.fragmentation is not None:
        scope = f"heap {fmt_bytes(heap.size)} - XLA's no-fragmentation peak {fmt_bytes(heap.no_fragmentation_peak)}"
        rows.append(Buffer(heap.fragmentation, "fragmentation stat", "libtpu counts it again in temp", scope))
    return rows


def explain_memory(plan: Plan, chip: Chip, target: Target | None = None) -> MemoryExplanation:
    """Compile the Plan's program and explain the memory at its peak, role by role, beside the estimator's."""
    import jax

    with tempfile.TemporaryDirectory(prefix="shardlab-xla-dump-") as folder:
        _, compiled = compile_dumped(plan, target, folder)
        allocations, ranges = read_dump(folder)
        traces = read_heap_traces(folder)
        alignment = int(read_flag(folder, "xla_jf_program_hbm_alignment_in_kib") or 0) * 1024
    heap = read_heap(allocations, traces, alignment, tpu=target is not None and target.backend == "tpu")
    reading = read_peak(allocations, ranges, parse_module(compiled.as_text()), heap)
    xla_bytes, mem = xla_peak(compiled)
    est = estimated_memory(plan, chip, target)
    beside = sum(a.size for a in allocations if a.kind == "temp" and a.color != 0)
    return MemoryExplanation(
        target=plan.name or plan.program,
        mesh=dict(plan.shape),
        backend=target.backend if target is not None else jax.devices()[0].platform,
        compiled_for=target.name if target is not None else None,
        peak_bytes=float(sum(b.bytes for b in reading.buffers)),
        xla_peak_bytes=xla_bytes,
        peak_position=reading.peak_position,
        schedule_length=ranges.length,
        buffers=reading.buffers,
        by_role=by_role(list(reading.buffers), est.memory if est else {}),
        memory_analysis=mem,
        estimator=est.source if est else "",
        timeline=reading.timeline,
        live_bytes=reading.live_bytes,
        heap=heap,
        beside=float(beside),
    )


def _live(slots: list[Slot], held: list[Buffer], length: int) -> np.ndarray:
    """Bytes live at each schedule position: the held buffers, and each temporary place over its span."""
    diff = np.zeros(length + 1)
    diff[0] += sum(b.bytes for b in held)
    for slot in slots:
        start, end = slot.span
        diff[min(start, length - 1)] += slot.values[0][0].size
        diff[min(end, length - 1) + 1] -= slot.values[0][0].size
    return np.cumsum(diff)[:length]


def _timeline(slots, held: list[Buffer], length: int, program: Program, params) -> dict[str, np.ndarray]:
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
            role = role_at(slot, a, program, params)[0]
            diff[role][min(a, length - 1)] += size
            diff[role][min(b, length)] -= size
    return {r: np.cumsum(d)[:length] for r, d in diff.items() if d.any()}


def estimated_memory(plan: Plan, chip: Chip, target: Target | None):
    """The estimate of the Plan (as the TPU compiler builds it, for a target), or None where none describes it."""
    if plan.spec.family == "user":
        return None
    est = estimate_program(for_target(plan, target) if target is not None else plan, chip)
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


__all__ = [
    "HEAP_ROLES",
    "ROLES",
    "Buffer",
    "MemoryExplanation",
    "Reading",
    "by_role",
    "compile_dumped",
    "estimated_memory",
    "explain_memory",
    "read_peak",
    "shorten",
    "xla_peak",
]
