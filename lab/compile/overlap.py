"""What hides each collective and what leaves it exposed: the compiled schedule and a measured trace, beside the
estimator's overlap assumptions (``shardlab explain overlap``).

* **The schedule** (:func:`schedule_overlap`): a scheduled module lists each computation's instructions in the order
  the latency-hiding scheduler chose. An asynchronous collective is a start and a done (``all-gather-start``/``-done``,
  ``async-start``/``-done``, libtpu's ``async-collective-start``/``-done`` fusions with continuation fusions between);
  the compute ops (fusions, dots, convolutions, custom calls) scheduled between them are what it overlaps, and its
  predicted exposed time is its predicted time less theirs, at least 0. A synchronous one (a plain ``all-reduce``:
  all XLA:CPU emits) overlaps nothing and is exposed in full.
* **The estimator's view** (:func:`estimator_view`): compiled collectives joined to the estimate's ops as the audit
  joins them (:func:`lab.compile.match.compare`); an op with a ``hidden`` is ``assumed_hidden``.
* **A measured trace** (:func:`trace_overlap`): per device, the part of a collective's span (start to done) that no
  other op covers is exposed; idle gaps are the time inside a step with nothing running.

Flagged: a collective the estimator assumed hidden that the schedule or the trace shows exposed by more than
:data:`FLAG_SHARE` of its own time. Seconds per run of the program (one step) on one device. The compute ops' prices
(the ledger's roofline), trace events and the pipeline bubble (:mod:`lab.measure`) come from the caller.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lab.compile.hlo import Instruction, Module, collectives, parse_module
from lab.compile.match import compare, listed
from lab.compile.target import Target, for_target
from lab.compile.view import CompiledView
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.core.table import render
from lab.core.units import fmt_seconds
from lab.predict.program.estimate import estimate_program

FLAG_SHARE = 0.05  # flagged: exposed by more than this share of the collective's own (predicted or measured) time
COMPUTE = frozenset(("fusion", "dot", "convolution", "custom-call"))
_KINDS = "all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all|ragged-all-to-all|async"
_START, _DONE = re.compile(rf"^(?:{_KINDS})-start$"), re.compile(rf"^(?:{_KINDS})-done$")
_PASSES = ("get-tuple-element", "bitcast", "async-update")  # carry an async collective from its start to its done
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class Assumed:
    """The estimator's view of one compiled collective: the estimate's ops it joins (their names joined by `` + ``),
    its share of their time per run, and what the estimate hides it behind (None: exposed)."""

    label: str
    time_s: float | None
    hidden: str | None


@dataclass(frozen=True)
class Collective:
    """One compiled collective in its computation's schedule; seconds per run of the program, on one device."""

    name: str
    kind: str
    axes: tuple[str, ...]
    computation: str
    times: float  # runs of its computation per run of the program (loop trips)
    start: int  # schedule positions in the computation (equal for a synchronous collective)
    done: int
    start_op: str
    done_op: str
    overlapped_ops: tuple[str, ...]
    bytes: float
    time_s: float | None  # predicted, the estimator's (None where no estimated op joins it)
    overlap_s: float  # predicted time of the compute between its start and its done
    exposed_s: float | None
    assumed: Assumed | None = None
    measured_s: float | None = None
    measured_exposed_s: float | None = None

    @property
    def asynchronous(self) -> bool:
        return self.start_op != self.done_op

    @property
    def assumed_hidden(self) -> bool | None:
        return None if self.assumed is None else self.assumed.hidden is not None

    @property
    def flagged(self) -> bool:
        return bool(self.assumed_hidden) and (
            shows_exposed(self.exposed_s, self.time_s) or shows_exposed(self.measured_exposed_s, self.measured_s)
        )

    def to_dict(self) -> dict[str, Any]:
        keep = ("name", "kind", "computation", "times", "start", "done", "start_op", "done_op", "bytes", "time_s")
        keep += ("overlap_s", "exposed_s", "assumed_hidden", "measured_s", "measured_exposed_s", "flagged")
        a = self.assumed
        out = {k: getattr(self, k) for k in keep} | {"axes": list(self.axes), "asynchronous": self.asynchronous}
        hidden = {"hidden_under": a.hidden if a else None, "estimate": a.label if a else None}
        return out | {"overlapped_ops": list(self.overlapped_ops)} | hidden


def shows_exposed(exposed_s: float | None, time_s: float | None) -> bool:
    """Whether ``exposed_s`` of a collective taking ``time_s`` is more than :data:`FLAG_SHARE` of it."""
    return exposed_s is not None and time_s is not None and exposed_s > max(FLAG_SHARE * time_s, 0.0)


def _scheduled(module: Module, comp: str = "", n: float = 1.0, out=None) -> dict[str, float]:
    """The computations that hold a schedule (the entry, loop bodies, branches, calls) in the order they first run,
    each with its runs per run of the program."""
    out = {} if out is None else out
    comp = comp or module.entry
    if comp not in out and len(out) < 10000:
        out[comp] = n
        for instr in module.computations.get(comp, []):
            if instr.opcode in ("while", "conditional", "call"):
                for callee, k in module.calls(instr):
                    _scheduled(module, callee, n * k, out)
    return out


def _is(i: Instruction, end: str) -> bool:
    """Whether ``i`` starts (``end`` "start") or is done with (``end`` "done") an asynchronous collective."""
    fused = i.opcode == "fusion" and i.name.startswith(f"async-collective-{end}")
    return fused or bool((_START if end == "start" else _DONE).match(i.opcode))


def _chains(instrs: Sequence[Instruction]) -> dict[str, tuple[int, int]]:
    """Each piece of an asynchronous collective in one schedule (its start, what carries it, libtpu's continuation
    fusions computing while it is in flight, its done) -> the positions of its start and of the first done reached
    from the start through its users."""
    out: dict[str, tuple[int, int]] = {}
    for a, start in enumerate(instrs):
        if not _is(start, "start"):
            continue
        reach, done = [start.name], a
        for b in range(a + 1, len(instrs)):
            ins = instrs[b]
            if set(_OPERAND.findall(ins.operands_text)).isdisjoint(reach):
                continue
            goes_on = ins.opcode == "fusion" and (ins.attr("calls") or "").lstrip("%").startswith("async_collective_")
            if _is(ins, "done") or ins.opcode in _PASSES or goes_on:
                reach.append(ins.name)
            if _is(ins, "done"):
                done = b
                break
        out.update(dict.fromkeys(reach, (a, done)))
    return out


def _sites(module: Module, scheduled: Mapping[str, float]) -> dict[str, Instruction]:
    """Every instruction -> the instruction of a schedule that runs it (itself, or the fusion or async op around
    it, through nested calls)."""
    callers = {callee: i for instrs in module.computations.values() for i in instrs for callee, _ in module.calls(i)}
    out = {}
    for instrs in module.computations.values():
        for i in instrs:
            site = i
            for _ in range(16):
                if site.computation in scheduled or site.computation not in callers:
                    break
                site = callers[site.computation]
            out[i.name] = site
    return out


def schedule_overlap(
    module_text: str, mesh: Mapping[str, int], prices: Mapping | None = None, assumed: Mapping | None = None
) -> list[Collective]:
    """Every collective of a compiled module: where it starts and is done in its computation's schedule, the compute
    ops between (``overlapped_ops``) and its predicted exposed time (its time less theirs, at least 0).

    ``prices``: predicted seconds of one execution of each compute instruction (missing: 0). ``assumed``: the
    estimator's view of each compiled collective by name (:func:`estimator_view`), which gives its time."""
    module = parse_module(module_text)
    scheduled = _scheduled(module)
    sites = _sites(module, scheduled)
    prices, assumed = prices or {}, assumed or {}
    found = list({c.name: (c, sites[c.name]) for c in collectives(module) if c.name in sites}.values())
    chains = {comp: _chains(module.computations[comp]) for comp in {s.computation for _, s in found}}
    comm = {s.name for _, s in found}  # every collective's start and done: communication, not compute
    comm |= {module.computations[k][i].name for k, ch in chains.items() for pair in ch.values() for i in pair}
    out = []
    for c, s in found:
        instrs = module.computations[s.computation]
        a, b = chains[s.computation].get(s.name) or (instrs.index(s),) * 2
        between = tuple(i.name for i in instrs[a + 1 : b] if i.opcode in COMPUTE and i.name not in comm)
        times = scheduled.get(s.computation, c.times)
        view = assumed.get(c.name)
        t = view.time_s if view else None
        overlap = sum(prices.get(n, 0.0) for n in between) * times
        axes = tuple(listed(c, dict(mesh))["axes"])
        where = (s.computation, times, a, b, instrs[a].name, instrs[b].name, between, c.bytes * c.times)
        exposed = None if t is None else max(0.0, t - overlap)
        out.append(Collective(c.name, c.kind, axes, *where, t, overlap, exposed, view))
    order = {comp: k for k, comp in enumerate(scheduled)}  # the computations in the order they first run
    return sorted(out, key=lambda c: (order.get(c.computation, len(order)), c.start, c.done))


def estimator_view(
    entries: Iterable[Mapping[str, Any]], ops: Mapping[str, tuple[float, str | None, float]], module_text: str
) -> dict[str, Assumed]:
    """The estimator's view of each compiled collective of ``module_text``, by instruction name.

    ``entries``: the audit's join (:meth:`lab.compile.match.AuditEntry.to_dict`: ``op``, the estimate's op names
    joined by `` + ``, and the ``instructions``, ``axes`` and ``note``); entries over the same axes that XLA lowered
    or combined across kinds are one pool. ``ops``: ``{name: (time_s, hidden, bytes)}`` of the estimate's
    collectives. A pool's time is split over its instructions by the bytes each moves; they are assumed hidden where
    the ops the estimate hides carry more than half the pool's bytes."""
    found = {c.name: c for c in collectives(parse_module(module_text))}
    pools: dict[Any, tuple[list[str], list[str]]] = {}
    for k, e in enumerate(entries):
        across = any(w in (e.get("note") or "") for w in ("lowered", "combined"))
        labels, names = pools.setdefault(tuple(e.get("axes") or ()) if across else k, ([], []))
        labels.append(e["op"])
        names += e["instructions"]
    out = {}
    for labels, names in pools.values():
        label = " + ".join(labels)
        mine, got = [ops[n] for n in label.split(" + ") if n in ops], [found[n] for n in names if n in found]
        under = "/".join(sorted({h for _, h, _ in mine if h}))
        hidden = under if sum(b for _, h, b in mine if h) > 0.5 * sum(b for _, _, b in mine) else None
        total, moved = sum(t for t, _, _ in mine), sum(c.bytes * c.times for c in got) or 1.0
        out.update({c.name: Assumed(label, total * c.bytes * c.times / moved, hidden) for c in got if mine})
    return out


def _estimate_view(plan: Plan, chip: Chip, target: Target | None, text: str) -> tuple[dict[str, Assumed], str]:
    """The estimator's view of the compiled program (empty where no estimator describes the Plan) and its name."""
    if plan.spec.family == "user":
        return {}, ""
    est = estimate_program(for_target(plan, target) if target is not None else plan, chip)
    found = [c for c in collectives(parse_module(text)) if not c.explained]
    entries, _ = compare(est.collectives(), found, plan.shape)
    ops = {o.name: (o.time_s, o.hidden, o.bytes) for o in est.ops if o.is_collective}
    return estimator_view((e.to_dict() for e in entries), ops, text), est.source


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


@dataclass(frozen=True)
class TraceOverlap:
    """What a trace measured, per device and step (seconds): each collective's span and the part of it exposed, each
    device's idle time inside its steps and largest gap, and the pipeline bubble where the Plan pipelines."""

    backend: str
    steps: int
    collectives: dict[str, tuple[float, float]]  # name -> (span, exposed)
    idle: dict[int, tuple[float, float]]  # device -> (idle per step, largest gap)
    bubble: dict[str, Any] | None = None

    def to_dict(self, rows: Sequence[Collective]) -> dict[str, Any]:
        """With ``rows``: the schedule of the program that ran, its measured times filled in."""
        ran = [c for c in rows if c.measured_s is not None]
        return {
            "backend": self.backend,
            "steps": self.steps,
            "collectives": [c.to_dict() for c in ran],
            "per_axis": per_axis(replace(c, time_s=c.measured_s, exposed_s=c.measured_exposed_s) for c in ran),
            "idle": [{"device": d, "idle_s": i, "largest_gap_s": g} for d, (i, g) in sorted(self.idle.items())],
            "pipeline_bubble": self.bubble,
        }


def trace_overlap(
    events: Iterable[Any], rows: Sequence[Collective], backend: str = "", bubble: dict[str, Any] | None = None
) -> TraceOverlap:
    """Each collective's measured span and the part of it no other op on the same device covers, averaged over the
    devices that ran it and the steps; each device's idle gaps inside a step.

    ``events``: op events with ``name``, ``device``, ``step``, ``start_us`` and ``dur_us``
    (:class:`lab.measure.trace.OpEvent`) of the program whose schedule gave ``rows``; events outside every step are
    left out when some are inside one. ``bubble``: what :func:`lab.measure.bubble.measure` found in the same trace."""
    evs = list(events)
    if any(e.step >= 0 for e in evs):
        evs = [e for e in evs if e.step >= 0]
    steps = max(1, len({e.step for e in evs}))
    ends = {c.start_op: c for c in rows} | {c.done_op: c for c in rows}
    per_device: dict[int, list] = defaultdict(list)
    for e in sorted(evs, key=lambda e: e.start_us):
        per_device[e.device].append(e)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ran: dict[str, set[int]] = defaultdict(set)
    for device, mine in per_device.items():
        work = _union((e.start_us, e.start_us + e.dur_us) for e in mine if e.name not in ends)
        started: dict[str, float] = {}
        for e in mine:
            c = ends.get(e.name)
            if c is not None and c.asynchronous and e.name == c.start_op:
                started[c.name] = e.start_us
            elif c is not None:
                a, b = started.pop(c.name, e.start_us), e.start_us + e.dur_us
                covered = sum(max(0.0, min(y, b) - max(x, a)) for x, y in work if x < b and y > a)
                sums[c.name][0] += b - a
                sums[c.name][1] += b - a - covered
                ran[c.name].add(device)
    cells = {n: 1e-6 / (steps * len(ran[n])) for n in sums}  # us summed over cells -> seconds per device and step
    measured = {n: (s * cells[n], x * cells[n]) for n, (s, x) in sums.items()}
    return TraceOverlap(backend, steps, measured, {d: _idle(m, steps) for d, m in per_device.items()}, bubble)


def _idle(events: list, steps: int) -> tuple[float, float]:
    """A device's time inside its steps with nothing running (per step) and its largest such gap, in seconds."""
    by_step: dict[int, list] = defaultdict(list)
    for e in events:
        by_step[e.step].append((e.start_us, e.start_us + e.dur_us))
    gaps = [b[0] - a[1] for spans in by_step.values() for a, b in itertools.pairwise(_union(spans))]
    return sum(gaps) * 1e-6 / steps, max(gaps, default=0.0) * 1e-6


def per_axis(rows: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Collectives' time, exposed time and the time the estimator hides, summed per set of mesh axes."""
    out: dict[str, dict[str, float]] = {}
    for c in rows:
        d = out.setdefault(",".join(c.axes) or "-", dict.fromkeys(("count", "time_s", "exposed_s", "hidden_s"), 0.0))
        t = c.time_s or 0.0
        d["count"], d["time_s"], d["exposed_s"] = d["count"] + 1, d["time_s"] + t, d["exposed_s"] + (c.exposed_s or 0.0)
        d["hidden_s"] += t if c.assumed_hidden else 0.0
    return out


@dataclass(frozen=True)
class OverlapExplanation(CompiledView):
    collectives: tuple[Collective, ...]
    estimator: str = ""
    trace: TraceOverlap | None = None
    trace_rows: tuple[Collective, ...] = field(default=(), repr=False)  # the run's schedule, which names its trace
    merged: bool = False  # the run ran this schedule: its measured times are in ``collectives`` too

    @property
    def synchronous(self) -> bool:
        return not any(c.asynchronous for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        flagged = {c.name for c in (*self.collectives, *self.trace_rows) if c.flagged}  # by the schedule or the trace
        return self.view_dict() | {
            "synchronous": self.synchronous,
            "estimator": self.estimator,
            "flag_share": FLAG_SHARE,
            "collectives": [c.to_dict() for c in self.collectives],
            "per_axis": per_axis(self.collectives),
            "flagged": sorted(flagged),
            **({"trace": self.trace.to_dict(self.trace_rows) | {"same_schedule": self.merged}} if self.trace else {}),
        }

    def table(self) -> str:
        out = f"overlap in {self.target} on mesh {self.mesh_text} ({self.where}), seconds per step on one device; "
        out += f"estimated: the {self.estimator}" if self.estimator else "no estimator describes this program"
        if self.synchronous and self.backend == "cpu":
            out += (
                "\nXLA:CPU's collectives are synchronous (no start/done pairs): the schedule overlaps nothing with one"
            )
            out += ", so each is predicted exposed in full"
        elif self.synchronous:
            out += (
                "\nevery collective of this schedule is synchronous: nothing overlaps one, so each is exposed in full"
            )
        out += "\n" + _rows(self.collectives, measured=self.merged)
        out += "\n" + _axes(per_axis(self.collectives), "predicted")
        also = " or the trace" if self.merged else ""
        out += (
            f"\nflagged: {sum(c.flagged for c in self.collectives)} collectives the estimator hides that the schedule"
            f"{also} shows exposed (by more than {100 * FLAG_SHARE:g}% of their time)"
        )
        return out + ("\n\n" + _trace_text(self.trace, self.trace_rows, self.merged) if self.trace else "")


def _s(x: float | None) -> str:
    return "-" if x is None else fmt_seconds(x)


def _rows(rows: Sequence[Collective], measured: bool = False) -> str:
    where: dict[str, str] = {}
    for c in rows:  # the computations by short names: the entry, and the loops in order of their first collective
        loops = sum(v.startswith("loop") for v in where.values())
        where.setdefault(c.computation, "entry" if c.times == 1 and not where else f"loop {loops + 1} x{c.times:g}")
    body = []
    for c in rows:
        a = c.assumed
        view = "-" if a is None else (f"hidden: {a.hidden}" if a.hidden else "exposed")
        ops = f"{len(c.overlapped_ops)} ops, {fmt_seconds(c.overlap_s)}" if c.overlapped_ops else "-"
        row = [c.name, c.kind, ",".join(c.axes), where[c.computation], c.start, c.done, ops, _s(c.time_s)]
        row += [_s(c.exposed_s), *([_s(c.measured_s), _s(c.measured_exposed_s)] if measured else []), view]
        body.append([*row, "FLAGGED" if c.flagged else ""])
    heads = ["collective", "kind", "axes", "where", "start", "done", "overlapped", "time", "exposed"]
    heads += [*(["measured", "measured exposed"] if measured else []), "estimator", "flag"]
    return render(heads, body) if body else "no collectives in the compiled program"


def _axes(axes: Mapping[str, Mapping[str, float]], what: str) -> str:
    parts = [f"{k} {fmt_seconds(v['exposed_s'])} of {fmt_seconds(v['time_s'])}" for k, v in axes.items()]
    return f"exposed per mesh axis ({what}, of the collectives' time): " + ("; ".join(parts) or "none")


def _trace_text(t: TraceOverlap, rows: Sequence[Collective], shown: bool) -> str:
    """The trace's part of the table; its collectives too unless the schedule's table shows them (``shown``)."""
    data = t.to_dict(rows)
    lines = [f"measured in the run ({t.backend}, {t.steps} steps), seconds per step on one device"]
    if not shown:
        lines.append(_rows([c for c in rows if c.measured_s is not None], measured=True))
    lines.append(_axes(data["per_axis"], "measured"))
    if t.idle:
        gap, device = max((g, d) for d, (_, g) in t.idle.items())
        mean = sum(i for i, _ in t.idle.values()) / len(t.idle)
        lines.append(f"idle gaps: {fmt_seconds(mean)} per step, the mean of {len(t.idle)} devices; the largest gap ")
        lines[-1] += f"{fmt_seconds(gap)} (device {device})"
    if b := t.bubble:
        lines.append(f"pipeline bubble: {100 * b['measured']:.1f}% of the stages' compute went to steps they had no ")
        lines[-1] += f"work in (the schedule's (p - 1) / steps: {100 * b['predicted']:.1f}%)"
    flagged = sum(bool(c.assumed_hidden) and shows_exposed(c.measured_exposed_s, c.measured_s) for c in rows)
    return "\n".join([*lines, f"flagged in the trace: {flagged} collectives the estimator hides that ran exposed"])


def compiled_text(plan: Plan, target: Target | None) -> str:
    """The Plan's program compiled as the audit compiles it (:func:`lab.compile.audit.compile_plan`), as HLO text;
    a program XLA refuses is a :class:`UserError` with XLA's first line."""
    import jax

    from lab.compile.audit import compile_plan

    try:
        return compile_plan(plan, target)[1].as_text()
    except jax.errors.JaxRuntimeError as exc:
        said = next(iter(str(exc).strip().splitlines()), type(exc).__name__)[:300]
        on = f"for {target.name}" if target is not None else "on this host"
        raise UserError(f"{plan.name or plan.program} does not compile {on}: {said}") from None


@dataclass(frozen=True)
class Run:
    """A finished run: its HLO, mesh, the estimator's view of its program, its trace's events and pipeline bubble."""

    hlo_text: str
    mesh: dict[str, int]
    assumed: dict[str, Assumed]
    events: tuple[Any, ...]
    backend: str
    bubble: dict[str, Any] | None = None


def _measured(rows: Sequence[Collective], got: Mapping[str, tuple[float, float]]) -> list[Collective]:
    times = {n: {"measured_s": span, "measured_exposed_s": x} for n, (span, x) in got.items()}
    return [replace(c, **times.get(c.name, {})) for c in rows]


def explain_overlap(
    plan: Plan, chip: Chip, target: Target | None = None, price: Callable | None = None, run: Run | None = None
) -> OverlapExplanation:
    """Compile the Plan's program (for ``target`` if given) and explain what overlaps each collective beside the
    estimator's assumptions; with a ``run``, what its trace measured too. ``price(hlo_text)``: predicted seconds of
    one execution of each compute instruction of a program (None: no compute is credited to an overlap)."""
    import jax

    text = compiled_text(plan, target)
    assumed, source = _estimate_view(plan, chip, target, text)
    rows = schedule_overlap(text, plan.shape, price(text) if price else {}, assumed)
    trace, ran, merged = None, [], False
    if run is not None:
        ran = schedule_overlap(run.hlo_text, run.mesh, price(run.hlo_text) if price else {}, run.assumed)
        trace = trace_overlap(run.events, ran, run.backend, run.bubble)
        ran = _measured(ran, trace.collectives)
        same = [(c.name, c.start, c.done) for c in rows] == [(c.name, c.start, c.done) for c in ran]
        merged = target is None and same  # the run ran this schedule
        rows = _measured(rows, trace.collectives) if merged else rows
    backend, where = ("tpu", target.name) if target is not None else (jax.devices()[0].platform, None)
    view = {"target": plan.name or plan.program, "mesh": dict(plan.shape), "backend": backend, "compiled_for": where}
    return OverlapExplanation(tuple(rows), source, trace, tuple(ran), merged, **view)


__all__ = [
    "FLAG_SHARE",
    "Assumed",
    "Collective",
    "OverlapExplanation",
    "Run",
    "TraceOverlap",
    "compiled_text",
    "estimator_view",
    "explain_overlap",
    "per_axis",
    "schedule_overlap",
    "shows_exposed",
    "trace_overlap",
]
