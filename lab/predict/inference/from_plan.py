"""The inference estimator's config of a decode or serve Plan: the one place a Plan's parallelism becomes
:class:`~lab.predict.inference.estimate.InferConfig`'s ``tp``, ``dp`` and ``ep``.

Every serving layout is described as a Plan first, as training's is (``lab.predict.training.from_plan``): an
experiment file's decode or serve Plan, ``infer estimate``'s and ``infer serve``'s flags, a published serving run, the
studies' sweeps over the tensor-parallel degree. :func:`serving_plan` makes the decode Plan of a set of degrees (its
mesh axes and rules by :func:`lab.core.plan_degrees.plan_from_degrees`, the one way degrees become a Plan), and
:func:`infer_config` reads the degrees back (:func:`serving_degrees`) with the model, the batch and the program's
form; what the serving stack does that a Plan does not describe (storage and compute dtypes past the Plan's two,
the efficiency model, a stack's all-reduce or per-step overhead) the caller gives as the config's own fields.
"""

from __future__ import annotations

import dataclasses

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.core.plan import Options, Plan
from lab.core.plan_degrees import plan_from_degrees
from lab.predict.inference.estimate import InferConfig
from lab.predict.training.from_plan import check_estimable

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def fill_degrees(
    chips: int, tp: int | None, dp: int | None, ep: int | None = None, *, ep_flag: bool = False
) -> tuple[int, int, int]:
    """``(tp, dp, ep)`` over ``chips`` with the one left out filled: generation shards the model, not the batch
    (inference.md), so with neither given every chip not an expert's goes to tensor parallelism. ``ep_flag``: the
    command has ``--ep`` (the error names it).

    Raises:
        UserError: the degrees do not multiply to ``chips``, naming the flags given.
    """
    e = ep or 1
    t, d = tp, dp
    if t is None:
        t = chips // (e * (d or 1)) if chips % (e * (d or 1)) == 0 else 0
    if d is None:
        d = chips // (t * e) if t and chips % (t * e) == 0 else 0
    if not t or not d or t * d * e != chips:
        flags = "--tp x --dp" + (" x --ep" if ep_flag else "")
        given = ", ".join(f"{k}={v}" for k, v in (("tp", tp), ("dp", dp), ("ep", ep)) if v is not None)
        raise UserError(f"{flags} must equal --chips {chips}; got {given or 'none'} (leave one out to fill the rest)")
    return t, d, e


def serving_plan(
    model: ModelConfig,
    *,
    batch: int,
    tp: int = 1,
    dp: int = 1,
    ep: int = 1,
    prefill_len: int | None = None,
    generate: int | None = None,
    hardware: str = "calibrated",
    dtype: str = "bf16",
) -> Plan:
    """The decode Plan of a serving layout, in the book's form (inference.md): ``dp`` replicas of ``tp x ep`` chips,
    attention and dense layers tensor-parallel over ``tp`` (kv_heads too where they divide), the experts over ``ep``
    with the batch split over replicas and expert ranks, the embedding and logits replicated, attention fused."""
    degrees = {"dp": dp * ep, "tp": tp, "ep": ep}
    plan = plan_from_degrees(
        model, hardware=hardware, batch=batch, seq_len=1, **degrees, dtype=dtype, param_dtype=dtype, remat="none",
        options=Options(flash_attention=True), name=f"{model.name}-decode",
    )  # fmt: skip
    assert plan.rules is not None
    sizes = {"batch": batch} | {k: v for k, v in (("prompt_len", prefill_len), ("steps", generate)) if v is not None}
    return dataclasses.replace(plan, program="decode", sizes=sizes, rules=dataclasses.replace(plan.rules, vocab=None))


def serving_degrees(plan: Plan) -> tuple[int, int, int]:
    """``(tp, dp, ep)`` of a decode or serve Plan as the inference estimator counts them: the heads' axes; the batch's
    axes (data and fsdp alike) over the expert ranks as replicas; the experts' axes."""
    deg = plan.degrees()
    ep = deg["ep"]
    replicas, rest = divmod(deg["dp"] * deg["fsdp"], ep)
    if rest:
        raise UserError(f"experts over {ep} chips do not divide the batch's {deg['dp'] * deg['fsdp']}-way split")
    return deg["tp"], replicas, ep


def infer_config(plan: Plan, chip: Chip, **stack: Any) -> InferConfig:
    """The inference estimator's config of a decode Plan (a serve Plan's caller gives ``batch`` and ``context``):
    the model, the degrees, the batch, prompt and generated tokens, the Plan's dtypes (weights ``param_dtype``, cache
    and compute ``dtype``) and its program's form (a vocab-parallel embedding, fused attention), priced under the
    efficiency model and at the model's whole context unless ``stack`` says otherwise; ``stack``: the config's
    other fields, as the caller prices them."""
    check_estimable(plan)
    m, z = plan.model, plan.sizes
    assert m is not None and plan.rules is not None
    tp, dp, ep = serving_degrees(plan)
    base: dict[str, Any] = {
        "batch": z.get("batch"),
        "context": m.max_seq_len,
        "weights": plan.param_dtype,
        "kv": plan.dtype,
        "compute": plan.dtype,
        "prefill_len": z.get("prompt_len"),
        "generate": z.get("steps"),
        "achievable": True,
        "vocab_parallel": bool(plan.rules.live("vocab", plan.shape)),
        "flash_attention": plan.options.flash_attention,
    }
    return InferConfig(model=m, chip=chip, tp=tp, dp=dp, ep=ep, **(base | stack))


__all__ = ["fill_degrees", "infer_config", "serving_degrees", "serving_plan"]
