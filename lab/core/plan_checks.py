"""The checks of a train-step Plan whose rules put the layers, the sequence or the experts on mesh axes: what the
lab's Transformer runs of pipeline, context and expert parallelism (``kernels/transformer``), refused with a message
naming the value and a valid one before anything compiles. Called by :meth:`lab.core.plan.Plan.validate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab.core.errors import UserError
from lab.core.rules import FIELDS, PRESETS, ShardingRules

Plan = Any  # a lab.core.plan.Plan (which imports this module)


def pipeline(plan: Plan) -> None:
    """What the lab's pipelined train step (``layers`` on a mesh axis) runs: GPipe on one mesh axis that splits
    nothing else, whole microbatches (``kernels.transformer.loss.pipelined_loss``)."""
    rules = plan.rules
    assert rules is not None
    axes = rules.live("layers", plan.shape)
    split = plan.options.stage_split
    if not axes:
        if split:
            raise UserError(
                f"stage_split = {list(split)} splits pipeline stages, and the rules put no mesh axis on layers; "
                'add layers = "<axis>" to [rules], or leave stage_split out'
            )
        return
    if plan.model is not None and plan.model.is_moe and plan.model.dense_layers:
        raise UserError(
            f"[rules] layers = {list(axes)} with dense-layers={plan.model.dense_layers}: the lab pipelines one stack "
            "of like layers; leave layers out, or the leading dense layers (the estimator prices both)"
        )
    if plan.program != "train_step":
        raise UserError(f"[rules] layers = {list(axes)}: {plan.program} runs unpipelined; leave layers out")
    if len(axes) > 1:
        raise UserError(f"[rules] layers = {list(axes)}: the lab pipelines over one mesh axis; name one")
    others = [f for f in FIELDS if f != "layers" and axes[0] in rules.axes(f)]
    if others:
        raise UserError(
            f"[rules] layers = {axes[0]!r} and {others[0]} = {rules.axes(others[0])!r}: the pipeline's axis holds "
            "stages only; give the other dim another axis"
        )
    sched, v = plan.options.pp_schedule, plan.options.interleave
    if sched not in ("gpipe", "interleaved"):
        raise UserError(
            f'pp_schedule = "{sched}": the lab\'s pipelined train step runs GPipe and the circular schedule; '
            'give [options] pp_schedule = "gpipe" or "interleaved" (the estimator prices 1f1b too)'
        )
    p, layers = plan.shape[axes[0]], plan.model.layers if plan.model is not None else 0
    if split and (len(split) != p or sum(split) != layers):
        even = [layers // p + (1 if i < layers % p else 0) for i in range(p)]
        raise UserError(
            f"stage_split = {list(split)} must give each of the {p} stages of '{axes[0]}' its layers, "
            f"{layers} in all (it has {len(split)} entries adding up to {sum(split)}); e.g. {even}"
        )
    if split and sched == "interleaved":
        raise UserError("stage_split with the interleaved schedule is priced, not run; give one of them")
    if sched == "interleaved" and layers % (p * v):
        raise UserError(
            f"layers={layers} do not cut into {p} stages x interleave {v} = {p * v} chunks; "
            f"give a multiple of {p * v} layers or another interleave"
        )
    deg, batch, mb = plan.degrees(), plan.sizes["batch"], plan.options.microbatch
    replicas = deg["dp"] * deg["fsdp"]
    if mb is not None and (batch % replicas or (batch // replicas) % mb):
        raise UserError(
            f"[options] microbatch = {mb} does not divide the {batch} // {replicas} = {batch // replicas} "
            f"sequences of each data-parallel replica; give a divisor, e.g. microbatch = 1"
        )
    m = plan.microbatches()
    if sched == "interleaved" and m % p:
        raise UserError(
            f"the circular schedule takes microbatches in groups of the {p} stages; {m} microbatches is not a "
            f"multiple of {p}: give [options] microbatch so that each replica's batch makes {p * max(1, m // p)}"
        )
    if (batch // m) % rules.size("batch", plan.shape):
        raise UserError(
            f"batch={batch} in {m} microbatches of {batch // m}: a microbatch must split over the batch axes "
            f"({', '.join(rules.live('batch', plan.shape))}); give a larger microbatch"
        )


def context(plan: Plan) -> None:
    """What the lab's context-parallel train step (``context`` on mesh axes) runs: the sequence split evenly
    over the context axes (and the sequence-parallel ones between blocks), without a pipeline."""
    rules = plan.rules
    assert rules is not None
    ctx = rules.live("context", plan.shape)
    if not ctx:
        return
    if plan.program != "train_step":
        raise UserError(f"[rules] context = {list(ctx)}: {plan.program} runs unsplit along T; leave context out")
    if rules.live("layers", plan.shape):
        raise UserError(
            "[rules] context and pipeline (layers) together are priced by the estimator, not run by the lab yet; "
            "give one of them"
        )
    axes = (*ctx, *rules.live("sequence", plan.shape))
    n, seq = rules.size("context", plan.shape) * rules.size("sequence", plan.shape), plan.sizes["seq"]
    if seq % n:
        raise UserError(
            f"seq={seq} does not split over the context axes {' x '.join(axes)} ({n}); "
            f"use a multiple of {n}, e.g. seq={max(n, seq // n * n)}"
        )


def experts(plan: Plan) -> None:
    """What the lab's expert-parallel Transformer runs (``kernels.transformer.moe_layer``): a mixture of experts
    whose experts' axes also split the batch (expert parallelism carved out of data parallelism), unpipelined."""
    rules, m = plan.rules, plan.model
    assert rules is not None and m is not None
    ep = rules.live("experts", plan.shape)
    if not ep:
        return
    if not m.is_moe:
        raise UserError(
            f"[rules] experts = {list(ep)}: model {m.name!r} is dense; give [model] experts (and "
            "experts_per_token) or leave experts out"
        )
    batch = rules.axes("batch")
    if any(a not in batch for a in ep):
        fix = [*batch, *(a for a in ep if a not in batch)]
        raise UserError(
            f"[rules] experts = {list(ep)} must also split the batch (batch = {list(batch)}): the lab carves "
            f"expert parallelism out of data parallelism; e.g. batch = {fix}"
        )
    if rules.live("layers", plan.shape):
        raise UserError(
            "[rules] experts and pipeline (layers) together are priced by the estimator, not run by the lab yet; "
            "give one of them"
        )


def expert_count(plan: Plan) -> None:
    """A mixture of experts whose experts the rules split: their count divides over the axes (priced or run)."""
    rules, m = plan.rules, plan.model
    ep = rules.live("experts", plan.shape) if rules is not None else ()
    n = rules.size("experts", plan.shape) if ep else 1
    if m is not None and m.is_moe and m.experts % n:
        raise UserError(
            f"experts={m.experts} do not divide over the experts' mesh axes {' x '.join(ep)} ({n}); give a multiple "
            f"of {n}, e.g. experts = {max(n, m.experts // n * n)}"
        )


def explicit_mode(plan: Plan) -> None:
    """What the Transformer runs in JAX's explicit sharding mode (``sharding_mode = "explicit"``): its train step,
    unpipelined (``kernels/transformer/explicit.py``)."""
    if plan.options.sharding_mode != "explicit":
        return
    if plan.program != "train_step":
        raise UserError(
            f'sharding_mode = "explicit" applies to the Transformer\'s train_step; {plan.program} runs in auto mode '
            '(leave sharding_mode out, or give sharding_mode = "auto")'
        )
    assert plan.rules is not None
    explicit_rules(plan.rules, plan.shape, plan.rules_preset)


def explicit_rules(rules: ShardingRules, shape: Mapping[str, int], preset: str | None = None) -> None:
    """Rules the train step runs with ``AxisType.Explicit`` mesh axes: every preset, with experts, context axes or
    an attention kernel too; not a pipeline (JAX 0.10.2 cannot transpose the vocab-parallel embedding lookup inside
    the stages' ``shard_map`` when explicit axes remain there: "Closing over inputs to shard_map where the input is
    sharded on `Explicit` axes is not implemented")."""
    axes = rules.live("layers", shape)
    if axes:
        named = f"rules preset {preset!r} with " if preset else ""
        raise UserError(
            f'sharding_mode = "explicit" does not run a pipeline ({named}layers = {list(axes)}); explicit mode runs '
            f'the presets {", ".join(PRESETS)} unpipelined: leave layers out, or give sharding_mode = "auto"'
        )


__all__ = ["context", "expert_count", "experts", "explicit_mode", "explicit_rules", "pipeline"]
