"""The training estimator's price of a fused attention kernel: a measured one (FlashAttention on GPUs, its rate from
:func:`lab.predict.efficiency.attention_efficiency`, a sliding window's layers at their window's rate), or the one a
Plan names (``attention = "pallas"``): the lab's Pallas flash attention from its block pairs
(:mod:`lab.core.pallas_cost`). The XLA path's score matmuls stay in :mod:`lab.predict.training.estimate`."""

from __future__ import annotations

from lab.core.pallas_cost import flash_cost, flash_pairs
from lab.core.units import dtype_bytes
from lab.predict import efficiency as eff

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from lab.predict.training.config import TrainConfig

# Backward FLOPs of an op over its forward's, where not the 2 of a matmul's two gradients: the lab's Pallas flash
# attention recomputes the scores in each backward kernel (lab.core.pallas_cost: dq 6, dk/dv 8, forward 4 per
# block pair and head dimension).
BACKWARD_FLOPS = {"attention.pallas": (6 + 8) / 4}


def measured_kernel(cfg: TrainConfig, s_local: float) -> bool:
    """A fused attention kernel with a measured rate on this chip (efficiency.ATTENTION)."""
    return eff.attention_efficiency(cfg.chip, cfg.attention_kernel, s_local) is not None


def fused_attention_time(cfg: TrainConfig, s_local: float, flops: float, dt: str) -> float:
    """A measured fused kernel's forward over one layer's ``flops`` in ``dt`` (its rate over forward and backward:
    3.5 x the forward FLOPs). The kernel sees this chip's query block against keys as long (a ring's chunks under
    context parallelism); a windowed layer's queries see at most ``sliding_window`` keys, so its rate is a sequence
    that long's, each kind of layer taking its share of the FLOPs (ModelConfig.attended)."""
    m, chip, peak = cfg.model, cfg.chip, cfg.chip.flops(dt)
    rate = eff.attention_efficiency(chip, cfg.attention_kernel, s_local)
    assert rate is not None
    n = m.window_layers
    if not n or m.sliding_window >= s_local:
        return flops / (rate * peak)
    total = m.attended(cfg.seq_len, cfg.causal)
    whole = (m.layers - n) * (cfg.seq_len / 2 if cfg.causal else cfg.seq_len)
    local = (total - whole) / total  # the windowed layers' share of the score FLOPs
    small = eff.attention_efficiency(chip, cfg.attention_kernel, float(m.sliding_window))
    assert small is not None
    return flops * ((1 - local) / rate + local / small) / peak


def pallas_attention(cfg: TrainConfig, q: float, kv: float, h: float, s_local: float, dt: str) -> tuple:
    """The lab's Pallas flash attention of one layer and microbatch on one chip (this chip's heads, whole
    sequences): FLOPs and HBM bytes of its forward kernel from :func:`lab.core.pallas_cost.flash_cost`; its time the
    roofline's of the dense score matmuls scaled by the block pairs it computes, the backward
    ``BACKWARD_FLOPS`` times the forward. ``dt``: the dtype attention computes in (kept wide by fp8 recipes)."""
    t, s = int(s_local), int(cfg.seq_len)
    bq, bk = cfg.pallas_blocks  # type: ignore[misc]
    bq, bk = min(bq, t), min(bk, s)
    cost = flash_cost(cfg.microbatch, t, s, round(q), round(kv), round(h), bq, bk, cfg.causal, int(dtype_bytes(dt)))
    share = flash_pairs(t, s, bq, bk, cfg.causal) / ((t // bq) * (s // bk))
    dense = 2 * eff.matmul_time(cfg.chip, s_local, h, cfg.seq_len, dt, cfg.microbatch * q)
    fwd = max(dense * share, eff.memory_time(cfg.chip, cost["bytes_accessed"]))
    back = BACKWARD_FLOPS["attention.pallas"]
    return ("attention.pallas", "attention", fwd, back * fwd, float(cost["flops"]), float(cost["bytes_accessed"]))


__all__ = ["BACKWARD_FLOPS", "fused_attention_time", "measured_kernel", "pallas_attention"]
