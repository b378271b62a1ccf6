"""Matching a compiled program's collectives to the ones its estimate expects.

Per (kind, mesh axes): the bytes must agree, exactly (up to float rounding), or through a lowering XLA is known to
choose that moves the same V (an AllReduce split into ReduceScatter + AllGather, ReduceScatters lowered as
AllReduces plus a local slice, small AllGathers as AllReduces of a padded buffer): each such match says what
moved. Whatever is left over is unexpected (:mod:`lab.compile.audit` reports it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from lab.compile.hlo import CompiledCollective, axes_of_groups, axes_of_pairs
from lab.core.units import dtype_bytes, fmt_bytes
from lab.predict.program.estimate import ExpectedCollective

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


def _live(axes: tuple[str, ...], mesh: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.get(a, 1) > 1)


def _axes_of(c: CompiledCollective, mesh: dict[str, int]) -> tuple[str, ...] | None:
    if c.kind == "permute":
        return axes_of_pairs(list(c.pairs), mesh)
    return axes_of_groups([list(g) for g in c.groups], mesh)


def _same(a: float, b: float) -> bool:
    """Byte counts agree: exactly, up to the rounding of predictions computed in floating point."""
    return abs(a - b) <= max(0.5, 1e-9 * max(abs(a), abs(b)))


def total_bytes(cs: list[CompiledCollective]) -> float:
    return sum(c.bytes * c.times for c in cs)


def group_compiled(compiled: list[CompiledCollective], mesh: dict[str, int]) -> dict[Key, list[CompiledCollective]]:
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
    if rs and ag and _same(total_bytes(rs), nbytes) and _same(total_bytes(ag), nbytes):
        used |= {("reduce-scatter", key[1]), ("all-gather", key[1])}
        return _lowered(label, key, nbytes, rs + ag, "XLA split it into ReduceScatter + AllGather")
    return None


def _reduce_scatter_as_all_reduce(key: Key, label: str, nbytes: float, groups, want, used: set) -> list[AuditEntry]:
    """XLA may lower a ReduceScatter, or some of the ReduceScatters over these axes, as an AllReduce plus a local
    slice (combined with any AllReduces expected over the same axes): XLA:CPU for small ones, the TPU compiler
    where it combines several gradients into one AllReduce. The V over the axes is the same."""
    ar, rs = groups.get(("all-reduce", key[1]), []), groups.get(key, [])
    also = sum(p.bytes for p in want.get(("all-reduce", key[1]), []))
    if not (ar and _same(total_bytes(ar) + total_bytes(rs), nbytes + also)):
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
        how = f"{fmt_bytes(total_bytes(ar))} of it lowered as AllReduce + local slice (same V), the rest ReduceScatter"
    return [*out, _lowered(label, key, nbytes, rs + ar, how)]


def _direct(key: Key, preds: list[ExpectedCollective], got: list[CompiledCollective]) -> AuditEntry:
    """Same kind over the same axes: bytes must agree, or element counts where XLA changed the element type."""
    label = " + ".join(p.op for p in preds)
    want_bytes = sum(p.bytes for p in preds)
    comp_bytes = total_bytes(got)
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
    if not _same(total_want, sum(total_bytes(cs) for cs in got.values())):
        return entries
    rest = [e for e in entries if not (e.axes == axes and e.kind in MOVABLE)]
    moved = []
    for k in MOVABLE:
        if want[k] or got[k]:
            used.add((k, axes))
            delta = total_bytes(got[k]) - sum(p.bytes for p in want[k])
            if not _same(delta, 0.0):
                moved.append(f"{fmt_bytes(abs(delta))} {'more' if delta > 0 else 'less'} {k}")
    note = "lowered across kinds: " + ", ".join(moved) + "; together the same V over these axes"
    for k in MOVABLE:
        if want[k] or got[k]:
            label = " + ".join(p.op for p in want[k]) or f"{k}s nobody expected"
            names = tuple(c.name for c in got[k])
            rest.append(
                AuditEntry(label, k, axes, sum(p.bytes for p in want[k]), total_bytes(got[k]), True, names, note)
            )
    return rest


def _elements(cs: list[CompiledCollective]) -> float:
    return sum(c.elements * c.times for c in cs)


def _expected_elements(ps: list[ExpectedCollective]) -> float:
    return sum(p.bytes / dtype_bytes(p.dtype) for p in ps)


def _combined_axes(entries: list[AuditEntry], expected, groups, used: set, mesh) -> list[AuditEntry]:
    """The TPU compiler reduces a value that the program sums over axes A and then over axes B (a weight gradient
    over the context shards, then over the data replicas) in one AllReduce over A and B together. Where the
    unmatched AllReduces expected over A and over B hold, element for element, what was compiled over A and over B
    (AllReduces, and ReduceScatters nobody expected there: a gather's transpose) plus twice what was compiled over
    both (each such value is in both expectations, and reduced once), the three match: the same values, summed."""
    unmatched = {e.axes for e in entries if not e.match and e.kind == "all-reduce"}
    order = {a: i for i, a in enumerate(mesh)}
    for key in [k for k in groups if k[0] == "all-reduce" and len(k[1]) > 1 and k not in used]:
        for n in range(1, len(key[1])):
            for a in itertools.combinations(key[1], n):
                b = tuple(sorted(set(key[1]) - set(a), key=order.get))
                if a in unmatched and b in unmatched:
                    combined = _combine(entries, (a, b), key, expected, groups, used)
                    if combined is not None:  # matched: look for another such reduction among what is left
                        return _combined_axes(combined, expected, groups, used, mesh)
    return entries


def _combine(entries: list[AuditEntry], parts, key: Key, expected, groups, used: set) -> list[AuditEntry] | None:
    """The entries with the AllReduces expected over ``parts = (a, b)`` matched to what was compiled over each and
    over both (``key``), if the elements agree; None if they do not."""
    a, b = parts
    apart = [k for axes in (a, b) for k in (("all-reduce", axes), ("reduce-scatter", axes))]
    apart = [k for k in apart if k[0] == "all-reduce" or (k not in expected and k not in used)]
    want = _expected_elements(expected[("all-reduce", a)] + expected[("all-reduce", b)])
    got = sum(_elements(groups.get(k, [])) for k in apart) + 2 * _elements(groups[key])
    if not _same(want, got):
        return None
    used |= {key, *[k for k in apart if groups.get(k)]}
    note = f"combined with the AllReduce over {','.join(key[1])}: values both sum, reduced once; elements agree"
    rest = [e for e in entries if not (e.kind == "all-reduce" and e.axes in parts)]
    for axes in parts:
        got_here = [c for k in apart if k[1] == axes for c in groups.get(k, [])]
        ps = expected[("all-reduce", axes)]
        label, nbytes = " + ".join(p.op for p in ps), sum(p.bytes for p in ps)
        names = tuple(c.name for c in got_here)
        rest.append(AuditEntry(label, "all-reduce", axes, nbytes, total_bytes(got_here), True, names, note))
    how = f"XLA combined the reductions over {','.join(a)} and over {','.join(b)} into one"
    rest.append(_lowered("the values summed over both", key, total_bytes(groups[key]), groups[key], how))
    return rest


def compare(
    predicted: list[ExpectedCollective], compiled: list[CompiledCollective], mesh: dict[str, int]
) -> tuple[list[AuditEntry], list[dict[str, Any]]]:
    """Match expected and compiled collectives per (kind, axes); list what nobody expected."""
    groups = group_compiled(compiled, mesh)
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
        direct = groups.get(key) and _same(total_bytes(groups[key]), nbytes)
        if not direct and key[0] == "reduce-scatter":
            lowered = _reduce_scatter_as_all_reduce(key, label, nbytes, groups, want, used)
            if lowered:
                entries += lowered
                continue
        if groups.get(key):
            used.add(key)
        entries.append(_direct(key, preds, groups.get(key, [])))
    entries = _combined_axes(entries, expected, groups, used, mesh)
    for axes in {e.axes for e in entries if not e.match}:
        entries = _across_kinds(axes, entries, expected, groups, used)
    unexpected = [listed(c, mesh) for key, cs in groups.items() if key not in used for c in cs]
    return entries, unexpected


def listed(c: CompiledCollective, mesh: dict[str, int]) -> dict[str, Any]:
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


__all__ = ["FLOP_TOLERANCE", "AuditEntry", "Key", "compare", "group_compiled", "listed", "total_bytes"]
