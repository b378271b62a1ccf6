"""Where a parallel group sits on the fabric, for every estimate that prices a collective: one rule.

Training (:mod:`lab.predict.training.comm`), inference (:mod:`lab.predict.inference.estimate`), the Plan's programs
(:mod:`lab.predict.program.ops`) and the audit's expectations (:mod:`lab.report.ledger`) ask the same question (which
link does this group of chips use?) and get this answer: a group inside one fast domain (an NVLink node; a TPU pod,
taken as the slice) uses the fast links; a group that crosses the slow link (DCN, the scale-out network) is priced
in two levels, as NCCL runs it across nodes and XLA across slices: inside each domain on the fast links, and only a
domain's share of the bytes over the slow one, with ``members_per_node`` members in each domain.

Two forms ask it. The analytic estimators know a group by its size and stride over the chips (:func:`placement`);
a Plan's program knows it by its mesh axes, some of them declared slow (:func:`on_mesh`). Both answer in
:func:`lab.predict.collectives.collective_time`'s keywords.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lab.core.hardware import Chip

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def fast_domain(chip: Chip) -> int:
    """Chips on one fast fabric: a TPU pod's (ICI), a GPU node's (NVLink)."""
    return math.prod(chip.pod_shape or (1,)) if chip.topology == "torus" else (chip.node_size or 1)


def placement(chip: Chip, size: int, stride: int, cross_node: bool = False) -> dict[str, Any]:
    """Where a parallel group of ``size`` chips, ``stride`` apart, sits on the fabric (``cross_node``: it is known
    to cross the slow link, DCN or scale-out, with one member per node or slice).

    A group larger than one fast domain (an NVLink node; a TPU pod, taken as the slice) is priced in two levels,
    as NCCL runs it across nodes and XLA across slices: inside each domain on the fast links, and only a domain's
    share of the bytes over the slow one (``members_per_node`` members in each)."""
    if size <= 1:
        return {}
    domain = fast_domain(chip)
    if cross_node:
        return _across(1)
    if size * stride <= domain:
        return {"scope": "node"}
    per_domain = max(1, min(size, domain // stride)) if stride < domain else 1
    while size % per_domain:
        per_domain -= 1
    return _across(per_domain)


def on_mesh(axes: Sequence[str], mesh: dict[str, int], slow: Sequence[str] = ()) -> dict[str, Any]:
    """Where a collective over the mesh ``axes`` runs: inside a slice or node (no keywords: the default scope)
    unless one of its axes crosses the slow link (``slow``), and then across nodes with the members on its fast
    axes sharing one domain (a data-parallel axis over DCN has one member per slice)."""
    if not any(a in slow and mesh.get(a, 1) > 1 for a in axes):
        return {}
    return _across(math.prod(mesh.get(a, 1) for a in axes if a not in slow))


def _across(members_per_node: int) -> dict[str, Any]:
    """A group across the slow link, ``members_per_node`` of it inside each fast domain."""
    return {"scope": "cross-node", "members_per_node": members_per_node}


__all__ = ["fast_domain", "on_mesh", "placement"]
