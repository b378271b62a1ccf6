"""The estimate of a Plan's program: one cost model, as named ops, for the audit and the ledger.

:func:`estimate_program` prices whatever a :class:`lab.core.plan.Plan` runs on one chip:

* the Transformer's **train step** with the training estimator (:mod:`lab.predict.training.estimate`), its layout
  derived from the Plan's rules and its options from how the lab's Transformer is written (fp32 weights,
  separate Q/K/V and gate/up projections, plain softmax attention, vocab-parallel embedding and loss);
* its **decode** (prefill, then one token per step, every step reading the whole allocated cache) with the
  inference estimator (:mod:`lab.predict.inference.estimate`);
* the **kernels** with the sharded-matmul engine (:mod:`lab.predict.program.sharded_matmul`) and the collective model;
  ring attention, the MoE MLP and the pipelined MLP with the roofline and the collective model
  (:mod:`lab.predict.program.axis_programs`).

The result is a list of :class:`OpEstimate` named like the kernels' ``jax.named_scope`` s (compute) or by what
they carry (collectives, each over the mesh axes of its parallelism). The compiled-program audit checks the
collectives of this list, byte for byte, against the HLO; the ledger joins every op to the compiled and measured
ops of the same scope; ``shardlab train estimate --plan`` prints the same list. One model, three consumers.
"""

from __future__ import annotations

import math
from typing import Any

from lab.core.attention import BLOCK_KERNELS, from_options
from lab.core.collective_kinds import from_hlo
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.notation import parse_matmul
from lab.core.plan import Plan
from lab.core.units import dtype_bytes
from lab.predict.inference.estimate import InferConfig, estimate_inference
from lab.predict.inference.from_plan import infer_config as plan_infer_config
from lab.predict.inference.from_plan import serving_degrees
from lab.predict.inference.ops import decode_ops, generate_ops
from lab.predict.program.axis_programs import AXIS_ESTIMATES
from lab.predict.program.ops import (
    COLLECTIVE_KINDS,
    ExpectedCollective,
    OpEstimate,
    ProgramEstimate,
    collective_op,
    live,
)
from lab.predict.program.sharded_matmul import plan_sharded_matmul
from lab.predict.training.estimate import estimate, step_ops
from lab.predict.training.from_plan import train_config

# The lab's blocks name their two matmuls (kernels/blocks.py); the book's kernels leave theirs unscoped.
BLOCK_SCOPES = ("mlp/up", "mlp/down")


def infer_config(plan: Plan, chip: Chip) -> InferConfig:
    """The inference estimator's config of a decode Plan as the lab's program runs it: it reads the whole allocated
    cache each step, its attention as its options say, its all-reduces as XLA compiles them."""
    att = from_options(plan.options)
    return plan_infer_config(
        plan,
        chip,
        pallas_blocks=(att.block_q, att.block_k) if att.impl in BLOCK_KERNELS else None,
        tp_allreduce=xla_allreduce(chip),
    )


def xla_allreduce(chip: Chip) -> str | None:
    """The lab's programs all-reduce as XLA compiles them: NCCL's on a GPU (not a serving stack's own kernel)."""
    return "nccl" if chip.kind == "gpu" else None


def serve_config(plan: Plan, chip: Chip) -> InferConfig:
    """The inference estimator's config of one step of a ``serve`` Plan, as the program is written: every replica
    computes all ``token_budget`` slots (padding too: the shapes are fixed) and each slot gathers its sequence's
    whole page-table row, ``ceil(max_seq_len / page_size)`` pages (kernels.transformer.paged). That is a decode
    step of ``token_budget`` sequences per replica at a context of that row's positions."""
    m, z = plan.model, plan.sizes
    assert m is not None
    replicas = serving_degrees(plan)[1]
    row = min(z["pages"], -(-m.max_seq_len // z["page_size"])) * z["page_size"]
    return plan_infer_config(
        plan,
        chip,
        batch=z["token_budget"] * replicas,
        context=row,
        flash_attention=True,
        tp_allreduce=xla_allreduce(chip),
    )


def _serve(plan: Plan, chip: Chip) -> ProgramEstimate:
    cfg = serve_config(plan, chip)
    est = estimate_inference(cfg)
    ops = tuple(_op(plan, d) for d in decode_ops(cfg))
    flops = sum(o.flops for o in ops if o.kind in ("matmul", "attention"))
    memory = {"total": est.total_bytes_per_chip, "hbm_bytes": chip.hbm_bytes, "params": est.param_bytes_per_chip}
    memory["kv"] = est.kv_bytes_per_chip
    note = (
        f"inference estimator: one serving step of {plan.sizes['token_budget']} token slots per replica, each "
        f"reading its sequence's {cfg.context} positions of pages (fixed shapes: padding computes too)"
    )
    return ProgramEstimate(
        plan.program,
        chip.name,
        sum(o.time_s for o in ops),
        ops,
        "inference estimator",
        flops,
        memory,
        (note,),
        {"infer": est},
    )


def _op(plan: Plan, d: dict[str, Any]) -> OpEstimate:
    kind = from_hlo(d["kind"])
    collective = kind in COLLECTIVE_KINDS
    axes = plan.roles().get(d.get("role", ""), ()) if collective else ()
    return OpEstimate(
        name=d["name"],
        kind=kind,
        time_s=d["time_s"],
        flops=d.get("flops", 0.0),
        bytes=d.get("bytes", 0.0),
        calls=d.get("calls", 1.0),
        axes=axes,
        dtype=d.get("dtype", ""),
        scope=None if collective else d["name"],
        hidden=d.get("hidden"),
    )


def _train(plan: Plan, chip: Chip) -> ProgramEstimate:
    cfg = train_config(plan, chip)
    est = estimate(cfg)
    ops = tuple(_op(plan, d) for d in step_ops(est))
    flops = sum(o.flops for o in ops if o.kind in ("matmul", "attention"))
    notes = ("training estimator; " + "; ".join(est.assumptions),)
    detail = {"train": est}
    return ProgramEstimate(
        plan.program, chip.name, est.step_time_s, ops, "training estimator", flops, est.memory.to_dict(), notes, detail
    )


def _decode(plan: Plan, chip: Chip) -> ProgramEstimate:
    cfg = infer_config(plan, chip)
    est = estimate_inference(cfg)
    steps = plan.sizes["steps"]
    raw = generate_ops(cfg, steps, cfg.context)
    ops = tuple(_op(plan, d) for d in raw)
    flops = sum(o.flops for o in ops if o.kind in ("matmul", "attention"))
    memory = {
        "total": est.total_bytes_per_chip,
        "hbm_bytes": chip.hbm_bytes,
        "params": est.param_bytes_per_chip,
        "kv": est.kv_bytes_per_chip,
    }
    note = (
        f"inference estimator: a prefill of {cfg.prefill_len} tokens, then {steps - 1} decode steps, each "
        f"reading the whole {cfg.context}-token cache"
    )
    detail = {"infer": est}
    return ProgramEstimate(
        plan.program, chip.name, sum(o.time_s for o in ops), ops, "inference estimator", flops, memory, (note,), detail
    )


# ----- kernels ---------------------------------------------------------------------------------------------------


def _kernel(plan: Plan, chip: Chip) -> ProgramEstimate:
    spec, mesh, dtype = plan.spec, plan.shape, plan.dtype
    if spec.family in AXIS_ESTIMATES:  # the kernels over named mesh axes (lab.predict.program.axis_programs)
        return AXIS_ESTIMATES[spec.family](plan, chip)
    b = dtype_bytes(dtype)
    sizes = dict(plan.sizes)
    ops: list[OpEstimate] = []
    if spec.family == "collective":
        kind = spec.name.removeprefix("collective_").replace("_", "-")
        ax = live(tuple(plan.axes or mesh), mesh)
        g, n = math.prod(mesh[a] for a in ax), sizes["N"]
        v = {"all-gather": n * g, "reduce-scatter": n, "all-reduce": n, "all-to-all": n * g, "permute": n}[kind] * b
        if g > 1:
            ops.append(collective_op(kind, ax, v, dtype, chip, plan, f"{kind} over {','.join(ax)}"))
        held = {"total": 2.0 * v, "hbm_bytes": chip.hbm_bytes}  # the buffer in and the buffer out, at most V each
        return ProgramEstimate(
            plan.program, chip.name, sum(o.time_s for o in ops), tuple(ops), "collective model", 0.0, held
        )
    parts = [p.strip() for p in (spec.notation or "").split(";")]
    ring = spec.name.startswith("collective_matmul_")
    local_bytes = []
    for i, part in enumerate(parts):
        mp = plan_sharded_matmul(part, sizes, mesh, chip, dtype)
        local_bytes.append(mp.local.bytes)
        scope = BLOCK_SCOPES[i] if spec.family == "block" else None
        ops.append(OpEstimate(scope or "matmul", "matmul", mp.compute_s, mp.local.flops, mp.local.bytes, scope=scope))
        if ring:  # the AllGather or ReduceScatter becomes Y-1 ring steps of one chunk each, overlapped
            y = mesh.get("Y", 1)
            i_, j, k = sizes["I"], sizes["J"], sizes["K"]
            chunk = (i_ / mesh.get("X", 1) * j / y if "allgather" in spec.name else i_ * k / y) * b
            if y > 1:
                ops.append(
                    collective_op(
                        "permute", ("Y",), (y - 1) * chunk, dtype, chip, plan, f"{y - 1} ring steps over Y", steps=y - 1
                    )
                )
            continue
        for c in mp.collectives:
            axes = live(c.axes, mesh)
            if axes:
                ops.append(collective_op(c.kind, axes, c.bytes, dtype, chip, plan, c.describe()))
    compute = sum(o.time_s for o in ops if not o.is_collective)
    comm = sum(o.time_s for o in ops if o.is_collective)
    step = max(compute, comm) if ring else compute + comm  # the ring kernels overlap each step with a matmul
    flops = sum(o.flops for o in ops)
    # operands after their gathers and the result; a block holds all its weights and the hidden activation at once
    # (counted once, though it is one matmul's output and the next one's input)
    total = max(local_bytes)
    if spec.family == "block":
        hidden = parse_matmul(parts[1]).lhs.local_bytes(mesh, sizes, dtype)
        total = sum(local_bytes) - hidden
    held = {"total": total, "hbm_bytes": chip.hbm_bytes}
    return ProgramEstimate(plan.program, chip.name, step, tuple(ops), "sharded-matmul engine", flops, held)


def estimate_program(plan: Plan, chip: Chip) -> ProgramEstimate:
    """Price the Plan's program on ``chip`` as named ops (module docstring).

    Raises:
        UserError: the estimators cannot describe this Plan (naming why).
    """
    if plan.program == "train_step":
        return _train(plan, chip)
    if plan.program == "decode":
        return _decode(plan, chip)
    if plan.program == "serve":
        return _serve(plan, chip)
    if plan.spec.family == "user":
        raise UserError(
            f"{plan.name or plan.program}: the estimators describe the lab's own programs, not a user model; run or "
            "audit it to see its compiled ops priced by the roofline"
        )
    return _kernel(plan, chip)


def memory_warning(plan: Plan, est: ProgramEstimate, chip: Chip) -> str | None:
    """One line with the numbers when the estimate says the Plan does not fit the chip's memory."""
    if est.fits is not False:
        return None
    total, hbm = est.memory["total"], est.memory["hbm_bytes"]
    return (
        f"{plan.name}: the estimator puts {total / 2**30:.2f} GiB per device on {chip.name}, which has "
        f"{hbm / 2**30:.2f} GiB; shard more (a larger mesh axis in the rules), shrink the sizes, or price another chip"
    )


__all__ = [
    "COLLECTIVE_KINDS",
    "ExpectedCollective",
    "OpEstimate",
    "ProgramEstimate",
    "estimate_program",
    "infer_config",
    "memory_warning",
    "train_config",
]
