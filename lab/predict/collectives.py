"""Collective cost model: AllGather, ReduceScatter, AllReduce, AllToAll and permute.

**What the byte count means.** ``nbytes`` (``V``) is the size of the array *each device holds in
its unsharded-over-these-axes form*:

* AllGather: the gathered output ``[A, B]`` of ``AllGather_X [A_X, B]`` (each device starts with V/N);
* ReduceScatter: the unreduced input ``[A, B]{U_X}`` (each device ends with V/N);
* AllReduce: the array being summed (input and output are V on every device);
* AllToAll: the array ``[A, B]`` of ``[A, B_X] -> [A_X, B]`` whole over the axis (each device holds V/N
  before and after, and sends ``(N-1)/N`` of it);
* permute: the buffer each device sends to its neighbour.

If the array is also sharded over other mesh axes, V is already divided by them (the book's
``V/Y`` for gathering over X while sharded over Y).

**TPU torus (ICI)**, after the scaling book (sharding.md). A bidirectional ring of N chips moves
V/N per hop in each direction over ``floor(N/2)`` hops, so AllGather takes ``V / W_bidi`` for even
N, independent of N. Without a wraparound link the edge shard crosses ``N-1`` hops at the one-way
link bandwidth: ``(N-1) * (V/N) / W_link`` (about twice as long). Each hop costs at least the ICI
latency ``T_min`` (about 1 us), so ``T = max(hops * T_min, bandwidth time)`` and a collective is
latency-bound once a shard is under ``W_link * T_min`` (45 kB on v5e). On several mesh axes the
traffic spreads over every axis' links (``V / (W_bidi * n_axes)``) while the latency adds up along
the longest path. AllToAll is priced by its bisection: ``V/4`` bytes cross the middle of a ring in
each direction, ``V / (4 W_bidi)`` with wraparound (a quarter of an AllGather), and
``V * max(axis) / (4 N W_bidi)`` on a multi-axis torus.

**Switched fabrics (GPU NVLink, CPU threads)**, after gpus.md. Inside one switch domain a ring
AllGather costs ``V (N-1) / (N W_link)``; AllToAll ``V (N-1) / (N^2 W_link)``. Across nodes the
hierarchical form ``V * max((D-1)/(D W_link), (M-1)/(M W_node))`` applies (D GPUs per node in the
group, M nodes, ``W_node = D * scaleout_bandwidth``). A GPU collective adds NCCL's fixed launch cost.
TPU ``cross-node`` means across slices over DCN, priced per chip like a switch with one chip per node.
On a **mesh** (AMD Infinity Fabric: one direct link between each pair of a node's GPUs) the collective libraries
run rings over every link at once, so a member of a D-chip group sends over its D-1 links to the others:
``W_link`` is D-1 times one link's rate (an 8-GPU all-reduce reaches 70% of 7 links, a 2-GPU one 75% of one:
microbenchmarks-added.md X3), and a point-to-point send has one link.

AllReduce is ReduceScatter followed by AllGather, in every case (no in-network reduction).
"""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass

from lab.core.collective_kinds import KINDS as KINDS  # re-exported: the cost model names its kinds
from lab.core.collective_kinds import SCOPES, canonical_kind
from lab.core.errors import UserError
from lab.core.hardware import Chip, scaleout_step_latency

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class CollectiveCost:
    """Predicted cost of one collective.

    Attributes:
        kind: one of :data:`KINDS`.
        hardware: chip name.
        bytes: V as defined in the module docstring.
        axis_sizes: sizes of the mesh axes it spans.
        wraparound: per axis, whether the torus axis is a closed ring (always False off a torus).
        scope: ``node`` (one ICI slice or NVLink domain) or ``cross-node`` (DCN / scale-out network).
        link: the fabric priced (``ici``, ``nvlink``, ``nvlink+network``, ``network``, ``dcn``, ``host``).
        hops: sequential steps, each paying the per-hop latency.
        bandwidth_s: time if latency were zero.
        latency_s: fixed costs: hops times per-hop latency, plus launch latency.
        time_s: ``launch + max(hops * hop_latency, bandwidth_s)``.
        latency_bound: True when the per-hop latency term is the larger of the two.
        formula: the expression used, in the book's notation.
    """

    kind: str
    hardware: str
    bytes: float
    axis_sizes: tuple[int, ...]
    wraparound: tuple[bool, ...]
    scope: str
    link: str
    hops: int
    bandwidth_s: float
    latency_s: float
    time_s: float
    latency_bound: bool
    formula: str

    @property
    def group_size(self) -> int:
        return math.prod(self.axis_sizes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axis_sizes"] = list(self.axis_sizes)
        d["wraparound"] = list(self.wraparound)
        d["group_size"] = self.group_size
        return d


# One collective's cost, term by term: hops, the bandwidth term, per-hop and launch latency, the link and the formula
# (a plain named tuple: a search builds thousands, a frozen dataclass takes three times as long to build, and typing
# is not imported at run time).
_Parts = namedtuple("_Parts", "hops bandwidth_s hop_latency_s launch_s link formula")


def _torus(kind: str, v: float, sizes: Sequence[int], wraps: Sequence[bool], chip: Chip) -> _Parts:
    w = chip.link_bandwidth  # one-way, per link
    active = [(n, wr) for n, wr in zip(sizes, wraps, strict=True) if n > 1]
    k = len(active)
    hops_ring = sum(n // 2 if wr else n - 1 for n, wr in active)
    if kind in ("all-gather", "reduce-scatter"):
        # Each axis carries V/k; a ring axis moves V/(kN) per hop each way over floor(N/2) hops,
        # a line moves it one way over N-1 hops.
        per_axis = [((n // 2) if wr else (n - 1)) * (v / k / n) / w for n, wr in active]
        if all(wr for _, wr in active):
            formula = "floor(N/2) hops of V/(k*N) each way: V/(W_bidi*k) for k axes"
        elif not any(wr for _, wr in active):
            formula = "no wraparound: N-1 hops of V/(k*N) one way at W_link, k axes"
        else:
            formula = "slowest of the ring and line axes, V/k on each of k axes"
        return _Parts(hops_ring, max(per_axis), chip.hop_latency_s, 0.0, "ici", formula)
    if kind == "all-to-all":
        total = math.prod(n for n, _ in active)
        per_axis = []
        for n, wr in active:
            crossing = v * (n // 2) * ((n + 1) // 2) / n**2  # bytes over the bisection, one direction
            links = (total // n) * (2 if wr else 1)
            per_axis.append(crossing / (links * w))
        return _Parts(
            hops_ring,
            max(per_axis),
            chip.hop_latency_s,
            0.0,
            "ici",
            "bisection: V*max(axis)/(4*N*W_bidi) with wraparound",
        )
    # permute: a one-step cyclic shift; without wraparound the wrap-around message shares each link
    # with one neighbour message and travels N-1 hops.
    if all(wr for _, wr in active):
        return _Parts(1, v / w, chip.hop_latency_s, 0.0, "ici", "V/W_link (neighbour shift)")
    n = math.prod(s for s, _ in active)
    return _Parts(n - 1, 2 * v / w, chip.hop_latency_s, 0.0, "ici", "2V/W_link, N-1 hops (no wraparound)")


def _switched(kind: str, v: float, g: int, chip: Chip, scope: str, per_node: int | None = None) -> _Parts:
    """Ring and direct algorithms on a switch: D chips per node in the group, M nodes."""
    launch = chip.launch_latency_s
    if per_node is not None and scope == "cross-node":
        if per_node < 1 or g % per_node:
            raise UserError(f"members_per_node={per_node} does not divide a group of {g}")
        d, m = per_node, g // per_node
    elif scope == "node":
        if g > chip.node_size:
            where = "host" if chip.kind == "cpu" else ("NVLink node" if chip.topology == "switch" else "node")
            raise UserError(
                f"a group of {g} {chip.name} chips does not fit in one {chip.node_size}-chip {where}; "
                "use --scope cross-node"
            )
        d, m = g, 1
    elif chip.topology == "torus" or g <= chip.node_size:
        d, m = 1, g  # one chip per node (or per TPU slice, over DCN)
    else:
        if g % chip.node_size:
            raise UserError(
                f"a cross-node group of {g} {chip.name} GPUs is not a whole number of "
                f"{chip.node_size}-GPU nodes; use a multiple of {chip.node_size}"
            )
        d, m = chip.node_size, g // chip.node_size
    w_link = chip.group_egress(d)  # a mesh's d - 1 links to the node's other members; a switch's egress
    w_node = d * chip.scaleout_bandwidth
    if chip.kind == "cpu":
        link = "host"
    elif chip.topology == "torus":
        link = "dcn"
    else:
        fast = "nvlink" if chip.topology == "switch" else "xgmi"
        link = fast if m == 1 else ("network" if d == 1 else f"{fast}+network")
    # Per step latency: NVLink steps inside a node, network steps across nodes.
    lat_in, lat_out = chip.hop_latency_s, scaleout_step_latency(chip)
    if kind in ("all-gather", "reduce-scatter"):
        bw = v * max((d - 1) / (d * w_link), (m - 1) / (m * w_node))
        hops_lat = (d - 1) * lat_in + (m - 1) * lat_out
        hops = (d - 1) + (m - 1)
        formula = "V*max((D-1)/(D*W_link), (M-1)/(M*W_node))"
    elif kind == "all-to-all":
        bw = max(v * (d - 1) / (d * g) / w_link, v * (m - 1) / m**2 / w_node)
        hops = 1 if g > 1 else 0
        hops_lat = hops * (lat_out if m > 1 else lat_in)
        formula = "max(V(D-1)/(D*N*W_link), V(M-1)/(M^2*W_node))"
    else:  # permute: one send, over one link (a mesh's to its one peer)
        bw = v / (chip.link_bandwidth if m == 1 else chip.scaleout_bandwidth)
        hops = 1 if g > 1 else 0
        hops_lat = hops * (lat_out if m > 1 else lat_in)
        formula = "V/W (one send per device)"
    per_hop = hops_lat / hops if hops else 0.0
    return _Parts(hops, bw, per_hop, launch, link, formula)


def _calibrated_factor(chip: Chip, kind: str, group: int) -> float | None:
    """What a calibrated host measured for this kind's bandwidth term (shardlab calibrate): for this group
    size when it measured one, else for the whole mesh; None on uncalibrated chips."""
    cal = chip.calibration
    if not cal:
        return None
    factor = (cal.get("collective_factor_by_group", {}).get(kind) or {}).get(str(group))
    factor = factor or cal.get("collective_factor", {}).get(kind)
    return float(factor) if factor else None


def _axis_sizes(axis_sizes: int | Sequence[int]) -> tuple[int, ...]:
    """The sizes of the axes a collective spans, as ints; a :class:`UserError` for none or a non-positive one."""
    sizes = (axis_sizes,) if isinstance(axis_sizes, int) else tuple(axis_sizes)
    if not sizes:
        raise UserError("--axis-size needs at least one axis size, e.g. 4 or 4,2")
    for s in sizes:
        if int(s) != s or s < 1:
            raise UserError(f"axis size {s!r} must be a positive integer")
    return tuple(int(s) for s in sizes)


def _wraparound(wraparound: bool | Sequence[bool], sizes: tuple[int, ...], chip: Chip) -> tuple[bool, ...]:
    """Per axis, whether it is a closed ring: one bool applies to every axis; off a torus, never."""
    if isinstance(wraparound, bool):
        wraps = tuple(wraparound for _ in sizes)
    else:
        wraps = tuple(bool(x) for x in wraparound)
        if len(wraps) != len(sizes):
            raise UserError(f"wraparound has {len(wraps)} entries for {len(sizes)} axes")
    if chip.topology != "torus":
        wraps = tuple(False for _ in sizes)
    return wraps


def _composed_all_reduce(
    v: float, sizes: tuple[int, ...], wraps: tuple[bool, ...], chip: Chip, scope: str, members_per_node: int | None
) -> dict[str, Any]:
    """The priced fields of an uncalibrated AllReduce: a ReduceScatter, then an AllGather."""
    rs = price_fields("reduce-scatter", v, sizes, wraps, chip, scope, members_per_node)
    ag = price_fields("all-gather", v, sizes, wraps, chip, scope, members_per_node)
    return dict(
        link=rs["link"],
        hops=rs["hops"] + ag["hops"],
        bandwidth_s=rs["bandwidth_s"] + ag["bandwidth_s"],
        latency_s=rs["latency_s"] + ag["latency_s"],
        time_s=rs["time_s"] + ag["time_s"],
        latency_bound=rs["latency_bound"],
        formula="ReduceScatter + AllGather",
    )


def _parts(
    kind: str,
    v: float,
    sizes: tuple[int, ...],
    wraps: tuple[bool, ...],
    chip: Chip,
    scope: str,
    members_per_node: int | None,
    factor: float | None,
) -> _Parts:
    """How ``kind`` moves V bytes on the chip's fabric (ICI torus inside a TPU slice, a switch elsewhere),
    its bandwidth term scaled by the ``factor`` a calibrated host measured."""

    def structure(k: str) -> _Parts:
        if chip.topology == "torus" and scope == "node":
            return _torus(k, v, sizes, wraps, chip)
        return _switched(k, v, math.prod(sizes), chip, scope, members_per_node)

    if kind == "all-reduce":  # calibrated: the AllGather's structure twice, scaled by the measured factor
        ag = structure("all-gather")
        parts = ag._replace(hops=2 * ag.hops, bandwidth_s=2 * ag.bandwidth_s, formula="2 x AllGather")
    else:
        parts = structure(kind)
    if factor:
        parts = parts._replace(bandwidth_s=parts.bandwidth_s * float(factor))
    return parts


def _priced(parts: _Parts) -> dict[str, Any]:
    """The priced fields of a collective: launch, then the longer of the hops' latency and the bandwidth time."""
    hop_total = parts.hops * parts.hop_latency_s
    return dict(
        link=parts.link,
        hops=parts.hops,
        bandwidth_s=parts.bandwidth_s,
        latency_s=parts.launch_s + hop_total,
        time_s=parts.launch_s + max(hop_total, parts.bandwidth_s),
        latency_bound=parts.hops > 0 and hop_total > parts.bandwidth_s,
        formula=parts.formula,
    )


def _is_real_number(x) -> bool:
    """A real number: int and float at once, ``numbers.Real`` (numpy's scalars) only for anything else (importing
    ``numbers`` costs every command that prices a collective about 1 ms of start-up)."""
    if isinstance(x, (int, float)):
        return True
    import numbers

    return isinstance(x, numbers.Real)


def collective_time(
    kind: str,
    nbytes: float,
    axis_sizes: int | Sequence[int],
    chip: Chip,
    *,
    wraparound: bool | Sequence[bool] = True,
    scope: str = "node",
    members_per_node: int | None = None,
) -> CollectiveCost:
    """Predict one collective over one or several mesh axes.

    Args:
        kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all`` or ``permute``
            (common spellings accepted).
        nbytes: V, the per-device array in its unsharded-over-these-axes form (module docstring).
        axis_sizes: the size of each mesh axis the collective spans.
        chip: the hardware.
        wraparound: whether each torus axis is a closed ring; one bool applies to every axis.
            Ignored on switched fabrics.
        scope: ``node`` (ICI slice / NVLink domain) or ``cross-node`` (DCN / scale-out network).
        members_per_node: for ``cross-node`` groups on a switched fabric, how many members share a
            node (a strided group such as data parallelism over tensor-parallel nodes has 1). By
            default a group no larger than a node has one member per node and a larger one fills
            whole nodes.
    """
    kind = canonical_kind(kind)
    if scope not in SCOPES:
        raise UserError(f"unknown scope {scope!r}; valid: {', '.join(SCOPES)}")
    if not (_is_real_number(nbytes) and math.isfinite(nbytes) and nbytes > 0):
        raise UserError(f"--bytes must be a positive number, got {nbytes!r}")
    sizes = _axis_sizes(axis_sizes)
    wraps = _wraparound(wraparound, sizes, chip)

    return CollectiveCost(
        kind=kind,
        hardware=chip.name,
        bytes=float(nbytes),
        axis_sizes=sizes,
        wraparound=wraps,
        scope=scope,
        **price_fields(kind, float(nbytes), sizes, wraps, chip, scope, members_per_node),
    )


_NOTHING = dict(
    link="none", hops=0, bandwidth_s=0.0, latency_s=0.0, time_s=0.0, latency_bound=False, formula="0 (group of one)"
)


def price_fields(
    kind: str,
    v: float,
    sizes: tuple[int, ...],
    wraps: tuple[bool, ...],
    chip: Chip,
    scope: str,
    members_per_node: int | None = None,
) -> dict[str, Any]:
    """:func:`collective_time`'s priced fields (``link``, ``hops``, ``bandwidth_s``, ``latency_s``, ``time_s``,
    ``latency_bound``, ``formula``) of inputs it has already checked: a canonical ``kind``, V as a positive float,
    the axis sizes as ints and their wraparound as :func:`_wraparound` gives it. The estimators price thousands of
    collectives a search through :func:`lab.predict.efficiency.comm_time`, which calls this directly."""
    group = math.prod(sizes)
    if group == 1:  # nothing to communicate
        return dict(_NOTHING)
    factor = _calibrated_factor(chip, kind, group)
    if kind == "all-reduce" and not factor:
        return _composed_all_reduce(v, sizes, wraps, chip, scope, members_per_node)
    return _priced(_parts(kind, v, sizes, wraps, chip, scope, members_per_node, factor))
