"""What every account of one compiled program says first: which program, on which mesh, compiled where.

The audit, ``explain memory``, ``explain overlap`` and ``explain sharding`` each describe one compiled program. Their
results share four fields (``target``, ``mesh``, ``backend``, ``compiled_for``), declared once by
:class:`CompiledView` (keyword-only, so each result's own fields keep their order), and say them the same way: the
table's first line names the mesh and where the program was compiled ("TPU v5e:2x4, cross-compiled: nothing ran",
"cpu, emulated"), and the JSON begins with the same keys and ``emulated``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class CompiledView:
    """The base of the frozen dataclasses that describe one compiled program: its four fields, given by keyword."""

    target: str
    mesh: dict[str, int]
    backend: str
    compiled_for: str | None = None  # a TPU topology compiled for ahead of time (nothing ran), e.g. "v5e:2x4"

    @property
    def emulated(self) -> bool:
        """Compiled for the host's emulated devices: structure exact, timings against a host calibration."""
        return self.backend == "cpu" and not self.compiled_for

    @property
    def where(self) -> str:
        if self.compiled_for:
            return f"{self.backend.upper()} {self.compiled_for}, cross-compiled: nothing ran"
        return f"{self.backend}, emulated" if self.emulated else self.backend

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items())

    def view_dict(self) -> dict[str, Any]:
        """The JSON's first keys."""
        return {
            "target": self.target,
            "mesh": self.mesh,
            "backend": self.backend,
            "emulated": self.emulated,
            "compiled_for": self.compiled_for,
        }


__all__ = ["CompiledView"]
