"""Roofline model: an op costs max(compute time, memory time).

From the scaling book, roofline.md: ``T_math = FLOPs / peak``, ``T_mem = bytes / W_hbm``; the
lower bound ``max(T_math, T_mem)`` assumes perfect overlap and is what ``time_s`` reports (the
upper bound, no overlap, is their sum and is at most 2x larger). Arithmetic intensity is
``FLOPs / bytes``; an op is compute-bound when it exceeds the chip's critical intensity
``peak / W_hbm`` (240 for bf16 on TPU v5e, about 295 on H100).

Mixed dtypes: weight and activation dtypes change **bytes**; the compute dtype picks the peak.
int8 weights with bf16 activations compute in bf16 (weights are dequantised), so the critical
token batch halves to about 120 on v5e (roofline.md, quantisation).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.units import canonical_dtype, dtype_bytes

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class RooflineCost:
    """Cost of one op on one chip.

    Attributes:
        op: a name for the op (joined later to HLO and trace names).
        hardware: chip name.
        compute_dtype: the dtype whose peak FLOP/s applies.
        flops: floating-point (or integer) operations.
        bytes: HBM bytes read plus written.
        intensity: ``flops / bytes``.
        critical_intensity: the chip's ``peak / hbm_bandwidth`` for ``compute_dtype``.
        compute_s, memory_s: the two roofline times.
        time_s: ``max(compute_s, memory_s)``.
        bound: ``"compute"`` or ``"memory"``.
    """

    op: str
    hardware: str
    compute_dtype: str
    flops: float
    bytes: float
    intensity: float
    critical_intensity: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def roofline(chip: Chip, flops: float, nbytes: float, compute_dtype: str = "bf16", op: str = "op") -> RooflineCost:
    """Price ``flops`` and ``nbytes`` of HBM traffic on ``chip`` at the peak of ``compute_dtype``."""
    for flag, v in (("--flops", flops), ("--bytes", nbytes)):
        if not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
            raise UserError(f"{op}: {flag} must be a number >= 0, got {v!r}")
    dt = canonical_dtype(compute_dtype)
    peak = chip.flops(dt)
    compute_s = flops / peak
    memory_s = nbytes / chip.hbm_bandwidth
    return RooflineCost(
        op=op,
        hardware=chip.name,
        compute_dtype=dt,
        flops=float(flops),
        bytes=float(nbytes),
        intensity=flops / nbytes if nbytes else math.inf,
        critical_intensity=chip.critical_intensity(dt),
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=max(compute_s, memory_s),
        # Ties go to compute: at exactly critical intensity both units are saturated.
        bound="compute" if compute_s >= memory_s else "memory",
    )


@dataclass(frozen=True)
class MatmulCost(RooflineCost):
    """Roofline of ``In[B, D] @ W[D, F] -> Out[B, F]`` plus its shape and dtypes.

    ``critical_batch`` is the token batch B above which this matmul is compute-bound at these D, F
    and dtypes (solved exactly from the byte count; ``inf`` when it never is).
    """

    b: int = 0
    d: int = 0
    f: int = 0
    dtype: str = "bf16"
    weight_dtype: str = "bf16"
    out_dtype: str = "bf16"
    critical_batch: float = math.inf


def default_compute_dtype(dtype: str, weight_dtype: str) -> str:
    """The dtype a matmul runs in: the wider of activations and weights.

    int8 weights with bf16 activations dequantise to bf16; int8 x int8 runs on the int8 units.
    """
    a, w = canonical_dtype(dtype), canonical_dtype(weight_dtype)
    return a if dtype_bytes(a) >= dtype_bytes(w) else w


def matmul(
    chip: Chip,
    b: int,
    d: int,
    f: int,
    dtype: str = "bf16",
    weight_dtype: str | None = None,
    out_dtype: str | None = None,
    compute_dtype: str | None = None,
    op: str = "matmul",
) -> MatmulCost:
    """Roofline of ``In[B, D] *_D W[D, F] -> Out[B, F]``.

    FLOPs ``2BDF``; bytes ``B*D*a + D*F*w + B*F*o`` with a, w, o the bytes per element of the
    activations, weights and output (tpus.md: ``max((DF + BD + BF) * bytes / W_hbm, 2BDF / C)``).

    Args:
        chip: the hardware.
        b, d, f: token batch, contracting dim, output features.
        dtype: activation dtype (and output dtype unless ``out_dtype`` is given).
        weight_dtype: weight dtype; defaults to ``dtype``.
        out_dtype: output dtype; defaults to ``dtype``.
        compute_dtype: peak to use; defaults to :func:`default_compute_dtype`.
        op: name of the op.
    """
    for label, v in (("b", b), ("d", d), ("f", f)):
        if int(v) != v or v <= 0:
            raise UserError(f"--{label} must be a positive integer, got {v!r}")
    a_dt = canonical_dtype(dtype)
    w_dt = canonical_dtype(weight_dtype or a_dt)
    o_dt = canonical_dtype(out_dtype or a_dt)
    c_dt = canonical_dtype(compute_dtype) if compute_dtype else default_compute_dtype(a_dt, w_dt)
    a, w, o = dtype_bytes(a_dt), dtype_bytes(w_dt), dtype_bytes(o_dt)
    flops = 2.0 * b * d * f
    nbytes = b * d * a + d * f * w + b * f * o
    base = roofline(chip, flops, nbytes, c_dt, op=op)
    crit = base.critical_intensity
    # 2BDF / (B(Da + Fo) + DFw) = crit  =>  B = crit*D*F*w / (2DF - crit*(Da + Fo))
    denom = 2.0 * d * f - crit * (d * a + f * o)
    critical_batch = crit * d * f * w / denom if denom > 0 else math.inf
    return MatmulCost(
        **dataclasses.asdict(base),
        b=int(b),
        d=int(d),
        f=int(f),
        dtype=a_dt,
        weight_dtype=w_dt,
        out_dtype=o_dt,
        critical_batch=critical_batch,
    )
