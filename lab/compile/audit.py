"""The compiled-program audit: did XLA emit the communication and the FLOPs the estimate of the Plan says?

For any Plan (a kernel, the MLP block, the Transformer's train step or decode), :func:`audit_plan` builds the
program (``kernels.registry.build``), lowers it with abstract arguments (nothing allocated), compiles it, parses
the optimized HLO (:mod:`lab.compile.hlo`) and compares it with :func:`lab.predict.program.estimate_program` of the
same Plan, the estimate users plan with:

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

from lab.compile.hlo import CompiledCollective, axes_of_groups, axes_of_pairs, collectives, dots, parse_module
from lab.compile.target import Target, compile_for, for_target, target_mesh
from lab.core.hardware import Chip
from lab.core.plan import Plan, kernel_plan
from lab.core.table import render
from lab.core.units import dtype_bytes, fmt_bytes, fmt_seconds
from lab.predict.program import ExpectedCollective, ProgramEstimate, estimate_program

FLOP_TOLERANCE = 0.01
HLO_TO_LAB = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "s8": "int8", "f8e4m3fn": "fp8", "f8e5m2": "fp8"}
Key = tuple[str, tuple[str, ...]]


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
    explained: tuple[dict[str, Any], ...] = ()  # collectives no estimate lists, with the compiler's reason
    hardware: str | None = None
    memory: dict[str, float] = field(default_factory=dict)
    source: str = ""
    layout: dict[str, Any] = field(default_factory=dict)  # the Transformer's rules, batch, seq and remat
    compiled_for: str | None = None  # a TPU topology compiled for ahead of time (nothing ran), e.g. "v5e:2x4"
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
            {
                "target": self.target,
                "mesh": self.mesh,
                "sizes": self.sizes,
                "dtype": self.dtype,
                "backend": self.backend,
                "emulated": self.backend == "cpu",
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
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        sizes = ",".join(f"{k}={v}" for k, v in self.sizes.items())
        where = f"{self.backend}, emulated" if self.backend == "cpu" else self.backend
        if self.compiled_for:
            where = f"TPU {self.compiled_for}, cross-compiled: nothing ran"
        head = f"audit {self.target} on mesh {mesh} ({where}), sizes {sizes}, {self.dtype}"
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
        line = (
            f"XLA (libtpu) per device: arguments {fmt_bytes(mem.get('argument_size_in_bytes', 0.0))}, temporaries "
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


def _live(axes: tuple[str, ...], mesh: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.get(a, 1) > 1)


def _axes_of(c: CompiledCollective, mesh: dict[str, int]) -> tuple[str, ...] | None:
    if c.kind == "permute":
        return axes_of_pairs(list(c.pairs), mesh)
    return axes_of_groups([list(g) for g in c.groups], mesh)


def _same(a: float, b: float) -> bool:
    """Byte counts agree: exactly, up to the rounding of predictions computed in floating point."""
    return abs(a - b) <= max(0.5, 1e-9 * max(abs(a), abs(b)))


def _total(cs: list[CompiledCollective]) -> float:
    return sum(c.bytes * c.times for c in cs)


def _group_compiled(compiled: list[CompiledCollective], mesh: dict[str, int]) -> dict[Key, list[CompiledCollective]]:
    groups: dict[Key, list[CompiledCollective]] = defaultdict(list)
    for c in compiled:
        axes = _axes_of(c, mesh)
        key = (c.kind, _live(axes, mesh) if axes is not None else ("?",))
        if key[1] != ():  # a collective over size-1 axes moves nothing
            groups[key].append(c)
    return groups


def _group_expected(predicted: list[ExpectedCollective], mesh: dict[str, int]) -> dict[Key, list[ExpectedCollective]]:
    order = {a: i for i, a in enumerate(mesh)}
    want: dict[Key, list[ExpectedCollective]] = defaultdict(list)
    for p in predicted:  # groups are sets of devices: the order axes are named in is not visible in HLO
        want[(p.kind, tuple(sorted(p.axes, key=order.get)))].append(p)
    return want


def _lowered(label: str, key: Key, nbytes: float, used: list, how: str) -> AuditEntry:
    """A match through another lowering that moves the same V (XLA's choice, not a layout error)."""
    return AuditEntry(label, key[0], key[1], nbytes, nbytes, True, tuple(c.name for c in used), how)


def _split_all_reduce(key: Key, label: str, nbytes: float, groups, used: set) -> AuditEntry | None:
    """XLA may split an AllReduce into ReduceScatter + AllGather over the same axes."""
    rs, ag = groups.get(("reduce-scatter", key[1]), []), groups.get(("all-gather", key[1]), [])
    if rs and ag and _same(_total(rs), nbytes) and _same(_total(ag), nbytes):
        used |= {("reduce-scatter", key[1]), ("all-gather", key[1])}
        return _lowered(label, key, nbytes, rs + ag, "XLA split it into ReduceScatter + AllGather")
    return None


def _reduce_scatter_as_all_reduce(key: Key, label: str, nbytes: float, groups, want, used: set) -> list[AuditEntry]:
    """XLA may lower a ReduceScatter, or some of the ReduceScatters over these axes, as an AllReduce plus a local
    slice (combined with any AllReduces expected over the same axes): XLA:CPU for small ones, the TPU compiler
    where it combines several gradients into one AllReduce. The V over the axes is the same."""
    ar, rs = groups.get(("all-reduce", key[1]), []), groups.get(key, [])
    also = sum(p.bytes for p in want.get(("all-reduce", key[1]), []))
    if not (ar and _same(_total(ar) + _total(rs), nbytes + also)):
        return []
    if rs:
        used.add(key)
    out = []
    if also:
        want.pop(("all-reduce", key[1]))
        out.append(
            _lowered(
                "AllReduces expected over these axes",
                ("all-reduce", key[1]),
                also,
                [],
                "combined with the ReduceScatter below",
            )
        )
    used.add(("all-reduce", key[1]))
    how = "lowered as AllReduce + local slice: same V, twice the traffic of a ReduceScatter"
    if rs:
        how = f"{fmt_bytes(_total(ar))} of it lowered as AllReduce + local slice (same V), the rest ReduceScatter"
    return [*out, _lowered(label, key, nbytes, rs + ar, how)]


def _direct(key: Key, preds: list[ExpectedCollective], got: list[CompiledCollective]) -> AuditEntry:
    """Same kind over the same axes: bytes must agree, or element counts where XLA changed the element type."""
    label = " + ".join(p.op for p in preds)
    want_bytes = sum(p.bytes for p in preds)
    comp_bytes = _total(got)
    match = bool(got) and _same(comp_bytes, want_bytes)
    note = "" if got else "not in the compiled program"
    if got and not match:
        want_elems = sum(p.bytes / dtype_bytes(p.dtype) for p in preds)
        elems = sum(c.elements * c.times for c in got)
        cdtypes = {c.dtype for c in got}
        if {HLO_TO_LAB.get(d, d) for d in cdtypes} != {p.dtype for p in preds} and _same(elems, want_elems):
            match = True
            note = (
                f"XLA ran it in {'/'.join(sorted(cdtypes))}, expected {'/'.join(sorted({p.dtype for p in preds}))}; "
                f"compared element counts ({elems:.0f})"
            )
    return AuditEntry(label, key[0], key[1], want_bytes, comp_bytes, match, tuple(c.name for c in got), note)


MOVABLE = ("all-gather", "reduce-scatter", "all-reduce")  # kinds XLA may lower as one another over the same axes


def _across_kinds(axes, entries: list[AuditEntry], expected, groups, used: set) -> list[AuditEntry]:
    """A last matching rule, over one set of axes: the TPU compiler lowers small AllGathers (of norm scales) and
    some ReduceScatters as AllReduces of a padded buffer, which moves the same V. Where the AllGathers,
    ReduceScatters and AllReduces over ``axes`` add up to what was expected of them together, byte for byte,
    each kind's entry matches and says what went as another kind."""
    want = {k: expected.get((k, axes), []) for k in MOVABLE}
    got = {k: groups.get((k, axes), []) for k in MOVABLE}
    total_want = sum(p.bytes for ps in want.values() for p in ps)
    if not _same(total_want, sum(_total(cs) for cs in got.values())):
        return entries
    rest = [e for e in entries if not (e.axes == axes and e.kind in MOVABLE)]
    moved = []
    for k in MOVABLE:
        if want[k] or got[k]:
            used.add((k, axes))
            delta = _total(got[k]) - sum(p.bytes for p in want[k])
            if not _same(delta, 0.0):
                moved.append(f"{fmt_bytes(abs(delta))} {'more' if delta > 0 else 'less'} {k}")
    note = "lowered across kinds: " + ", ".join(moved) + "; together the same V over these axes"
    for k in MOVABLE:
        if want[k] or got[k]:
            label = " + ".join(p.op for p in want[k]) or f"{k}s nobody expected"
            names = tuple(c.name for c in got[k])
            rest.append(AuditEntry(label, k, axes, sum(p.bytes for p in want[k]), _total(got[k]), True, names, note))
    return rest


def compare(
    predicted: list[ExpectedCollective], compiled: list[CompiledCollective], mesh: dict[str, int]
) -> tuple[list[AuditEntry], list[dict[str, Any]]]:
    """Match expected and compiled collectives per (kind, axes); list what nobody expected."""
    groups = _group_compiled(compiled, mesh)
    want = _group_expected(predicted, mesh)
    expected = dict(want)  # as predicted, before a lowering combines two kinds into one entry
    entries: list[AuditEntry] = []
    used: set[Key] = set()
    for key, preds in list(want.items()):
        if key not in want:  # absorbed by an earlier entry (an AllReduce combined with a ReduceScatter)
            continue
        label, nbytes = " + ".join(p.op for p in preds), sum(p.bytes for p in preds)
        if not groups.get(key) and key[0] == "all-reduce":
            e = _split_all_reduce(key, label, nbytes, groups, used)
            if e:
                entries.append(e)
                continue
        direct = groups.get(key) and _same(_total(groups[key]), nbytes)
        if not direct and key[0] == "reduce-scatter":
            lowered = _reduce_scatter_as_all_reduce(key, label, nbytes, groups, want, used)
            if lowered:
                entries += lowered
                continue
        if groups.get(key):
            used.add(key)
        entries.append(_direct(key, preds, groups.get(key, [])))
    for axes in {e.axes for e in entries if not e.match}:
        entries = _across_kinds(axes, entries, expected, groups, used)
    unexpected = [_listed(c, mesh) for key, cs in groups.items() if key not in used for c in cs]
    return entries, unexpected


def _listed(c: CompiledCollective, mesh: dict[str, int]) -> dict[str, Any]:
    """A compiled collective outside the expected entries, as the audit lists it."""
    axes = _axes_of(c, mesh)
    return {
        "name": c.name,
        "kind": c.kind,
        "axes": list(_live(axes, mesh)) if axes is not None else ["?"],
        "bytes": c.bytes * c.times,
        "dtype": c.dtype,
        "source": c.source,
        "op_name": c.op_name,
    }


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
    explained = [_listed(c, mesh) | {"why": c.explained} for c in found if c.explained]
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

    est = estimate_program(for_target(plan) if target is not None else plan, chip)
    _, compiled = compile_plan(plan, target)
    backend = "tpu" if target is not None else jax.devices()[0].platform
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
    groups = _group_compiled(collectives(module), plan.shape)
    rows = [
        {"kind": kind, "axes": list(axes), "bytes": _total(cs), "instructions": [c.name for c in cs]}
        for (kind, axes), cs in sorted(groups.items())
    ]
    cost, mem = _analyses(compiled)
    backend = "tpu" if target is not None else jax.devices()[0].platform
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
    where = (
        f"TPU {target.name}, cross-compiled" if target is not None else backend + (", emulated" * (backend == "cpu"))
    )
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
