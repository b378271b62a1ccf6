"""What an estimate of a Plan is made of: named ops (compute and collectives) and the collectives the
compiled-program audit expects of them; and the one way a kernel's collective op is priced.

:mod:`lab.predict.program.estimate` builds these for every program; :mod:`lab.predict.program.axis_programs` for
the kernels over named mesh axes (ring attention, the MoE MLP, the pipeline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lab.core.collective_kinds import KINDS
from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.predict.collectives import collective_time
from lab.predict.placement import on_mesh

COLLECTIVE_KINDS = KINDS  # lab.core.collective_kinds


@dataclass(frozen=True)
class ExpectedCollective:
    """A collective the estimate says the program runs: kind, mesh axes, bytes (V summed over calls)."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    dtype: str
    op: str
    steps: int = 1  # issued as this many equal collectives (a ring schedule)


@dataclass(frozen=True)
class OpEstimate:
    """One named op of the estimate, on one device, for one run of the program.

    Attributes:
        name: the kernels' named scope (compute ops) or what a collective carries.
        kind: ``matmul``, ``attention``, ``elementwise`` or a collective kind.
        time_s: seconds per run on the Plan's chip.
        flops, bytes: FLOPs; HBM bytes (compute ops) or V summed over calls (collectives).
        calls: executions per run.
        axes: mesh axes a collective spans.
        scope: the named scope it joins in the compiled program (None: any op of its kind not otherwise joined).
        hidden: what a collective overlaps with, when the estimate hides it.
    """

    name: str
    kind: str
    time_s: float
    flops: float = 0.0
    bytes: float = 0.0
    calls: float = 1.0
    axes: tuple[str, ...] = ()
    dtype: str = ""
    scope: str | None = None
    hidden: str | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes"] = list(self.axes)
        return d


@dataclass(frozen=True)
class ProgramEstimate:
    """The estimate of one Plan on one chip (see the module docstring)."""

    program: str
    hardware: str
    step_time_s: float
    ops: tuple[OpEstimate, ...]
    source: str
    flops: float
    memory: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        if not self.memory:
            return None
        return self.memory["total"] <= self.memory["hbm_bytes"]

    def collectives(self) -> list[ExpectedCollective]:
        """What the audit checks: every collective op over live mesh axes."""
        return [
            ExpectedCollective(o.kind, o.axes, o.bytes, o.dtype or "fp32", o.name, max(1, int(o.calls)))
            for o in self.ops
            if o.is_collective and o.axes and o.bytes > 0
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "hardware": self.hardware,
            "step_time_s": self.step_time_s,
            "source": self.source,
            "flops": self.flops,
            "memory": self.memory,
            "fits": self.fits,
            "notes": list(self.notes),
            "ops": [o.to_dict() for o in self.ops],
        }


# ----- the Transformer -------------------------------------------------------------------------------------------


def live(axes: tuple[str, ...], mesh: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.get(a, 1) > 1)


def collective_op(
    kind: str, axes: tuple[str, ...], v: float, dtype: str, chip: Chip, plan: Plan, name: str, steps: int = 1
) -> OpEstimate:
    mesh, where = plan.shape, on_mesh(axes, plan.shape, plan.slow_axes)  # a slow axis: priced across nodes
    one = collective_time(kind, v / steps, [mesh[a] for a in axes], chip, **where).time_s
    return OpEstimate(name, kind, steps * one, bytes=v, calls=steps, axes=axes, dtype=dtype)


__all__ = ["COLLECTIVE_KINDS", "ExpectedCollective", "OpEstimate", "ProgramEstimate", "collective_op", "live"]
