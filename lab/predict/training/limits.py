"""The scaling book's communication thresholds for training (training.md; gpus.md for GPUs)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.hardware import Chip

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

# ----- the book's thresholds -----------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Communication thresholds of the scaling book (training.md; gpus.md for GPUs).

    ``alpha = C / W`` with W the bandwidth an AllGather sees per chip: the bidirectional ICI link
    times the number of axes on a TPU, NVLink egress inside a GPU node, node egress across nodes.
    """

    hardware: str
    d_ff: int | None
    axes: int
    tp_axes: int
    alpha: float
    dp_min_tokens_per_chip: float
    dp_min_tokens_per_chip_cross_node: float
    tp_max_degree: float | None
    fsdp_tp_min_tokens_per_chip: float | None
    fsdp_opt_degree: float | None
    dcn_min_tokens_per_slice: float | None
    min_chips_to_hold: float | None = None  # applied-training.md: (weights + Adam moments + checkpoints) / HBM
    checkpoints_per_layer: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def limits(
    chip: Chip,
    d_ff: int | None = None,
    *,
    axes: int = 1,
    tp_axes: int = 1,
    chips: int | None = None,
    batch_tokens: float | None = None,
    dtype: str = "bf16",
    model=None,
    checkpoints: float | None = None,
) -> Limits:
    """The book's DP, TP and FSDP+TP thresholds for ``chip`` (and a model's ``d_ff``); with a ``model``, a
    ``batch_tokens`` and ``checkpoints`` per layer, the chips whose HBM holds the job on the book's assumptions
    (applied-training.md): bf16 weights (2 B per parameter), fp32 Adam moments (8 B), and ``checkpoints`` bf16
    vectors of ``d_model`` per token and layer for the whole batch; nothing else (no gradients, no logits)."""
    for name, v in (("--axes", axes), ("--tp-axes", tp_axes)):
        if v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    c = chip.flops(dtype)
    if chip.topology == "torus":
        w = chip.ici_bidirectional
        cross = c / chip.scaleout_bandwidth
        dcn = c / chip.scaleout_bandwidth
    else:
        w = chip.link_bandwidth
        cross = c / (chip.node_size * chip.scaleout_bandwidth)
        dcn = None
    alpha = c / w
    tp_max = fsdp_tp = opt = None
    if d_ff is not None:
        tp_max = tp_axes * d_ff * w / c  # training.md: Y < M_Y F / alpha
        fsdp_tp = alpha**2 / (axes * tp_axes * d_ff)  # B/N > alpha^2 / (M_X M_Y F)
        if chips and batch_tokens:
            opt = math.sqrt(batch_tokens / d_ff * axes / tp_axes * chips)  # X_opt = sqrt(B/F * M_X/M_Y * N)
    hold = None
    if model is not None and batch_tokens and checkpoints:
        state = model.params * (2.0 + 8.0)
        saved = 2.0 * checkpoints * model.d_model * batch_tokens * model.layers
        hold = (state + saved) / chip.hbm_bytes
    return Limits(
        hardware=chip.name,
        d_ff=d_ff,
        axes=axes,
        tp_axes=tp_axes,
        alpha=alpha,
        dp_min_tokens_per_chip=alpha / axes,
        dp_min_tokens_per_chip_cross_node=cross,
        tp_max_degree=tp_max,
        fsdp_tp_min_tokens_per_chip=fsdp_tp,
        fsdp_opt_degree=opt,
        dcn_min_tokens_per_slice=dcn,
        min_chips_to_hold=hold,
        checkpoints_per_layer=checkpoints,
    )
