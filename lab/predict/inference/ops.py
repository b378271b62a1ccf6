"""The inference estimator's terms as named ops: one decode step, one prefill, a whole generation.

The estimator prices a forward pass the book's way, ``KV / W_hbm + max(weights / W_hbm, FLOPs / C) +
collectives``; here each term is split among the ops that cause it, by the kernels' named scopes
(``attention/qkv``, ``attention/scores``, ``mlp/up``, ...), so the ledger can put the estimate beside what ran.
The split is exact: the ops sum to the estimator's own total. When weight reads bound the pass, each matmul gets
its weights' share of the read time and attention the KV read; when FLOPs bound it, each gets its FLOPs' share.
"""

from __future__ import annotations

from lab.core.models import ModelConfig
from lab.predict import efficiency as eff
from lab.predict.inference.allreduce import comm_time
from lab.predict.inference.estimate import (
    InferConfig,
    comms,
    decode_step,
    prefill_terms,
)
from lab.predict.inference.rates import flop_time, matmul_shape_factor, mem_time

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

MATMULS = ("attention/qkv", "attention/out", "mlp/up", "mlp/down", "logits")


def _params(m: ModelConfig, experts: float) -> dict[str, float]:
    """Parameters behind each op (all layers), ``experts`` of each layer's experts counted."""
    L, d = m.layers, m.d_model
    if m.is_moe:  # the expert layers' routed and shared experts, and any leading dense layers' MLP
        mlp = d * (m.moe_layers * (experts + m.shared_experts) * m.d_ff + m.dense_layers * m.dense_ff)
        router = m.moe_layers * m.router_params_per_layer
    else:
        mlp, router = L * d * m.d_ff * experts, 0
    return {
        "attention/qkv": L * (m.attention_matmul_params - m.v_dim * d),
        "attention/out": L * m.v_dim * d,
        "mlp/up": (m.mlp_matrices - 1) * mlp + router,
        "mlp/down": mlp,
        "logits": d * m.vocab,
        "embed": 0.0 if m.tied_embeddings else d * m.vocab,
        "norm": L * m.norm_params_per_layer + d,
    }


def _split(
    cfg: InferConfig,
    weight_bytes: float,
    kv_bytes: float,
    mm_flops: float,
    att_flops: float,
    memory_bound: bool,
    logits_flops: float | None = None,
    decode: bool = False,
) -> list[dict[str, Any]]:
    """The roofline core of one pass, per op (see the module docstring); ``logits_flops``: the logits' share
    where it is not every token's (a prefill's, its last positions only)."""
    m, chip = cfg.model, cfg.chip
    read = _params(m, m.experts)  # what is stored (and read when memory-bound)
    used = _params(m, m.experts_per_token)  # what a token multiplies by
    total_read = sum(read.values())
    shared = MATMULS if logits_flops is None else tuple(k for k in MATMULS if k != "logits")
    rest = mm_flops - (logits_flops or 0.0)
    total_used = sum(used[k] for k in shared)
    ops = []
    rows = cfg.replica_batch * (1 if decode else (cfg.prefill_len or 0))
    tile = eff.decode_row_tile(chip, cfg) if decode else None
    shape = matmul_shape_factor(cfg.model, cfg.chip, cfg.tp)
    for name in (*MATMULS, "embed", "norm"):
        w = weight_bytes * read[name] / total_read
        flops = rest * used[name] / total_used if name in shared else 0.0
        if name == "logits" and logits_flops is not None:
            flops = logits_flops
        if not memory_bound:
            t = flop_time(chip, flops, cfg.compute, cfg.achievable, rows, tile, shape)
        elif decode and cfg.achievable:  # the weights at the skinny-GEMM rate, as decode_step prices them all
            t = eff.decode_weights_time(chip, w, cfg.weights, cfg.compute, cfg.fp8_scaling)
        else:
            t = mem_time(chip, w, cfg.achievable)
        ops.append(
            {
                "name": name,
                "kind": "matmul" if name in MATMULS else "elementwise",
                "time_s": t,
                "flops": flops,
                "bytes": w,
            }
        )
    t_att = mem_time(chip, kv_bytes, cfg.achievable)
    if not memory_bound:
        t_att += flop_time(chip, att_flops, cfg.compute, cfg.achievable, rows, tile, shape)
    ops.append(
        {"name": "attention/scores", "kind": "attention", "time_s": t_att, "flops": att_flops, "bytes": kv_bytes}
    )
    return ops


def _collectives(cfg: InferConfig, tokens: float) -> list[dict[str, Any]]:
    out = []
    for kind, nbytes, calls, group, what in comms(cfg, tokens):
        t, _ = comm_time(cfg, kind, nbytes, group, cfg.achievable)
        out.append(
            {
                "name": what,
                "kind": kind,
                "time_s": calls * t,
                "flops": 0.0,
                "bytes": calls * nbytes,
                "calls": calls,
                "role": "ep" if "EP" in what else "tp",
                # greedy sampling gathers fp32 logits and int32 indices; the rest moves activations
                "dtype": "fp32" if kind == "all-gather" else cfg.compute,
            }
        )
    return out


def decode_ops(cfg: InferConfig, context: int | None = None) -> list[dict[str, Any]]:
    """One decode step per chip, as named ops summing to :func:`decode_step`'s ``step_s``."""
    d = decode_step(cfg, context)
    memory_bound = d["weights_s"] >= d["compute_s"]
    ops = _split(
        cfg, d["weight_bytes"], d["kv_bytes"], d["matmul_flops"], d["attention_flops"], memory_bound, decode=True
    )
    if d["overhead_s"]:
        ops.append({"name": "kernel launches", "kind": "other", "time_s": d["overhead_s"], "flops": 0.0, "bytes": 0.0})
    return ops + _collectives(cfg, cfg.replica_batch)


def prefill_ops(cfg: InferConfig) -> list[dict[str, Any]]:
    """The prefill per chip, as named ops summing to :func:`prefill_terms`' ``step_s``."""
    p = prefill_terms(cfg)
    memory_bound = p["memory_s"] >= p["compute_s"]
    ops = _split(
        cfg, p["weight_bytes"], p["kv_bytes"], p["matmul_flops"], p["attention_flops"], memory_bound, p["logits_flops"]
    )
    return ops + _collectives(cfg, cfg.replica_batch * (cfg.prefill_len or 0))


def generate_ops(cfg: InferConfig, steps: int, context: int) -> list[dict[str, Any]]:
    """A prefill then ``steps - 1`` decode steps at ``context`` tokens of cache (greedy generation of ``steps``
    tokens: the prefill yields the first), merged by op name."""
    merged: dict[str, dict[str, Any]] = {}
    for times, ops in ((1, prefill_ops(cfg)), (steps - 1, decode_ops(cfg, context))):
        for op in ops:
            r = merged.setdefault(op["name"], {**op, "time_s": 0.0, "flops": 0.0, "bytes": 0.0, "calls": 0.0})
            for k in ("time_s", "flops", "bytes"):
                r[k] += times * op[k]
            r["calls"] += times * op.get("calls", 1.0)
    return list(merged.values())


__all__ = ["decode_ops", "generate_ops", "prefill_ops"]
