"""The sharded-matmul engine: which collectives a sharded matmul needs, their bytes and time.

It applies the scaling book's four cases (sharding.md) to any two operands in the book's notation:

1. No contracting dim is sharded: multiply locally; the output keeps the inputs' shardings.
2. A contracting dim is sharded in one operand only (or along different axes): **AllGather** that
   operand over the extra axes first, the book's rule. (Where both operands share a leading run of
   axes, only the rest is gathered and case 3 applies to the shared run.)
3. Both operands shard a contracting dim along the same axes: the local product is unreduced,
   ``C{U_X}``, then **AllReduce_X**, or **ReduceScatter_X** onto an output dim when the requested
   output (``-> C[I, K_X]``) asks for it, or nothing when it asks for ``{U_X}``.
4. A non-contracting dim of each operand on the same mesh axis is invalid: AllGather one operand
   (the one with fewer bytes to move) over that axis first.

Batch dims (named in both operands and in the output) must match; extra axes are gathered as in
case 2. After the multiply the output is moved to the requested sharding: an axis on a different
dim is an **AllToAll**, an axis the output drops is an **AllGather**, and an axis the output adds is a
local slice with no communication.

Time is the roofline of the local matmul (``max(compute, HBM)`` on post-gather shapes) plus the sum of
the collectives (no overlap: ``time_s``); ``overlapped_time_s`` is the ideal ``max`` of the two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.notation import Dim, MatmulExpr, ShardedArray, parse_matmul
from lab.predict.collectives import CollectiveCost, collective_time
from lab.predict.roofline import RooflineCost, roofline

_CAMEL = {
    "all-gather": "AllGather",
    "reduce-scatter": "ReduceScatter",
    "all-reduce": "AllReduce",
    "all-to-all": "AllToAll",
    "permute": "Permute",
}


@dataclass(frozen=True)
class PlannedCollective:
    """One collective the matmul needs.

    Attributes:
        kind: collective kind (``all-gather`` ...).
        axes: mesh axes it spans.
        operand: ``lhs``, ``rhs`` or ``out``.
        dim: the array dim it gathers, scatters or exchanges (None for AllReduce).
        bytes: V, the operand per device in its unsharded-over-these-axes form.
        before, after: the operand's notation before and after.
        cost: the priced collective.
    """

    kind: str
    axes: tuple[str, ...]
    operand: str
    dim: str | None
    bytes: float
    before: str
    after: str
    cost: CollectiveCost

    @property
    def time_s(self) -> float:
        return self.cost.time_s

    def describe(self) -> str:
        sub = "".join(self.axes) if all(len(a) == 1 for a in self.axes) else "{" + ",".join(self.axes) + "}"
        return f"{_CAMEL[self.kind]}_{sub} {self.before} -> {self.after}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "operand": self.operand,
            "dim": self.dim,
            "bytes": self.bytes,
            "time_s": self.cost.time_s,
            "latency_bound": self.cost.latency_bound,
            "link": self.cost.link,
            "description": self.describe(),
        }


@dataclass(frozen=True)
class ShardedMatmulPlan:
    """Result of :func:`plan_sharded_matmul`."""

    expression: str
    hardware: str
    mesh: Mapping[str, int]
    sizes: Mapping[str, int]
    dtype: str
    cases: tuple[int, ...]
    lhs_local: str
    rhs_local: str
    output: str
    collectives: tuple[PlannedCollective, ...]
    local: RooflineCost
    notes: tuple[str, ...]

    @property
    def compute_s(self) -> float:
        return self.local.time_s

    @property
    def comm_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlapped_time_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "expression": self.expression,
            "hardware": self.hardware,
            "mesh": dict(self.mesh),
            "sizes": dict(self.sizes),
            "dtype": self.dtype,
            "cases": list(self.cases),
            "output": self.output,
            "lhs_after_comm": self.lhs_local,
            "rhs_after_comm": self.rhs_local,
            "collectives": [c.to_dict() for c in self.collectives],
            "flops_per_device": self.local.flops,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "time_s": self.time_s,
            "overlapped_time_s": self.overlapped_time_s,
            "bound": "comm" if self.comm_s > self.compute_s else self.local.bound,
            "notes": list(self.notes),
        }


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class _Planner:
    def __init__(
        self,
        expr: MatmulExpr,
        sizes: Mapping[str, int],
        mesh: Mapping[str, int],
        chip: Chip,
        dtype: str,
        wraparound: bool,
        scope: str,
    ):
        self.expr, self.sizes, self.mesh, self.chip = expr, dict(sizes), dict(mesh), chip
        self.dtype, self.wraparound, self.scope = dtype, wraparound, scope
        self.collectives: list[PlannedCollective] = []
        self.notes: list[str] = []

    def bytes_unsharded_over(self, arr: ShardedArray, axes: tuple[str, ...]) -> float:
        """Per-device bytes of ``arr`` if it were not sharded over ``axes`` (the collective's V)."""
        return arr.local_bytes(self.mesh, self.sizes, self.dtype) * math.prod(
            self.mesh[a] for a in axes if a in arr.mesh_axes() and a not in arr.unreduced
        )

    def emit(
        self, kind: str, operand: str, before: ShardedArray, after: ShardedArray, axes: tuple[str, ...], dim: str | None
    ) -> None:
        if kind in ("all-reduce", "reduce-scatter"):
            v = before.local_bytes(self.mesh, self.sizes, self.dtype)  # the unreduced array as held
        elif kind == "all-gather":
            v = after.local_bytes(self.mesh, self.sizes, self.dtype)  # the gathered array
        elif kind == "all-to-all":  # the array whole over the axes: the local shard times their size
            v = before.local_bytes(self.mesh, self.sizes, self.dtype) * math.prod(self.mesh[a] for a in axes)
        else:  # permute: the shard each device sends
            v = before.local_bytes(self.mesh, self.sizes, self.dtype)
        cost = collective_time(
            kind, v, [self.mesh[a] for a in axes], self.chip, wraparound=self.wraparound, scope=self.scope
        )
        self.collectives.append(PlannedCollective(kind, axes, operand, dim, v, str(before), str(after), cost))

    def gather(self, operand: str, arr: ShardedArray, dim: str, keep: tuple[str, ...]) -> ShardedArray:
        """AllGather ``arr`` along ``dim`` down to the axes ``keep``."""
        extra = tuple(a for a in arr.axes_of(dim) if a not in keep)
        if not extra:
            return arr
        after = arr.with_axes({dim: keep})
        self.emit("all-gather", operand, arr, after, extra, dim)
        return after

    def dims(self) -> tuple[list[str], list[str], list[str]]:
        """The operands' shared dims, and which of them are contracted and which are batch dims (kept in the
        output); an expression whose dims do not make a matmul is refused here, naming the dim."""
        e = self.expr
        lhs, rhs = e.lhs, e.rhs
        for arr in (lhs, rhs) + ((e.out,) if e.out else ()):
            arr.check(self.mesh, self.sizes)
        ldims, rdims = set(lhs.dim_names), set(rhs.dim_names)
        shared = [d for d in lhs.dim_names if d in rdims]
        if e.out is not None:
            odims = set(e.out.dim_names)
            for d in e.out.dim_names:
                if d not in ldims | rdims:
                    raise UserError(f"{e}: output dim {d!r} is in neither operand")
            for d in ldims ^ rdims:
                if d not in odims:
                    raise UserError(
                        f"{e}: dim {d!r} appears in one operand only and not in the output; "
                        f"a matmul contracts dims shared by both operands"
                    )
            contracting = [d for d in shared if d not in odims]
            batch = [d for d in shared if d in odims]
        else:
            contracting, batch = shared, []
        if e.contract is not None and set(e.contract) != set(contracting):
            raise UserError(
                f"{e}: *_{''.join(e.contract)} names the contraction, but the operands share "
                f"{', '.join(contracting) or 'no dim'}"
            )
        if not contracting:
            raise UserError(
                f"{e}: the operands share no dim to contract; name the contracting dim the same "
                f"in both, e.g. {_example_fix(lhs, rhs)}"
            )
        return shared, contracting, batch

    def run(self) -> ShardedMatmulPlan:
        e = self.expr
        lhs, rhs = e.lhs, e.rhs
        shared, contracting, batch = self.dims()

        cases: set[int] = set()
        # Cases 2 and 3: contracting (and batch) dims must be sharded alike; gather what differs.
        reduce_axes: list[str] = []
        for d in contracting + batch:
            la, ra = lhs.axes_of(d), rhs.axes_of(d)
            common = _common_prefix(la, ra)
            if la != common or ra != common:
                if d in contracting:
                    cases.add(2)
                lhs = self.gather("lhs", lhs, d, common)
                rhs = self.gather("rhs", rhs, d, common)
            if d in contracting and common:
                cases.add(3)
                reduce_axes.extend(common)
        # Case 4: the same axis on a free dim of each operand.
        lfree = [d for d in lhs.dim_names if d not in shared]
        rfree = [d for d in rhs.dim_names if d not in shared]
        for d_l in lfree:
            for a in lhs.axes_of(d_l):
                for d_r in rfree:
                    if a in rhs.axes_of(d_r):
                        cases.add(4)
                        lb = self.bytes_unsharded_over(lhs, (a,))
                        rb = self.bytes_unsharded_over(rhs, (a,))
                        if lb <= rb:
                            lhs = self.gather("lhs", lhs, d_l, tuple(x for x in lhs.axes_of(d_l) if x != a))
                        else:
                            rhs = self.gather("rhs", rhs, d_r, tuple(x for x in rhs.axes_of(d_r) if x != a))
        if not cases:
            cases.add(1)

        # The local product.
        out_dims = [d for d in lhs.dim_names if d in batch] + lfree + rfree
        axes_of = {d.name: d.axes for d in lhs.dims} | {d.name: d.axes for d in rhs.dims if d.name not in batch}
        name = e.out.name if e.out else "C"
        order = e.out.dim_names if e.out else tuple(out_dims)
        local_out = ShardedArray(name, tuple(Dim(d, axes_of[d]) for d in order), tuple(reduce_axes))
        ls = dict(zip(lhs.dim_names, lhs.local_shape(self.mesh, self.sizes), strict=True))
        rs = dict(zip(rhs.dim_names, rhs.local_shape(self.mesh, self.sizes), strict=True))
        flops = 2.0 * math.prod({**ls, **rs}.values())
        nbytes = (
            lhs.local_bytes(self.mesh, self.sizes, self.dtype)
            + rhs.local_bytes(self.mesh, self.sizes, self.dtype)
            + local_out.local_bytes(self.mesh, self.sizes, self.dtype)
        )
        local = roofline(self.chip, flops, nbytes, self.dtype, op=f"local {lhs} * {rhs}")

        final = self.resolve_output(local_out, e.out)
        return ShardedMatmulPlan(
            expression=str(e),
            hardware=self.chip.name,
            mesh=self.mesh,
            sizes=self.sizes,
            dtype=self.dtype,
            cases=tuple(sorted(cases)),
            lhs_local=str(lhs),
            rhs_local=str(rhs),
            output=str(final),
            collectives=tuple(self.collectives),
            local=local,
            notes=tuple(self.notes),
        )

    def resolve_output(self, cur: ShardedArray, want: ShardedArray | None) -> ShardedArray:
        """Move the local product ``cur`` to the requested sharding ``want`` (default: AllReduce partials)."""
        if want is None:
            if cur.unreduced:
                after = cur.with_axes({}, unreduced=())
                self.emit("all-reduce", "out", cur, after, cur.unreduced, None)
                cur = after
            return cur
        target = {d.name: d.axes for d in want.dims}
        where_want = {a: d for d, axes in target.items() for a in axes}
        # 1. Partial sums: scatter onto the requested dim, keep if asked, else AllReduce.
        for a in cur.unreduced:
            if a in want.unreduced:
                continue
            rest = tuple(x for x in cur.unreduced if x != a)
            if a in where_want:
                d = where_want[a]
                new_axes = tuple(x for x in target[d] if x in cur.axes_of(d) or x == a)
                after = cur.with_axes({d: new_axes}, unreduced=rest)
                self.emit("reduce-scatter", "out", cur, after, (a,), d)
            else:
                after = cur.with_axes({}, unreduced=rest)
                self.emit("all-reduce", "out", cur, after, (a,), None)
            cur = after
        for a in want.unreduced:
            if a not in cur.unreduced:
                raise UserError(
                    f"output {want} asks for partial sums over {a!r}, but the product is already "
                    f"reduced over it; drop {{U_{a}}}"
                )
        # 2. Axes that change dims (AllToAll) or leave the output (AllGather).
        for d in cur.dim_names:
            for a in cur.axes_of(d):
                if a in where_want and where_want[a] != d:
                    d2 = where_want[a]
                    after = cur.with_axes(
                        {
                            d: tuple(x for x in cur.axes_of(d) if x != a),
                            d2: tuple(x for x in target[d2] if x in cur.axes_of(d2) or x == a),
                        }
                    )
                    self.emit("all-to-all", "out", cur, after, (a,), d)
                    cur = after
        for d in cur.dim_names:
            drop = tuple(a for a in cur.axes_of(d) if a not in target[d])
            if drop:
                after = cur.with_axes({d: tuple(a for a in cur.axes_of(d) if a in target[d])})
                self.emit("all-gather", "out", cur, after, drop, d)
                cur = after
        # 3. Same axes, other order: whole shards change owners, one collective permute.
        for d in cur.dim_names:
            if set(cur.axes_of(d)) == set(target[d]) and cur.axes_of(d) != target[d]:
                after = cur.with_axes({d: target[d]})
                self.emit("permute", "out", cur, after, target[d], d)
                cur = after
        # 4. Axes the output adds: a local slice, free.
        for d in cur.dim_names:
            if cur.axes_of(d) != target[d]:
                self.notes.append(f"{d}: slice locally to {'x'.join(target[d])} (no communication)")
                cur = cur.with_axes({d: target[d]})
        return cur


def _example_fix(lhs: ShardedArray, rhs: ShardedArray) -> str:
    last = lhs.dims[-1].name
    return f"{lhs} * {rhs.name}[{last}, ...]"


def plan_sharded_matmul(
    expression: str | MatmulExpr,
    sizes: Mapping[str, int],
    mesh: Mapping[str, int],
    chip: Chip,
    dtype: str = "bf16",
    *,
    wraparound: bool = True,
    scope: str = "node",
) -> ShardedMatmulPlan:
    """Name the collectives a sharded matmul needs, with bytes and time, and its output sharding.

    Args:
        expression: the book's notation, e.g. ``"A[I_X, J] * B[J, K_Y]"`` (see :mod:`lab.core.notation`).
        sizes: global size of every dim, e.g. ``{"I": 1024, "J": 8192, "K": 4096}``.
        mesh: mesh axis sizes, e.g. ``{"X": 2, "Y": 4}``; each mesh axis is one ICI axis on a TPU.
        chip: the hardware.
        dtype: element dtype of both operands and the output.
        wraparound: whether the torus axes are closed rings.
        scope: ``node`` or ``cross-node`` (see :func:`lab.predict.collectives.collective_time`).
    """
    expr = parse_matmul(expression) if isinstance(expression, str) else expression
    return _Planner(expr, sizes, mesh, chip, dtype, wraparound, scope).run()


__all__ = ["PlannedCollective", "ShardedMatmulPlan", "plan_sharded_matmul"]
