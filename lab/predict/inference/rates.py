"""The rates the inference estimator prices a pass at: FLOPs at the GEMM ceiling and the tile factors of the products'
dimensions, bytes at the memory's achievable rate (lab.predict.efficiency), or the ideal peaks."""

from __future__ import annotations

from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.predict import efficiency as eff


def mem_time(chip: Chip, nbytes: float, achievable: bool) -> float:
    """Bytes through HBM at the achievable copy rate (efficiency.memory_time), or at the full bandwidth (ideal)."""
    return eff.memory_time(chip, nbytes) if achievable else nbytes / chip.hbm_bandwidth


def flop_time(
    chip: Chip,
    flops: float,
    dtype: str,
    achievable: bool,
    rows: float | None = None,
    tile: float | None = None,
    shape: float = 1.0,
) -> float:
    """FLOPs at the peak (ideal), or at the GEMM ceiling; with ``rows`` (the tokens of a pass, the rows every
    product has) also at the tile factor ``rows / (rows + tile)`` the training estimator's matmuls take
    (efficiency.matmul_efficiency): a batch of 128 rows on a 128-wide tile runs at half the ceiling; and at
    ``shape``, the factor of the products' other two dimensions (:func:`matmul_shape_factor`)."""
    if not achievable:
        return flops / chip.flops(dtype)
    tile = eff.tile(chip) if tile is None else tile
    frac = eff.gemm_ceiling(chip, dtype) * (1.0 if rows is None else rows / (rows + tile)) * shape
    return flops / (frac * chip.flops(dtype))


def matmul_shape_factor(m: ModelConfig, chip: Chip, tp: int) -> float:
    """The share of the GEMM ceiling a forward pass's products keep for their K and N dimensions on one of ``tp``
    chips: the tile factor ``k / (k + t) x n / (n + t)`` of each of a layer's projections as the training estimator
    prices them (efficiency.matmul_efficiency; Q, K and V as one product), FLOP-weighted (their times add).
    The rows' factor is the pass's own (:func:`flop_time`); attention's products are taken at the same share."""
    t, d = eff.tile(chip), m.d_model
    width = m.d_ff if m.is_moe else m.dense_ff  # an expert's MLP (experts split over tp), else the dense MLP
    uses = (m.experts_per_token + m.shared_experts) if m.is_moe else 1
    products = (  # (k, n, times per token)
        (d, (m.attention_matmul_params - m.v_dim * d) / (d * tp), 1),
        (m.v_dim / tp, d, 1),
        (d, width / tp, (m.mlp_matrices - 1) * uses),
        (width / tp, d, uses),
    )
    return sum(k * n * c for k, n, c in products) / sum((k + t) * (n + t) * c for k, n, c in products)


__all__ = ["flop_time", "matmul_shape_factor", "mem_time"]
