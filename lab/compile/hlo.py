"""Parse optimized HLO text into collectives and matmuls (no JAX needed).

The input is ``jax.jit(f).lower(*args).compile().as_text()``. What comes out:

* **Collectives**: kind (``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``,
  ``collective-permute``; the async ``*-start`` forms count once), element type, the per-device
  byte count V in the collective model's convention (:mod:`lab.predict.collectives`: AllGather output,
  ReduceScatter and AllReduce operand, AllToAll operand times the group size, permute operand), the
  replica groups (explicit ``{{0,1},{2,3}}`` or iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``) or
  permute pairs, how many times it runs (inside a ``while`` with a known trip count), and where it
  came from (``op_name`` and the source line, resolved through the module's stack-frame tables).
* **Matmuls** are read from the same parsed module by :mod:`lab.compile.hlo_dots`.

Mapping replica groups to mesh axis names needs the mesh shape: :func:`axes_of_groups` tries every
subset of mesh axes and returns the one whose groups (over device positions in mesh order) match.
"""
# Over 500 lines on purpose: one parser of HLO text: collectives, dots and shapes share its tokenizer and its
# replica-group reading.

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lab.core.collective_kinds import HLO_NAMES, from_hlo

HLO_DTYPES = {
    "f32": ("fp32", 4),
    "bf16": ("bf16", 2),
    "f16": ("fp16", 2),
    "f64": ("fp64", 8),
    "s8": ("int8", 1),
    "u8": ("uint8", 1),
    "s32": ("int32", 4),
    "u32": ("uint32", 4),
    "s64": ("int64", 8),
    "pred": ("bool", 1),
    "f8e4m3fn": ("fp8", 1),
    "f8e5m2": ("fp8", 1),
    "s4": ("int4", 0.5),
    "u4": ("uint4", 0.5),
    "s16": ("int16", 2),
}
# HLO collective ops (and their async -start halves) by the kind the lab reads them as: lab.core.collective_kinds
COLLECTIVES = {name + half: name for name in HLO_NAMES for half in ("", "-start")}

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\))?.*\{\s*$")


@dataclass(frozen=True)
class Shape:
    dtype: str  # HLO element type, e.g. "bf16"
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.elements * HLO_DTYPES.get(self.dtype, (self.dtype, 4))[1]


def parse_shapes(text: str) -> list[Shape]:
    """Every array shape in ``text`` (a tuple shape gives several)."""
    out = []
    for dt, dims in _SHAPE.findall(text):
        if dt in HLO_DTYPES:
            out.append(Shape(dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    result: tuple[Shape, ...]
    operands_text: str
    attrs: str
    computation: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=", self.attrs)
        if not m:
            return None
        i = m.end()
        if self.attrs.startswith("mesh[", i):
            j = self.attrs.index("]", i) + 1
            k = self.attrs.index("}", j) + 1
            return self.attrs[i:k]
        if i < len(self.attrs) and self.attrs[i] in '{["':
            return _balanced(self.attrs, i)
        j = i
        while j < len(self.attrs) and self.attrs[j] not in ", ":
            j += 1
        return self.attrs[i:j]


def _balanced(s: str, i: int) -> str:
    """The bracketed or quoted value starting at ``s[i]`` (through its matching close)."""
    opener = s[i]
    if opener == '"':
        j = s.index('"', i + 1)
        return s[i : j + 1]
    close = {"{": "}", "[": "]"}[opener]
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "{[":
            depth += 1
        elif s[j] in "}]":
            depth -= 1
            if depth == 0:
                # iota replica groups continue past the bracket: [2,4]<=[8]T(1,0)
                k = j + 1
                if close == "]" and s.startswith("<=", k):
                    m = re.match(r"<=\[[0-9,]*\](?:T\([0-9,]*\))?", s[k:])
                    if m:
                        k += m.end()
                return s[i:k]
    return s[i:]


def _split_operands(rest: str) -> tuple[str, str]:
    """``rest`` is what follows ``opcode(``: split the operand list from the attributes."""
    depth = 1
    for j, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return rest[:j], rest[j + 1 :].lstrip(", ")
    return rest, ""


@dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    frames: dict[int, tuple[str, int, str]]  # stack_frame_id -> (file, line, function)

    def calls(self, instr: Instruction) -> list[tuple[str, float]]:
        """Computations an instruction runs, with how many times."""
        out: list[tuple[str, float]] = []
        if instr.opcode == "while":
            trips = _trip_count(instr) or self._condition_trips(instr) or 1.0
            body = instr.attr("body")
            if body:
                out.append((body.lstrip("%"), trips))
            return out
        for key in ("calls", "to_apply"):
            v = instr.attr(key)
            if v and instr.opcode not in (
                "all-reduce",
                "reduce-scatter",
                "all-reduce-start",
                "reduce",
                "scatter",
                "sort",
                "reduce-window",
                "select-and-scatter",
                "map",
            ):
                out += [(c.strip().lstrip("%"), 1.0) for c in v.strip("{}").split(",") if c.strip()]
        if instr.opcode == "conditional":
            v = instr.attr("branch_computations")
            if v:
                out += [(c.strip().lstrip("%"), 1.0) for c in v.strip("{}").split(",")]
        return out

    def walk(self) -> list[tuple[Instruction, float]]:
        """Every instruction reachable from the entry computation, with its execution count."""
        out: list[tuple[Instruction, float]] = []
        stack = [(self.entry, 1.0)]
        seen_depth = 0
        while stack:
            comp, times = stack.pop()
            seen_depth += 1
            if seen_depth > 100000:
                break
            for instr in self.computations.get(comp, []):
                out.append((instr, times))
                for callee, n in self.calls(instr):
                    stack.append((callee, times * n))
        return out

    def _condition_trips(self, instr: Instruction) -> float | None:
        """A scan's trip count from its condition, ``i < N`` with ``N`` a constant (the TPU compiler does not
        annotate one); the counter is taken to start at 0, as ``lax.scan`` and ``fori_loop`` lower it."""
        cond = (instr.attr("condition") or "").lstrip("%")
        body = self.computations.get(cond, [])
        consts = {}
        for i in body:
            m = re.fullmatch(r"\s*(-?\d+)\s*", i.operands_text) if i.opcode == "constant" else None
            if m:
                consts[i.name] = int(m.group(1))
        for i in body:
            if i.opcode == "compare" and "direction=LT" in i.attrs:
                names = [o.strip().lstrip("%") for o in i.operands_text.split(",")]
                if len(names) == 2 and names[1] in consts:
                    return float(consts[names[1]])
        return None

    def table(self, computation: str) -> dict[str, Instruction]:
        """Instructions of one computation by name (cached)."""
        cache = self.__dict__.setdefault("_tables", {})
        if computation not in cache:
            cache[computation] = {i.name: i for i in self.computations.get(computation, [])}
        return cache[computation]

    def source(self, instr: Instruction) -> str:
        """``file:line (function)`` of an instruction, from its metadata."""
        meta = instr.attr("metadata") or ""
        m = re.search(r'source_file="([^"]+)"\s+source_line=(\d+)', meta)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        m = re.search(r"stack_frame_id=(\d+)", meta)
        if m and int(m.group(1)) in self.frames:
            f, line, fn = self.frames[int(m.group(1))]
            return f"{f}:{line} ({fn})"
        return ""

    def op_name(self, instr: Instruction) -> str:
        meta = instr.attr("metadata") or ""
        m = re.search(r'op_name="([^"]+)"', meta)
        return m.group(1) if m else ""


def _trip_count(instr: Instruction) -> float | None:
    """The trip count XLA:CPU and XLA:GPU annotate (``known_trip_count``); None where it is not given."""
    cfg = instr.attr("backend_config")
    if cfg:
        try:
            data = json.loads(cfg)
            return float(data["known_trip_count"]["n"])
        except (ValueError, KeyError, TypeError):
            pass
    return None


def _frames(text: str) -> dict[int, tuple[str, int, str]]:
    files = {int(a): b for a, b in re.findall(r'^(\d+) "([^"]*)"\s*$', _section(text, "FileNames"), re.M)}
    funcs = {int(a): b for a, b in re.findall(r'^(\d+) "([^"]*)"\s*$', _section(text, "FunctionNames"), re.M)}
    locs = {}
    for m in re.finditer(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", _section(text, "FileLocations"), re.M
    ):
        locs[int(m.group(1))] = (files.get(int(m.group(2)), "?"), int(m.group(4)), funcs.get(int(m.group(3)), "?"))
    frames = {}
    for m in re.finditer(r"^(\d+) \{file_location_id=(\d+)", _section(text, "StackFrames"), re.M):
        if int(m.group(2)) in locs:
            frames[int(m.group(1))] = locs[int(m.group(2))]
    return frames


def _section(text: str, title: str) -> str:
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


def module_name(text: str) -> str | None:
    """The module's name (``jit_body``), from the first line of its HLO text (``HloModule NAME, ...``)."""
    first = text.split("\n", 1)[0]
    if not first.startswith("HloModule "):
        return None
    return first[len("HloModule ") :].split(",", 1)[0].strip() or None


def _joined(lines: list[str]):
    """The lines with an instruction that spans several joined into one: libtpu writes a kernel's
    ``frontend_attributes={kernel_metadata={`` JSON (a Pallas kernel's block sizes) on lines of its own, and the
    instruction's metadata and backend config after it; an instruction's braces balance once it is whole."""
    pending: list[str] = []
    depth = 0
    for line in lines:
        if pending:
            pending.append(line.strip())
            depth += line.count("{") - line.count("}")
            if depth <= 0:
                yield " ".join(pending)
                pending = []
            continue
        if _INSTR.match(line) and (opened := line.count("{") - line.count("}")) > 0:
            pending, depth = [line], opened
            continue
        yield line
    if pending:
        yield " ".join(pending)


def parse_module(text: str) -> Module:
    """Split HLO text into computations of instructions."""
    comps: dict[str, list[Instruction]] = {}
    entry = ""
    current: str | None = None
    for line in _joined(text.splitlines()):
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, result_text, opcode, rest = m.groups()
        operands, attrs = _split_operands(rest)
        comps[current].append(
            Instruction(
                name=name,
                opcode=opcode,
                result=tuple(parse_shapes(result_text)),
                operands_text=operands,
                attrs=attrs,
                computation=current,
            )
        )
    if not entry and comps:
        entry = next(reversed(comps))
    return Module(computations=comps, entry=entry, frames=_frames(text))


# ----- replica groups ------------------------------------------------------------------------


def parse_replica_groups(value: str | None) -> list[list[int]] | None:
    """``{{0,1},{2,3}}`` or iota ``[G,S]<=[d0,d1,...]T(perm)`` -> list of groups."""
    if not value:
        return None
    value = value.strip()
    if value.startswith("mesh["):  # mesh['a'=1,'b'=2] [, device_ids=([d0,d1]T(perm))] {'b'}: groups along 'b'
        m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\))?\s*\{([^}]*)\}", value)
        if not m:
            return None
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        names = [a for a, _ in axes]
        shape = [int(n) for _, n in axes]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3)) if a in names]
        ids = _iota(m.group(2), math.prod(shape)) if m.group(2) else np.arange(math.prod(shape))
        ids = ids.reshape(shape)  # the device at each position of that mesh, row-major
        rest = [i for i in range(len(shape)) if i not in over]
        size = math.prod(shape[i] for i in over) if over else 1
        return np.transpose(ids, rest + over).reshape(-1, size).tolist()
    if value.startswith("["):
        m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", value)
        if not m:
            return None
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist() if len(shape) == 2 else [ids.reshape(-1).tolist()]
    groups = re.findall(r"\{([0-9,\s]*)\}", value[1:-1] if value.startswith("{{") else value)
    return [[int(x) for x in g.split(",") if x.strip()] for g in groups if g.strip()]


def _iota(text: str, n: int) -> np.ndarray:
    """Device ids of an iota list ``[d0,d1,...]T(perm)``: ``arange(n)`` reshaped, transposed and flattened."""
    m = re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if not m:
        return np.arange(n)
    ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def mesh_groups(mesh_shape: Sequence[int], axes: Sequence[int]) -> set[frozenset[int]]:
    """Groups of device positions (row-major over the mesh) that vary only along ``axes``."""
    n = math.prod(mesh_shape)
    pos = np.arange(n).reshape(mesh_shape)
    rest = [i for i in range(len(mesh_shape)) if i not in axes]
    moved = np.transpose(pos, rest + list(axes)).reshape(-1, math.prod(mesh_shape[i] for i in axes) if axes else 1)
    return {frozenset(int(x) for x in row) for row in moved}


def axes_of_groups(groups: list[list[int]] | None, mesh: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axis names whose groups equal ``groups``; None when no subset matches."""
    names = list(mesh)
    shape = [mesh[a] for a in names]
    n = math.prod(shape)
    if not groups or (len(groups) == 1 and not groups[0]):
        groups = [list(range(n))]
    want = {frozenset(g) for g in groups}
    for k in range(0, len(names) + 1):
        for combo in itertools.combinations(range(len(names)), k):
            if mesh_groups(shape, list(combo)) == want:
                return tuple(names[i] for i in combo)
    return None


def axes_of_pairs(pairs: list[tuple[int, int]], mesh: dict[str, int]) -> tuple[str, ...] | None:
    """Mesh axes along which a permute's source/target positions differ."""
    names = list(mesh)
    shape = [mesh[a] for a in names]
    differ: set[int] = set()
    for src, dst in pairs:
        a, b = np.unravel_index(src, shape), np.unravel_index(dst, shape)
        differ |= {i for i in range(len(shape)) if a[i] != b[i]}
    return tuple(names[i] for i in sorted(differ)) if pairs else None


# ----- summaries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledCollective:
    name: str
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, permute
    dtype: str
    bytes: float  # V, the collective model's convention
    elements: int
    group_size: int
    groups: tuple[tuple[int, ...], ...] = field(default=())
    pairs: tuple[tuple[int, int], ...] = field(default=())
    times: float = 1.0
    op_name: str = ""
    source: str = ""
    explained: str = ""  # why a collective no estimate lists is there (the compiler's own fix-up), else ""


def operand_shapes(module: Module, instr: Instruction) -> list[Shape]:
    """Operand shapes: printed inline in some HLO dialects, else looked up by name in the computation."""
    inline = parse_shapes(instr.operands_text)
    if inline:
        return inline
    table = module.table(instr.computation)
    out: list[Shape] = []
    for name in re.findall(r"%?([\w.\-]+)", instr.operands_text):
        if name in table:
            out.extend(table[name].result)
    return out


def collectives(module: Module) -> list[CompiledCollective]:
    """Every collective the program runs, in the collective model's byte convention.

    The TPU compiler writes some reduce-scatters as a fusion (``kind=kCustom, calls=%all-reduce-scatter...``) of an
    all-reduce over a padded input and a dynamic slice: that fusion is one reduce-scatter of its operands."""
    out = []
    inside: set[int] = set()  # instructions of such fusions, counted through the fusion
    pieces = _async_pieces(module)
    chains: set[tuple[str, float]] = set()  # (channel, times) of the async collectives already counted
    for instr, times in module.walk():
        if id(instr) in inside:
            continue
        if instr.computation in pieces and instr.opcode in COLLECTIVES:
            chain = (instr.attr("channel_id") or instr.name, times)
            if chain in chains:
                continue
            chains.add(chain)
        callee = (instr.attr("calls") or "").lstrip("%") if instr.opcode == "fusion" else ""
        if callee.startswith("all-reduce-scatter"):
            body = module.computations.get(callee, [])
            inside.update(id(i) for i in body)
            reduce = next((i for i in body if COLLECTIVES.get(i.opcode) == "all-reduce"), None)
            if reduce is not None:
                out.append(_collective(module, instr, times, "reduce-scatter", reduce.attr("replica_groups")))
            continue
        kind = COLLECTIVES.get(instr.opcode)
        if kind is not None:
            c = _collective(module, instr, times, kind, instr.attr("replica_groups"))
            if c.kind == "permute":
                c = dataclasses.replace(c, explained=_overhang(module, instr))
            out.append(c)
    return out


def _overhang(module: Module, instr: Instruction) -> str:
    """Why a collective-permute is there when it moves the overhang of a padded reduce-scatter, else "".

    The TPU compiler may reduce-scatter a gradient padded to a tile multiple (4096 rows as 2 x 2080), then send
    the rows past each shard's end to the device that owns them (a slice of the reduce-scatter's result)."""
    table = module.table(instr.computation)
    name = instr.operands_text.split(",")[0].strip().lstrip("%")
    for _ in range(4):  # through slices, bitcasts and copies
        src = table.get(name)
        if src is None:
            return ""
        callee = (src.attr("calls") or "").lstrip("%")
        if src.opcode == "fusion" and callee.startswith("all-reduce-scatter"):
            return f"the overhang of the padded reduce-scatter {src.name}, sent to the device that owns it"
        if src.opcode not in ("slice", "bitcast", "copy", "get-tuple-element"):
            return ""
        name = src.operands_text.split(",")[0].strip().lstrip("%")
    return ""


def _async_pieces(module: Module) -> set[str]:
    """Computations that hold a piece of one of the TPU compiler's async collectives.

    libtpu splits an overlapped collective into a start fusion (``async-collective-start``), continuation fusions
    that run compute while it is in flight (``async_collective_fusion...``) and a done fusion
    (``async-collective-done``), each holding a copy of the collective with the same ``channel_id``: one operation,
    counted once."""
    out = {name for name in module.computations if name.startswith("async_collective_fusion")}
    for instrs in module.computations.values():
        for instr in instrs:
            if instr.opcode == "fusion" and instr.name.startswith(("async-collective-start", "async-collective-done")):
                out.update(c for c, _ in module.calls(instr))
    return out


def _collective(module: Module, instr, times: float, kind: str, replica_groups: str | None) -> CompiledCollective:
    ops = operand_shapes(module, instr)
    results = list(instr.result)
    if instr.opcode.endswith("-start") and len(results) > len(ops):
        results = results[len(ops) :]  # (operands..., outputs...) tuples of async starts
    groups = parse_replica_groups(replica_groups)
    pairs: list[tuple[int, int]] = []
    if kind == "collective-permute":
        pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", instr.attr("source_target_pairs") or "")]
    group = len(groups[0]) if groups and groups[0] else 0
    op_bytes = sum(s.bytes for s in ops)
    op_elems = sum(s.elements for s in ops)
    res_bytes = sum(s.bytes for s in results)
    res_elems = sum(s.elements for s in results)
    if kind == "all-gather":
        v, e = res_bytes, res_elems
    elif kind == "all-to-all":
        v, e = op_bytes * max(group, 1), op_elems * max(group, 1)
    else:
        v, e = op_bytes, op_elems
    dtype = (ops or results)[0].dtype if (ops or results) else "?"
    return CompiledCollective(
        name=instr.name,
        kind=from_hlo(kind),
        dtype=dtype,
        bytes=v,
        elements=e,
        group_size=group,
        groups=tuple(tuple(g) for g in (groups or [])),
        pairs=tuple(pairs),
        times=times,
        op_name=module.op_name(instr),
        source=module.source(instr),
    )
