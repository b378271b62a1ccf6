"""A train-step Plan from the estimators' parallel degrees (flags, or a planner result): the one way degrees become a
Plan's mesh axes and rules (the reverse of :meth:`lab.core.plan.Plan.degrees`); a serving layout's decode Plan is
made from one (``lab.predict.inference.from_plan.serving_plan``)."""

from __future__ import annotations

import math

from lab.core.errors import UserError
from lab.core.models import ModelConfig
from lab.core.plan import Options, Plan, make_mesh_axes
from lab.core.rules import ShardingRules
from lab.core.units import canonical_dtype

ROLE_AXES = {"pp": "pipe", "dp": "data", "fsdp": "fsdp", "cp": "context", "tp": "model"}


def plan_from_degrees(
    model: ModelConfig,
    *,
    hardware: str,
    batch: int,
    seq_len: int,
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    param_dtype: str = "bf16",
    remat: str = "selective",
    optimizer: str = "adam",
    options: Options | None = None,
    slow: tuple[str, ...] = (),
    name: str = "",
) -> Plan:
    """A train-step Plan from the estimators' parallel degrees (flags, or a planner result).

    Axes are named after their role, major to minor ``pipe, data, fsdp, context, model`` (tensor parallelism
    innermost, pipeline outermost, as the estimator places them); expert parallelism is carved out of the fsdp (else
    the data) axis as an ``expert`` axis, or out of both (``expert_dp`` from data) where it divides neither.
    ``slow`` names roles whose axes cross the slow link. Without ``options`` the Plan is the lab's Transformer as it
    compiles (:class:`Options`' defaults).
    """
    # the experts' ranks come out of fsdp (``expert`` in fsdp's shard group), else out of data; where ep divides
    # neither but their product, out of both: ``expert`` from fsdp and ``expert_dp`` from data
    e_fsdp = ep if fsdp % ep == 0 else (math.gcd(ep, fsdp) if dp % ep else 1)
    e_data = ep // e_fsdp
    if dp % e_data:
        raise UserError(f"ep={ep} divides neither dp={dp} x fsdp={fsdp}; the Plan cannot name its axis")
    order = (("pipe", pp), ("data", dp // e_data), ("expert_dp", e_data if e_fsdp > 1 else 1))
    order += (("expert", e_fsdp if e_fsdp > 1 else e_data), ("fsdp", fsdp // e_fsdp), ("context", cp))
    shape = {axis: size for axis, size in (*order, ("model", tp)) if size > 1}
    expert = tuple(a for a in ("expert_dp", "expert") if a in shape)
    in_shape = [a for a in ("data", "expert_dp", "expert", "fsdp") if a in shape]
    fsdp_axes = [a for a in (("expert", "fsdp") if e_fsdp > 1 else ("fsdp",)) if a in shape]
    rules = ShardingRules(
        batch=tuple(in_shape) or None,
        embed=tuple(fsdp_axes) or None,
        heads="model" if tp > 1 else None,
        kv_heads="model" if tp > 1 and model.kv_heads % tp == 0 else None,
        ffw="model" if tp > 1 else None,
        vocab="model" if tp > 1 else None,
        sequence="model" if sequence_parallel and tp > 1 else None,
        layers="pipe" if pp > 1 else None,
        context="context" if cp > 1 else None,
        experts=expert or None,
    )
    slow_axes = tuple(ROLE_AXES[r] for r in slow if ROLE_AXES.get(r) in shape)
    return Plan(
        program="train_step",
        mesh=make_mesh_axes(shape or {"data": 1}, slow_axes),
        sizes={"batch": batch, "seq": seq_len},
        name=name or f"{model.name}-train",
        hardware=hardware,
        dtype=canonical_dtype(dtype),
        param_dtype=canonical_dtype(param_dtype),
        model=model,
        rules=rules,
        remat=remat,
        optimizer=optimizer,
        options=options or Options(),  # the lab's Transformer as it compiles (Options' defaults)
    )


__all__ = ["ROLE_AXES", "plan_from_degrees"]
