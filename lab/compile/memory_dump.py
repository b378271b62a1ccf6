"""XLA's memory plan as it writes it: the buffer assignment and the live ranges of a compiled module.

Compiled with ``xla_dump_to`` (a compile option, so no process-wide flag), XLA writes beside the optimized HLO
``*after_optimizations-buffer-assignment.txt`` (every allocation: entry parameter, output, constant, thread-local
or the one preallocated temporary heap of each memory space, with the HLO values placed in it at their offsets)
and ``*after_optimizations-live-range.txt`` (the flattened schedule and, per HLO value, the positions in it from
its definition to its last use). The same files come from XLA:CPU and from libtpu, so a program cross-compiled
for a TPU that is not here is read the same way. This module only parses them; :mod:`lab.compile.memory` joins
them to the Plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from lab.core.errors import UserError

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <(\d+) (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$")
_STEP = re.compile(r"^    (\d+):(\S+)$")
_PARAMETER = re.compile(r"parameter (\d+), shape \|(.*?)\| at ShapeIndex")
_COLOR = re.compile(r"color (\d+)")


@dataclass(frozen=True)
class Value:
    """One HLO value in an allocation: ``name`` is its instruction, with ``{i}`` for a tuple element; ``id`` is
    XLA's value id, the buffer id of the heap simulator's trace."""

    name: str
    size: int
    offset: int
    shape: str
    id: int = -1

    @property
    def key(self) -> str:
        """The value as the live-range file names it (``name{}`` for a whole instruction)."""
        return self.name if "{" in self.name else self.name + "{}"

    @property
    def instruction(self) -> str:
        return self.name.split("{", 1)[0]


@dataclass(frozen=True)
class Allocation:
    """A buffer allocation: ``kind`` is parameter, output, temp, constant, thread-local or live-out."""

    index: int
    size: int
    kind: str
    color: int = 0
    parameter: int | None = None
    shape: str = ""
    live_out: bool = False
    values: tuple[Value, ...] = field(default_factory=tuple)


def _kind(rest: str) -> tuple[str, int | None, str]:
    m = _PARAMETER.search(rest)
    if m:
        return "parameter", int(m.group(1)), m.group(2)
    for word in ("preallocated-temp", "thread-local", "constant"):
        if word in rest:
            return ("temp" if word == "preallocated-temp" else word), None, ""
    if "output shape is" in rest:
        return "output", None, ""
    return ("live-out" if "maybe-live-out" in rest else "other"), None, ""


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """The allocations of a ``buffer-assignment.txt``, each with the values placed in it."""
    out: list[Allocation] = []
    values: list[Value] = []
    head: tuple | None = None

    def close() -> None:
        if head is not None:
            out.append(Allocation(*head, values=tuple(values)))

    for line in text.splitlines():
        if line.startswith("Total bytes used"):
            break
        m = _ALLOCATION.match(line)
        if m:
            close()
            rest = m.group(3)
            kind, param, shape = _kind(rest)
            color = _COLOR.search(rest)
            head = (int(m.group(1)), int(m.group(2)), kind, int(color.group(1)) if color else 0, param, shape)
            head += ("maybe-live-out" in rest,)
            values = []
            continue
        v = _VALUE.match(line)
        if v and head is not None:
            values.append(Value(v.group(2), int(v.group(3)), int(v.group(4)), v.group(5), int(v.group(1))))
    close()
    return out


@dataclass(frozen=True)
class LiveRanges:
    """The flattened schedule (``sequence[t]`` is the instruction at position ``t``) and each value's span."""

    sequence: tuple[str, ...]
    spans: dict[str, tuple[int, int]]

    @property
    def length(self) -> int:
        return len(self.sequence)


def parse_live_ranges(text: str) -> LiveRanges:
    """The ``HloLiveRange`` dump: its instruction sequence and ``BufferLiveRange`` section."""
    sequence: dict[int, str] = {}
    spans: dict[str, tuple[int, int]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            section = line.strip()
            continue
        if section.startswith("InstructionSequence"):
            m = _STEP.match(line)
            if m:
                sequence[int(m.group(1))] = m.group(2)
        elif section.startswith("BufferLiveRange"):
            m = _RANGE.match(line)
            if m:
                spans[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    ordered = tuple(sequence.get(i, "") for i in range(max(sequence, default=-1) + 1))
    return LiveRanges(ordered, spans)


def _assignment(folder: Path) -> Path:
    """The buffer assignment of the largest module XLA dumped into ``folder``."""
    found = sorted(folder.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not found:
        raise UserError(f"XLA wrote no buffer assignment under {str(folder)!r}; this jaxlib does not dump one")
    return found[-1]


def read_dump(folder: str | Path) -> tuple[list[Allocation], LiveRanges]:
    """The buffer assignment and live ranges of the largest module XLA dumped into ``folder``."""
    assignment = _assignment(Path(folder))
    ranges = Path(str(assignment).replace("-buffer-assignment.txt", "-live-range.txt"))
    if not ranges.exists():
        raise UserError(f"XLA wrote a buffer assignment but no live ranges ({ranges.name}); this jaxlib is too old")
    return parse_buffer_assignment(assignment.read_text()), parse_live_ranges(ranges.read_text())


def read_flag(folder: str | Path, name: str) -> str | None:
    """A compiler flag's value as the backend wrote it beside that module (libtpu's ``*.flagfile``); None where
    there is no flag file (XLA:CPU writes none) or no such flag."""
    flags = Path(
        str(_assignment(Path(folder))).removesuffix(".after_optimizations-buffer-assignment.txt") + ".flagfile"
    )
    if not flags.exists():
        return None
    m = re.search(rf"^--{re.escape(name)}='?([^'\n]*)'?$", flags.read_text(), re.M)
    return m.group(1) if m else None


# ----- the heap simulator's trace (HloProto, protobuf wire format) ------------------------------


@dataclass(frozen=True)
class HeapTrace:
    """The heap simulator's events for one allocation: ``(kind, buffer id)`` in order, kind 0 alloc, 1 free,
    2 share-with (placed in a buffer already allocated); ``sizes`` are the buffers' bytes."""

    allocation: int
    events: tuple[tuple[int, int], ...]
    sizes: dict[int, int]


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """``(field number, value)`` of a protobuf message: an int for a varint, bytes for a length-delimited field."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            n, i = _varint(data, i)
            value, i = data[i : i + n], i + n
        elif wire in (1, 5):
            value, i = data[i : i + (8 if wire == 1 else 4)], i + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"protobuf wire type {wire} is not read here")
        yield key >> 3, value


def parse_heap_traces(hlo_proto: bytes) -> dict[int, HeapTrace]:
    """The heap simulator traces of an ``HloProto``'s buffer assignment (field 3), by allocation index.

    ``BufferAssignmentProto``: logical buffers (1: id 1, size 2), heap simulator traces (4: events 1, allocation
    index 3); an event: kind 1, buffer id 2."""
    assignment = b"".join(v for f, v in _fields(hlo_proto) if f == 3)
    sizes: dict[int, int] = {}
    traces: dict[int, HeapTrace] = {}
    raw = []
    for f, v in _fields(assignment):
        if f == 1:
            d = dict(_fields(v))
            sizes[d.get(1, 0)] = d.get(2, 0)
        elif f == 4:
            raw.append(v)
    for v in raw:
        events, index = [], None
        for g, w in _fields(v):
            if g == 1:
                e = dict(_fields(w))
                events.append((e.get(1, 0), e.get(2, 0)))
            elif g == 3:
                index = w
        if index is not None:
            traces[index] = HeapTrace(index, tuple(events), sizes)
    return traces


def read_heap_traces(folder: str | Path) -> dict[int, HeapTrace]:
    """The heap simulator traces of the module :func:`read_dump` reads; empty where XLA wrote no proto."""
    proto = Path(str(_assignment(Path(folder))).replace("-buffer-assignment.txt", ".hlo.pb"))
    return parse_heap_traces(proto.read_bytes()) if proto.exists() else {}


__all__ = [
    "Allocation",
    "HeapTrace",
    "LiveRanges",
    "Value",
    "parse_buffer_assignment",
    "parse_heap_traces",
    "parse_live_ranges",
    "read_dump",
    "read_flag",
    "read_heap_traces",
]
