"""Where a parallel group sits on the fabric, for every estimate that prices a collective: one rule.

Training (:mod:`lab.predict.training_comm`), inference (:mod:`lab.predict.inference`), the Plan's programs and the
audit's expectations ask the same question (which link does this group of chips use?) and get this answer: a group
inside one fast domain (an NVLink node; a TPU pod, taken as the slice) uses the fast links; a larger one is priced in
two levels, as NCCL runs it across nodes and XLA across slices.
"""

from __future__ import annotations

import math

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
        return {"scope": "cross-node", "members_per_node": 1}
    if size * stride <= domain:
        return {"scope": "node"}
    per_domain = max(1, min(size, domain // stride)) if stride < domain else 1
    while size % per_domain:
        per_domain -= 1
    return {"scope": "cross-node", "members_per_node": per_domain}


__all__ = ["fast_domain", "placement"]
