"""The scaling book's sharding notation, parsed and mapped to ``PartitionSpec``.

``A[I_X, J_Y]`` is a 2-D array whose dim I is sharded over mesh axis X and J over Y. Several axes on
one dim are written together, major first: ``I_XY`` (single-letter axes) or ``I_{data,fsdp}`` (any
names). ``{U_X}`` after the brackets marks partial sums not yet reduced over X. A matmul is two
operands joined by ``*`` (or ``@``, or the book's ``*_D`` naming the contracted dim), with an
optional ``-> C[...]`` asking for an output sharding::

    A[I_X, J] * B[J, K_Y]
    In[B_X, D_Y] *_D W[D_Y, F] -> Out[B_X, F]{U_Y}
    A[I, J_X] * B[J_X, K] -> C[I, K_X]

Parsing needs no JAX; :meth:`ShardedArray.to_partition_spec` imports it on demand.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.schema import parse_positive_int
from lab.core.units import dtype_bytes

EXAMPLE = "A[I_X,J] * B[J,K_Y]"


@dataclass(frozen=True)
class Dim:
    """One array dimension and the mesh axes it is sharded over (major first)."""

    name: str
    axes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name + _subscript(self.axes)


def _subscript(axes: tuple[str, ...]) -> str:
    if not axes:
        return ""
    if all(len(a) == 1 for a in axes):
        return "_" + "".join(axes)
    return "_{" + ",".join(axes) + "}"


@dataclass(frozen=True)
class ShardedArray:
    """An array in the book's notation: name, dims with their mesh axes, unreduced axes."""

    name: str
    dims: tuple[Dim, ...]
    unreduced: tuple[str, ...] = ()

    def __str__(self) -> str:
        body = f"{self.name}[{', '.join(str(d) for d in self.dims)}]"
        if self.unreduced:
            body += "{U" + _subscript(self.unreduced) + "}"
        return body

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def axes_of(self, dim: str) -> tuple[str, ...]:
        for d in self.dims:
            if d.name == dim:
                return d.axes
        raise KeyError(dim)

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis this array is sharded or unreduced over."""
        return tuple(a for d in self.dims for a in d.axes) + self.unreduced

    def spec_entries(self) -> tuple[str | tuple[str, ...] | None, ...]:
        """The ``PartitionSpec`` entries: None, one axis name, or a tuple of axis names per dim."""
        return tuple(None if not d.axes else (d.axes[0] if len(d.axes) == 1 else d.axes) for d in self.dims)

    def to_partition_spec(self):
        """``jax.sharding.PartitionSpec`` for this array (unreduced axes included where JAX supports them)."""
        from jax.sharding import PartitionSpec

        if self.unreduced:
            return PartitionSpec(*self.spec_entries(), unreduced=set(self.unreduced))
        return PartitionSpec(*self.spec_entries())

    def check(self, mesh: Mapping[str, int], sizes: Mapping[str, int] | None = None) -> None:
        """Axes exist in the mesh; sizes, if given, cover every dim and divide by their axes."""
        for a in self.mesh_axes():
            if a not in mesh:
                raise UserError(f"{self}: mesh axis {a!r} is not in the mesh ({_fmt_mesh(mesh)})")
        if sizes is None:
            return
        for d in self.dims:
            if d.name not in sizes:
                raise UserError(f"{self}: no size for dim {d.name!r}; add {d.name}=<n> to --sizes")
            shards = math.prod(mesh[a] for a in d.axes)
            if sizes[d.name] % shards:
                raise UserError(
                    f"{self}: dim {d.name}={sizes[d.name]} does not divide over "
                    f"{'x'.join(d.axes)} ({shards} shards); use a multiple of {shards}"
                )

    def local_shape(self, mesh: Mapping[str, int], sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Per-device shape: each dim divided by the product of its mesh axes."""
        self.check(mesh, sizes)
        return tuple(sizes[d.name] // math.prod(mesh[a] for a in d.axes) for d in self.dims)

    def local_bytes(self, mesh: Mapping[str, int], sizes: Mapping[str, int], dtype: str) -> float:
        return math.prod(self.local_shape(mesh, sizes)) * dtype_bytes(dtype)

    def with_axes(
        self,
        axes_by_dim: Mapping[str, tuple[str, ...]],
        unreduced: tuple[str, ...] | None = None,
        name: str | None = None,
    ) -> ShardedArray:
        """A copy with some dims' axes (and optionally unreduced axes, name) replaced."""
        dims = tuple(Dim(d.name, tuple(axes_by_dim.get(d.name, d.axes))) for d in self.dims)
        return ShardedArray(name or self.name, dims, self.unreduced if unreduced is None else tuple(unreduced))


@dataclass(frozen=True)
class MatmulExpr:
    """Two operands, the contraction the user named (if any) and the requested output (if any)."""

    lhs: ShardedArray
    rhs: ShardedArray
    out: ShardedArray | None = None
    contract: tuple[str, ...] | None = None

    def __str__(self) -> str:
        op = " * " if not self.contract else f" *_{''.join(self.contract)} "
        text = f"{self.lhs}{op}{self.rhs}"
        return text + (f" -> {self.out}" if self.out else "")


# ----- parser --------------------------------------------------------------------------------

AXIS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")  # a mesh axis or dimension name: ASCII letters and digits


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.i = 0

    def fail(self, what: str) -> UserError:
        found = repr(self.text[self.i]) if self.i < len(self.text) else "end of input"
        return UserError(
            f"bad notation {self.text!r} at column {self.i + 1}: expected {what}, found {found} (example: {EXAMPLE})"
        )

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def peek(self, s: str) -> bool:
        self.ws()
        return self.text.startswith(s, self.i)

    def take(self, s: str, what: str | None = None) -> None:
        if not self.peek(s):
            raise self.fail(what or repr(s))
        self.i += len(s)

    def name(self, what: str) -> str:
        self.ws()
        m = AXIS_NAME.match(self.text, self.i)
        if not m:
            raise self.fail(what)
        self.i = m.end()
        return m.group(0)

    def axes(self) -> tuple[str, ...]:
        """After '_': ``XY`` (one letter per axis) or ``{name, name}``."""
        if self.text.startswith("{", self.i):
            self.i += 1
            out = [self.name("a mesh axis name")]
            while self.peek(","):
                self.i += 1
                out.append(self.name("a mesh axis name"))
            self.take("}", "'}' closing the axis list")
            return tuple(out)
        m = AXIS_NAME.match(self.text, self.i)
        if not m:
            raise self.fail("mesh axes after '_' (e.g. I_X, I_XY or I_{data,fsdp})")
        self.i = m.end()
        return tuple(m.group(0))

    def array(self) -> ShardedArray:
        start = self.i
        name = self.name("an array name such as A")
        self.take("[", "'[' after the array name")
        dims: list[Dim] = []
        if self.peek("]"):
            raise self.fail("at least one dim inside [ ]")
        while True:
            dname = self.name("a dim name such as I")
            axes: tuple[str, ...] = ()
            if self.text.startswith("_", self.i):
                self.i += 1
                axes = self.axes()
            dims.append(Dim(dname, axes))
            if self.peek(","):
                self.i += 1
                continue
            self.take("]", "',' or ']'")
            break
        unreduced: tuple[str, ...] = ()
        if self.peek("{"):
            self.i += 1
            self.ws()
            if not self.text.startswith("U_", self.i):
                raise self.fail("'U_' (unreduced axes, e.g. {U_X})")
            self.i += 2
            unreduced = self.axes()
            self.take("}", "'}' closing {U_...}")
        arr = ShardedArray(name, tuple(dims), unreduced)
        _check_array(arr, self.text, start)
        return arr


def _check_array(arr: ShardedArray, text: str, col: int) -> None:
    where = f"in {text!r} at column {col + 1}"
    seen_dims: set[str] = set()
    for d in arr.dims:
        if d.name in seen_dims:
            raise UserError(f"{arr}: dim {d.name!r} appears twice {where}; name each dim once")
        seen_dims.add(d.name)
    seen: set[str] = set()
    for a in arr.mesh_axes():
        if a in seen:
            raise UserError(
                f"{arr}: mesh axis {a!r} is used twice {where}; an axis may shard an array "
                f"only once (the book forbids A[I_X, J_X])"
            )
        seen.add(a)


def parse_array(text: str) -> ShardedArray:
    """Parse one array, e.g. ``A[I_X, J]{U_Y}``."""
    p = _Parser(str(text))
    arr = p.array()
    p.ws()
    if p.i != len(p.text):
        raise p.fail("end of input")
    return arr


def parse_matmul(text: str) -> MatmulExpr:
    """Parse ``LHS * RHS [-> OUT]`` (``@`` and ``*_D`` also accepted for the product)."""
    p = _Parser(str(text))
    lhs = p.array()
    contract = None
    p.ws()
    if p.peek("*") or p.peek("@") or p.peek("·") or p.peek("x "):
        p.i += 1
        if p.text.startswith("_", p.i):
            p.i += 1
            contract = p.axes()
    else:
        raise p.fail("'*' between the two operands")
    rhs = p.array()
    out = None
    if p.peek("->"):
        p.i += 2
        out = p.array()
    p.ws()
    if p.i != len(p.text):
        raise p.fail("end of input (or '-> OUT[...]')")
    if lhs.unreduced or rhs.unreduced:
        raise UserError(f"{text!r}: matmul inputs must be reduced; AllReduce {lhs if lhs.unreduced else rhs} first")
    return MatmulExpr(lhs, rhs, out, contract)


def _fmt_mesh(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) or "empty"


def parse_assignments(text: str, what: str, example: str, name: re.Pattern = AXIS_NAME) -> dict[str, int]:
    """``"X=2,Y=4"`` -> ``{"X": 2, "Y": 4}`` with positive-integer checks (``8k``, ``1M``, ``1e6`` ok); each key
    must match ``name``."""
    out: dict[str, int] = {}
    if not str(text).strip():
        raise UserError(f"{what} is empty; example: {example}")
    for part in str(text).split(","):
        part = part.strip()
        if "=" not in part:
            raise UserError(f"{what}: {part!r} is not NAME=VALUE; example: {example}")
        key, val = (s.strip() for s in part.split("=", 1))
        if not name.fullmatch(key):
            raise UserError(f"{what}: {key!r} is not a valid name; example: {example}")
        if key in out:
            raise UserError(f"{what}: {key!r} is given twice; example: {example}")
        out[key] = parse_positive_int(val, f"{what} {key}")
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``"X=2,Y=4"`` -> ordered mapping of mesh axis sizes."""
    return parse_assignments(text, "--mesh", "X=2,Y=4")


SIZE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")  # an experiment's size: a dimension, or a word like prompt_len


def parse_sizes(text: str, example: str = "I=1024,J=8192,K=4096") -> dict[str, int]:
    """``"I=1024,J=8k,K=4096"`` -> dim sizes (an experiment's sizes may have underscores: ``prompt_len=64``)."""
    return parse_assignments(text, "--sizes", example, SIZE_NAME)
