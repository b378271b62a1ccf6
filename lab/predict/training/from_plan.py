"""The training estimator's config of a train-step Plan: the one place a Plan's degrees and options become the
estimator's :class:`~lab.predict.training.config.Layout` and :class:`~lab.predict.training.config.TrainConfig`, for a
Plan read from an experiment file, a planner's layout, ``train estimate``'s flags or a published run (each read into
its estimator's terms, checked, then made a Plan by :func:`job_plan`). A module of its own so the analytic command
imports the Plan and this, not the program estimator's op tables."""

from __future__ import annotations

from lab.core.attention import BLOCK_KERNELS, from_options
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.plan import Options, Plan
from lab.core.plan_degrees import plan_from_degrees
from lab.predict.training.config import Layout, TrainConfig


def check_estimable(plan: Plan) -> None:
    """The estimators describe tensor parallelism as one group splitting heads, kv_heads, ffw (and vocab)."""
    r = plan.rules
    assert r is not None
    tp = set(r.live("heads", plan.shape))
    for dim in ("ffw", "kv_heads", "vocab"):
        got = set(r.live(dim, plan.shape))
        if got and got != tp:
            raise UserError(
                f"[rules] {dim} = {sorted(got)} and heads = {sorted(tp)}: the estimators price tensor parallelism "
                "as one group of mesh axes splitting heads, kv_heads, ffw and vocab; give them the same axes"
            )
    if set(r.live("sequence", plan.shape)) - tp:
        raise UserError("[rules] sequence: sequence parallelism must use the tensor-parallel (heads) axes")


def train_config(plan: Plan, chip: Chip) -> TrainConfig:
    """The training estimator's config of a train-step Plan: degrees from its rules, options from its program."""
    check_estimable(plan)
    deg, opts = plan.degrees(), plan.options
    slow = tuple(role for role, link in plan.role_links().items() if link == "slow")
    layout = Layout(
        **deg,
        zero=opts.zero,
        pp_schedule=opts.pp_schedule,
        interleave=opts.interleave,
        stage_split=opts.stage_split,
        cross_node=slow,
        cp_in_dp=not opts.spmd_context,  # the lab's Transformer sums the context shards' gradients apart
        zero_shard=opts.zero_shard,
        pp_embedding_slots=opts.pp_embedding_slots,
    )
    batch, replicas = plan.sizes["batch"], deg["dp"] * deg["fsdp"]
    assert plan.model is not None
    att = from_options(opts)
    return TrainConfig(
        model=plan.model,
        chip=chip,
        layout=layout,
        seq_len=plan.sizes["seq"],
        global_batch=batch,
        microbatch=opts.microbatch or max(1, batch // replicas),
        remat=plan.remat,
        checkpoints_per_layer=opts.checkpoints_per_layer,
        dtype=plan.dtype,
        optimizer=plan.optimizer,
        flash_attention=opts.flash_attention or att.fused,  # a kernel keeps no score matrix
        pallas_blocks=(att.block_q, att.block_k) if att.impl in BLOCK_KERNELS else None,
        causal=opts.causal,
        param_dtype=plan.param_dtype,
        fused_projections=opts.fused_projections,
        cast_first=opts.cast_first,
        cast_first_out_table=opts.cast_first_out_table,
        jax_remat=opts.jax_remat,
        remat_regathers_norms=opts.regather_norms,
        spmd_pipeline=opts.spmd_pipeline and opts.pp_schedule in ("gpipe", "interleaved"),  # what the lab runs
        spmd_context=opts.spmd_context,
        capacity_factor=opts.capacity_factor or _lab_capacity(plan.model.is_moe),
        moe_partial_router=plan.model.is_moe and opts.moe_partial_router,
        attention_kernel=opts.attention_kernel,
        elementwise=opts.elementwise,
        tp_comm_overlap=opts.tp_comm_overlap,
        dp_overlap=opts.dp_overlap,
        dp_bucket_bytes=opts.dp_bucket_mb * 2**20,
        grad_reduce=opts.grad_reduce,
    )


def job_plan(cfg: TrainConfig) -> Plan:
    """A job in the estimator's terms as a Plan: its degrees on named mesh axes (the roles known to cross the slow
    link on the slow one) and every option it sets (Megatron's program, as ``train estimate`` prices by default),
    from which :func:`train_config` makes the config back whole."""
    lay = cfg.layout
    options = Options(
        microbatch=cfg.microbatch,
        zero=lay.zero,
        pp_schedule=lay.pp_schedule,
        interleave=lay.interleave,
        stage_split=lay.stage_split,
        checkpoints_per_layer=cfg.checkpoints_per_layer,
        flash_attention=cfg.flash_attention,
        fused_projections=cfg.fused_projections,
        causal=cfg.causal,
        cast_first=cfg.cast_first,
        cast_first_out_table=cfg.cast_first_out_table,
        regather_norms=cfg.remat_regathers_norms,
        jax_remat=cfg.jax_remat,
        spmd_pipeline=cfg.spmd_pipeline,
        spmd_context=cfg.spmd_context,
        moe_partial_router=cfg.moe_partial_router,
        # how another stack runs it: recorded, priced by train estimate --plan (shardlab run refuses them)
        zero_shard=lay.zero_shard,
        pp_embedding_slots=lay.pp_embedding_slots,
        attention_kernel=cfg.attention_kernel,
        elementwise=cfg.elementwise,
        tp_comm_overlap=cfg.tp_comm_overlap,
        dp_overlap=cfg.dp_overlap,
        dp_bucket_mb=cfg.dp_bucket_bytes / 2**20,
        capacity_factor=cfg.capacity_factor if cfg.model.is_moe or cfg.capacity_factor != 1.0 else None,
        grad_reduce=cfg.grad_reduce,
    )
    return plan_from_degrees(
        cfg.model,
        hardware=cfg.chip.name,
        batch=cfg.global_batch,
        seq_len=cfg.seq_len,
        **lay.degrees(),
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        remat=cfg.remat,
        optimizer=cfg.optimizer,
        options=options,
        slow=lay.cross_node,
    )


def _lab_capacity(moe: bool) -> float:
    """The lab's expert routing's capacity factor (kernels.moe); 1.0 for a dense model."""
    if not moe:
        return 1.0
    from lab.core.programs import MOE_CAPACITY_FACTOR  # the program table: only a mixture of experts reads it

    return MOE_CAPACITY_FACTOR


__all__ = ["check_estimable", "job_plan", "train_config"]
