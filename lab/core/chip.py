"""One accelerator as the analytic model sees it: the :class:`Chip` type, its fields' checks and derived quantities,
and the scale-out fabrics.

The catalog of chips and the loader of hardware files are :mod:`lab.core.hardware`'s; this module holds what a chip
is, so that both and every estimator read one definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from lab.core.collective_kinds import KINDS as KINDS_TABLE
from lab.core.collective_kinds import SCOPES as SCOPES_TABLE
from lab.core.errors import UserError
from lab.core.units import canonical_dtype

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

KINDS = ("tpu", "gpu", "cpu")
# Scale-out fabrics and the latency of one step of a collective across nodes on each (docs/reference/microbenchmarks-
# added.md N13: a tiny all-reduce between two single-A100 nodes over HDR InfiniBand takes 19-21 us, two steps: about
# 10 us a step; 68-69 us between two 8-GPU p5 nodes over EFA, about 25 us a step, derived; RoCE taken as InfiniBand,
# GCP's TCPX as EFA; grade C). "" leaves the chip's scaleout_latency_s in force; "dcn" is a TPU slice's.
FABRICS = ("", "infiniband", "roce", "efa", "tcpx", "dcn")
FABRIC_STEP_LATENCY = {"infiniband": 10e-6, "roce": 10e-6, "efa": 25e-6, "tcpx": 25e-6}


def scaleout_step_latency(chip: Chip) -> float:
    """Seconds one step of a collective across nodes costs: the fabric's (FABRIC_STEP_LATENCY), else the chip's."""
    return FABRIC_STEP_LATENCY.get(chip.fabric, chip.scaleout_latency_s)


# The collective kinds the cost model prices (lab.predict.collectives.KINDS) and a calibration's collective_factor
# may correct, and the scopes a collective can span: here, where the chip's data is, so that the command line lists
# them without importing the cost model.
COLLECTIVE_KINDS, COLLECTIVE_SCOPES = KINDS_TABLE, SCOPES_TABLE  # lab.core.collective_kinds: one table
TOPOLOGIES = ("torus", "switch", "mesh")
WRAPAROUND_RULES = ("full-axis", "cube", "always", "never")
MAX_TORUS_DIMS = 3  # every torus built for accelerators is 2D (TPU v5e, v6e) or 3D (v4, v5p); a 1D ring is one too


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_types(c: Chip) -> None:
    """Every field has its type and a finite value (the ranges are checked in ``__post_init__``)."""
    where = f"hardware {c.name!r}"

    def bad(fname: str, what: str) -> UserError:
        return UserError(f"{where}: {fname} = {getattr(c, fname)!r} must be {what}")

    if not isinstance(c.name, str) or not c.name.strip():
        raise UserError(f'hardware {c.name!r}: name must be a non-empty string, e.g. "h100-pcie"')
    if not c.name.isprintable():  # a newline or a bidi override would forge lines and names in every table
        raise UserError(
            f"hardware {c.name!r}: name has a control character; use letters, digits and '-', e.g. \"h100-pcie\""
        )
    for fname in ("kind", "topology", "wraparound_rule", "notes"):
        if not isinstance(getattr(c, fname), str):
            raise bad(fname, "a string")
    if not isinstance(c.peak_flops, Mapping):
        raise bad("peak_flops", "a table of dtype = FLOP/s, e.g. bf16 = 9.89e14")
    for dt, v in c.peak_flops.items():
        if not _real(v):
            raise UserError(f"{where}: peak_flops.{dt} = {v!r} must be a finite number of FLOP/s")
    for fname in (
        "hbm_bytes",
        "hbm_bandwidth",
        "link_bandwidth",
        "hop_latency_s",
        "scaleout_bandwidth",
        "scaleout_latency_s",
        "launch_latency_s",
    ):
        if not _real(getattr(c, fname)):
            raise bad(fname, "a finite number")
    if c.price_per_hour is not None and not (_real(c.price_per_hour) and c.price_per_hour >= 0):
        raise bad("price_per_hour", "a finite number >= 0 (US dollars per chip-hour)")
    if not isinstance(c.fabric, str):
        raise bad("fabric", f"a string, one of {', '.join(repr(f) for f in FABRICS if f)}")
    if c.nic_bandwidth is not None and not (_real(c.nic_bandwidth) and c.nic_bandwidth > 0):
        raise bad("nic_bandwidth", "a positive number of bytes/s one way per NIC, e.g. 5e10 for 400 Gb/s")
    for fname in ("torus_dims", "wraparound_size", "node_size", "nics_per_node"):
        v = getattr(c, fname)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise bad(fname, "a positive integer")
    if c.pod_shape is not None and not (
        isinstance(c.pod_shape, list | tuple)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in c.pod_shape)
    ):
        raise bad("pod_shape", "a list of positive integers, e.g. [16, 16]")
    if not isinstance(c.aliases, list | tuple) or not all(
        isinstance(a, str) and a.strip() and a.isprintable() for a in c.aliases
    ):
        raise bad("aliases", 'a list of names (no blank one, no control character), e.g. ["h100-sxm"]')
    if not isinstance(c.sources, Mapping):
        raise bad("sources", "a table of field = source")
    for key, v in c.sources.items():
        if not isinstance(v, str):
            raise UserError(
                f"{where}: sources.{key} = {v!r:.60} must be a string saying where the number comes from, "
                'e.g. "NVIDIA H100 datasheet"'
            )
    if not isinstance(c.calibrated, bool):
        raise bad("calibrated", "true or false")
    if not isinstance(c.calibration, Mapping):
        raise bad("calibration", "a table")
    factors = c.calibration.get("collective_factor", {})
    by_group = c.calibration.get("collective_factor_by_group", {})
    tables = [factors] + (list(by_group.values()) if isinstance(by_group, Mapping) else [None])
    for t in tables:
        if not isinstance(t, Mapping) or not all(_real(v) and v > 0 for v in t.values()):
            raise UserError(
                f"{where}: calibration.collective_factor(_by_group) must map collective kinds to positive numbers"
            )
    for t in (factors, by_group):
        unknown = sorted(str(k) for k in t if k not in COLLECTIVE_KINDS)
        if unknown:  # a misspelt kind would be ignored: the collective priced uncorrected, silently
            raise UserError(
                f"{where}: calibration.collective_factor has an unknown collective kind {unknown[0]!r}; "
                f"valid: {', '.join(COLLECTIVE_KINDS)}"
            )


@dataclass(frozen=True)
class Chip:
    """One accelerator as the analytic model sees it.

    Attributes:
        name: canonical lower-case name (``tpu-v5e``, ``h100``).
        kind: ``tpu``, ``gpu`` or ``cpu``.
        peak_flops: dense peak FLOP/s (OP/s for integers) per dtype; a dtype the chip has no
            matmul unit for is absent.
        hbm_bytes: device memory capacity.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        topology: ``torus`` (TPU ICI: direct chip-to-chip links), ``switch`` (NVLink/NVSwitch
            domain, or threads of one host for the CPU) or ``mesh`` (every chip of a node linked directly to
            each of the others: AMD Infinity Fabric).
        link_bandwidth: one-way bytes/s; per ICI link (torus), per-chip switch egress (switch) or per link to
            one peer (mesh: a group of d chips in a node reaches d - 1 of them, :meth:`group_egress`).
        hop_latency_s: fixed cost of one step of a ring collective on the scale-up fabric.
        scaleout_bandwidth: one-way bytes/s per chip on DCN or InfiniBand.
        scaleout_latency_s: fixed cost of one step across the scale-out network.
        launch_latency_s: fixed cost per collective independent of its steps (NCCL's base latency).
        torus_dims: torus dimensionality (2 or 3); ``None`` on switched fabrics.
        pod_shape: largest ICI domain (torus) as a tuple of axis sizes.
        wraparound_rule: when a torus slice has wraparound links: ``full-axis`` (an axis wraps only
            when it spans the whole pod axis, ``wraparound_size`` chips: v5e/v6e), ``cube`` (every
            axis wraps when all axes are multiples of ``wraparound_size``: v4/v5p optical cubes),
            ``always`` or ``never``.
        wraparound_size: the size in that rule.
        node_size: chips in one switch domain (GPUs per NVLink node); ``None`` on a torus.
        price_per_hour: on-demand US dollars per chip-hour where a public price exists.
        aliases: other accepted names.
        sources: where each number comes from, keyed by field name (``peak_flops.<dtype>`` too).
        calibrated: True when the numbers were fitted on this host by ``shardlab calibrate``.
        notes: free text shown by ``hardware show``.
        calibration: what calibration measured beyond the fields (fit quality per term, per-collective
            correction factors under ``collective_factor``); empty for catalog chips.
    """

    name: str
    kind: str
    peak_flops: Mapping[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    topology: str
    link_bandwidth: float
    hop_latency_s: float
    scaleout_bandwidth: float
    scaleout_latency_s: float
    launch_latency_s: float = 0.0
    torus_dims: int | None = None
    pod_shape: tuple[int, ...] | None = None
    wraparound_rule: str = "never"
    wraparound_size: int | None = None
    node_size: int | None = None
    price_per_hour: float | None = None
    aliases: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)
    calibrated: bool = False
    notes: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict)
    # The scale-out network as a cluster states it: NICs per node, each one's rate (bytes/s one way: 400 Gb/s = 5e10)
    # and the fabric (FABRICS). In a hardware file they set scaleout_bandwidth (NICs x rate / node_size); the fabric
    # sets the per-step latency of a collective across nodes (FABRIC_STEP_LATENCY).
    nics_per_node: int | None = None
    nic_bandwidth: float | None = None
    fabric: str = ""

    def __post_init__(self) -> None:
        _check_types(self)  # a hand-written or corrupt file gives any JSON value: refused by name, not a crash
        # Freeze the mappings so a catalog entry cannot be mutated by a caller.
        object.__setattr__(
            self,
            "peak_flops",
            MappingProxyType({canonical_dtype(k): float(v) for k, v in dict(self.peak_flops).items()}),
        )
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "calibration", MappingProxyType(dict(self.calibration)))
        object.__setattr__(self, "aliases", tuple(a.lower() for a in self.aliases))
        if self.pod_shape is not None:
            object.__setattr__(self, "pod_shape", tuple(int(x) for x in self.pod_shape))
        where = f"hardware {self.name!r}"
        if self.kind not in KINDS:
            raise UserError(f"{where}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.topology not in TOPOLOGIES:
            raise UserError(f"{where}: topology {self.topology!r} is not one of {', '.join(TOPOLOGIES)}")
        if self.wraparound_rule not in WRAPAROUND_RULES:
            raise UserError(
                f"{where}: wraparound_rule {self.wraparound_rule!r} is not one of {', '.join(WRAPAROUND_RULES)}"
            )
        if self.wraparound_rule in ("full-axis", "cube") and not self.wraparound_size:
            raise UserError(f"{where}: wraparound_rule {self.wraparound_rule!r} needs a wraparound_size")
        if (self.kind == "tpu") != (self.topology == "torus") and self.kind != "cpu":  # e.g. "tpu" on a GPU base
            want = "torus" if self.kind == "tpu" else "switch"
            raise UserError(
                f"{where}: kind {self.kind!r} with topology {self.topology!r}: a {self.kind.upper()} is priced on a "
                f"{want} (give topology = {want!r} with its fields, or base the chip on a catalog {self.kind.upper()})"
            )
        if self.topology != "torus" and not self.node_size:
            raise UserError(f"{where}: a {self.topology} topology needs node_size (chips per node)")
        if self.pod_shape is not None and not self.pod_shape:
            raise UserError(
                f"{where}: pod_shape = [] names no axis; give the pod's axis sizes, e.g. [16, 16], or leave it out "
                "(a switch topology has none)"
            )
        if self.torus_dims is not None and self.torus_dims > MAX_TORUS_DIMS:
            raise UserError(
                f"{where}: torus_dims = {self.torus_dims}; a TPU torus has 2 (v5e, v6e) or 3 (v4, v5p) axes: give "
                f"1 to {MAX_TORUS_DIMS}"
            )
        if self.topology == "torus":
            if self.torus_dims is None or self.pod_shape is None:
                raise UserError(
                    f"{where}: a torus topology needs torus_dims and pod_shape, e.g. torus_dims = 2 and "
                    'pod_shape = [16, 16] (or topology = "switch" with node_size)'
                )
            if len(self.pod_shape) != self.torus_dims:
                raise UserError(
                    f"{where}: pod_shape {list(self.pod_shape)} has {len(self.pod_shape)} axes but torus_dims = "
                    f"{self.torus_dims}; give one size per torus axis, e.g. {[16] * self.torus_dims}"
                )
        if self.topology == "mesh" and self.kind != "gpu":
            raise UserError(f'{where}: a mesh is a GPU node\'s fabric (AMD Infinity Fabric); give topology = "switch"')
        torus_only = [f for f, v in (("torus_dims", self.torus_dims), ("pod_shape", self.pod_shape)) if v is not None]
        if self.topology != "torus" and (torus_only or self.wraparound_rule != "never"):
            what = ", ".join(torus_only or [f"wraparound_rule = {self.wraparound_rule!r}"])
            raise UserError(f"{where}: {what} describes a TPU torus; a {self.topology} has node_size only: drop it")
        if self.topology == "torus" and self.node_size is not None:
            raise UserError(f"{where}: node_size describes a switched node; a torus has pod_shape: drop node_size")
        if not self.peak_flops:
            raise UserError(f"{where}: peak_flops is empty; give at least one dtype, e.g. bf16 = 9.89e14")
        for fname in ("hbm_bytes", "hbm_bandwidth", "link_bandwidth", "scaleout_bandwidth"):
            if not getattr(self, fname) > 0:
                raise UserError(f"{where}: {fname} must be > 0, got {getattr(self, fname)!r}")
        for dt, v in self.peak_flops.items():
            if not v > 0:
                raise UserError(f"{where}: peak_flops.{dt} must be > 0, got {v!r}")
        for fname in ("hop_latency_s", "scaleout_latency_s", "launch_latency_s"):
            if getattr(self, fname) < 0:
                raise UserError(f"{where}: {fname} must be >= 0, got {getattr(self, fname)!r}")
        self._check_network(where)

    def _check_network(self, where: str) -> None:
        """The scale-out fields: a known fabric; NICs and their rate together, on a switched node (a hardware file's
        NICs set its scale-out bandwidth: _coerce_chip)."""
        if self.fabric not in FABRICS:
            raise UserError(f"{where}: fabric {self.fabric!r} is not one of {', '.join(f for f in FABRICS if f)}")
        nics, rate = self.nics_per_node, self.nic_bandwidth
        if nics is None and rate is None:
            return
        if nics is None or rate is None:
            raise UserError(
                f"{where}: give nics_per_node and nic_bandwidth together (e.g. 8 and 5e10 for 8 x 400 Gb/s)"
            )
        if self.topology == "torus":
            raise UserError(
                f"{where}: nics_per_node describes a GPU node; a TPU's DCN share is scaleout_bandwidth per chip"
            )

    # ----- derived quantities -------------------------------------------------------------

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a clear error when the chip has no such unit."""
        dt = canonical_dtype(dtype)
        if dt not in self.peak_flops:
            raise UserError(
                f"{self.name} has no {dt} peak in the catalog; valid dtypes for it: {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[dt]

    def critical_intensity(self, dtype: str = "bf16") -> float:
        """FLOPs per HBM byte above which a kernel is compute-bound: ``peak / hbm_bandwidth``."""
        return self.flops(dtype) / self.hbm_bandwidth

    def group_egress(self, members: int) -> float:
        """One-way bytes/s a chip sends to the others of a group of ``members`` inside one node: its switch egress,
        or on a mesh its links to the ``members - 1`` peers (one link to each); the link itself on a torus."""
        if self.topology == "mesh":
            return self.link_bandwidth * max(1, members - 1)
        return self.link_bandwidth

    @property
    def ici_bidirectional(self) -> float:
        """Both directions of one link: the book's ``W_ici`` (torus) or 2x NVLink egress (switch)."""
        return 2 * self.link_bandwidth

    @property
    def latency_bound_bytes(self) -> float:
        """Per-shard message size under which one ring step is latency- rather than bandwidth-bound.

        The book's form (sharding.md): a hop is latency-bound when ``shard_bytes / W_link < T_hop``,
        about 45 kB on v5e.
        """
        return self.link_bandwidth * self.hop_latency_s

    def wraparound(self, slice_shape: Iterable[int]) -> tuple[bool, ...]:
        """Which axes of a physical slice of this chip have wraparound links."""
        shape = tuple(int(x) for x in slice_shape)
        if self.wraparound_rule == "always":
            return tuple(True for _ in shape)
        if self.wraparound_rule == "never":
            return tuple(False for _ in shape)
        n = int(self.wraparound_size or 0)
        if self.wraparound_rule == "full-axis":
            return tuple(s == n for s in shape)
        full_cubes = all(s % n == 0 for s in shape)  # 'cube'
        return tuple(full_cubes for _ in shape)

    def fields(self) -> dict[str, Any]:
        """Every field as plain Python values (the hardware-file format)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops"] = dict(self.peak_flops)
        d["sources"] = dict(self.sources)
        d["calibration"] = dict(self.calibration)
        d["aliases"] = list(self.aliases)
        d["pod_shape"] = list(self.pod_shape) if self.pod_shape else None
        return d

    def slice_shape(self, chips: int) -> tuple[int, ...]:
        """The physical torus slice a group of ``chips`` occupies: as square as the torus allows,
        each axis a power of two no longer than the pod's (e.g. 16 v5e chips -> 4x4, 8 -> 2x4).
        Off a torus, or when ``chips`` is not a power of two, one axis of ``chips``."""
        if self.topology != "torus" or chips < 1 or chips & (chips - 1):
            return (chips,)
        dims = [1] * (self.torus_dims or 1)
        limits = sorted(self.pod_shape or (chips,))
        n = chips
        while n > 1:
            order = sorted(range(len(dims)), key=lambda i: dims[i])
            for i in order:
                if dims[i] * 2 <= (limits[i] if i < len(limits) else chips):
                    dims[i] *= 2
                    break
            else:
                return (chips,)
            n //= 2
        return tuple(sorted((d for d in dims if d > 1), reverse=False)) or (1,)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every field, plus derived figures under ``derived``."""
        d = self.fields()
        d["derived"] = {
            "critical_intensity": {dt: self.critical_intensity(dt) for dt in self.peak_flops},
            "ici_bidirectional": self.ici_bidirectional,
            "latency_bound_bytes": self.latency_bound_bytes,
        }
        return d


__all__ = [
    "COLLECTIVE_KINDS",
    "COLLECTIVE_SCOPES",
    "FABRICS",
    "FABRIC_STEP_LATENCY",
    "KINDS",
    "MAX_TORUS_DIMS",
    "TOPOLOGIES",
    "WRAPAROUND_RULES",
    "Chip",
    "scaleout_step_latency",
]
