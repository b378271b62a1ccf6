"""Achievable efficiency: what fraction of the roofline real kernels reach.

One documented model, the same for every estimate (no per-case constants):

* **Matmuls.** ``t = max(2 m k n / (eta(m, k, n) * peak), bytes / (MEMORY_FRACTION * W_hbm))`` with
  ``eta(m, k, n) = PEAK_FRACTION[kind] * prod_{x in m, k, n} x / (x + TILE[kind])``.
  The product is a smooth stand-in for tile quantisation: a dimension much larger than the
  hardware tile costs nothing, one the size of a tile halves the rate (the MXU is 128 wide, 256 on
  v6e; GPU tensor-core tiles are of the same order). ``PEAK_FRACTION`` is the best a large GEMM
  reaches: the scaling book quotes about 95% on TPUs and 80-85% on H100/B200 (roofline.md); the GPU
  value here was fitted once, on the Korthikanti et al. Table 5 iteration times (A100), and is
  used unchanged for every GPU and every other case.
* **Memory-bound ops** (norms, activations, softmax, optimizer): ``bytes / (MEMORY_FRACTION * W_hbm)``;
  about 92-94% of HBM bandwidth is measured on H100 and GB200 (scaling-book gpus.md; Azure's GB200
  report), 0.9 is used.
* **Collectives**: the collective model's time divided by ``COLLECTIVE_FRACTION``: NCCL's best
  8xH100 AllReduce reaches about 370 of 450 GB/s (gpus.md), TPU ICI about 95% (sharding.md).
"""

from __future__ import annotations

from lab.core.hardware import Chip
from lab.core.units import dtype_bytes
from lab.predict.collectives import collective_time

PEAK_FRACTION = {"gpu": 0.80, "tpu": 0.95, "cpu": 1.0}
TILE = {"gpu": 128.0, "tpu": 128.0, "cpu": 1.0}
MEMORY_FRACTION = 0.9
COLLECTIVE_FRACTION = {"gpu": 0.8, "tpu": 0.95, "cpu": 1.0}


def tile(chip: Chip) -> float:
    # v6e's MXU is 256x256 (tpus.md); the other TPUs' are 128x128.
    return 256.0 if chip.name == "tpu-v6e" else TILE[chip.kind]


def matmul_efficiency(chip: Chip, m: float, k: float, n: float) -> float:
    """Fraction of peak FLOP/s a GEMM of this shape reaches when compute-bound."""
    t = tile(chip)
    return PEAK_FRACTION[chip.kind] * (m / (m + t)) * (k / (k + t)) * (n / (n + t))


def matmul_time(chip: Chip, m: float, k: float, n: float, dtype: str = "bf16", batch: float = 1.0) -> float:
    """Achievable time of ``batch`` independent ``[m, k] @ [k, n]`` products."""
    flops = 2.0 * batch * m * k * n
    nbytes = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
    return max(flops / (matmul_efficiency(chip, m, k, n) * chip.flops(dtype)), memory_time(chip, nbytes))


def memory_time(chip: Chip, nbytes: float) -> float:
    """Achievable time of a memory-bound op moving ``nbytes`` through HBM."""
    return nbytes / (MEMORY_FRACTION * chip.hbm_bandwidth)


def collective_on(
    chip: Chip,
    kind: str,
    nbytes: float,
    group: int,
    *,
    scope: str = "node",
    members_per_node: int | None = None,
    axes: tuple[int, ...] | None = None,
):
    """The collective model's cost of a group of ``group`` chips where it physically sits: on a torus, the
    slice it occupies (its axes and their wraparound by the chip's rule); None for a group of one."""
    if group <= 1 or nbytes <= 0:
        return None
    wrap: bool | tuple[bool, ...] = True
    if axes is None and chip.topology == "torus" and scope == "node":
        axes = chip.slice_shape(group)
        wrap = chip.wraparound(axes)
    sizes = axes if axes is not None else (group,)
    return collective_time(kind, nbytes, sizes, chip, scope=scope, members_per_node=members_per_node, wraparound=wrap)


def comm_time(
    chip: Chip,
    kind: str,
    nbytes: float,
    group: int,
    *,
    scope: str = "node",
    members_per_node: int | None = None,
    axes: tuple[int, ...] | None = None,
) -> float:
    """Achievable time of one collective (the collective model at the fabric's measured efficiency)."""
    c = collective_on(chip, kind, nbytes, group, scope=scope, members_per_node=members_per_node, axes=axes)
    if c is None:
        return 0.0
    return c.time_s / COLLECTIVE_FRACTION[chip.kind]
