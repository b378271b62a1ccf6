"""The estimate of a Plan's program: one cost model, as named ops, for the audit and the ledger.

:func:`estimate_program` prices whatever a :class:`lab.core.plan.Plan` runs on one chip:

* the Transformer's **train step** with the training estimator (:mod:`lab.predict.training`), its layout
  derived from the Plan's rules and its options from how the lab's Transformer is written (fp32 weights,
  separate Q/K/V and gate/up projections, plain softmax attention, vocab-parallel embedding and loss);
* its **decode** (prefill, then one token per step, every step reading the whole allocated cache) with the
  inference estimator (:mod:`lab.predict.inference`);
* the **kernels** with the sharded-matmul engine (:mod:`lab.predict.sharded_matmul`) and the collective model;
  ring attention (:func:`_ring_attention`) and the MoE MLP (:func:`_moe_mlp`) with the roofline and the collective
  model.

The result is a list of :class:`OpEstimate` named like the kernels' ``jax.named_scope`` s (compute) or by what
they carry (collectives, each over the mesh axes of its parallelism). The compiled-program audit checks the
collectives of this list, byte for byte, against the HLO; the ledger joins every op to the compiled and measured
ops of the same scope; ``shardlab train estimate --plan`` prints the same list. One model, three consumers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.notation import parse_matmul
from lab.core.plan import Plan
from lab.core.programs import MOE_CAPACITY_FACTOR, MOE_TOPK, moe_capacity
from lab.core.units import dtype_bytes
from lab.predict.collectives import collective_time, over_axes
from lab.predict.inference import InferConfig, estimate_inference
from lab.predict.inference_ops import generate_ops
from lab.predict.roofline import roofline
from lab.predict.sharded_matmul import plan_sharded_matmul
from lab.predict.train_config import Layout, TrainConfig
from lab.predict.training import estimate, step_ops

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "permute")
# The lab's blocks name their two matmuls (kernels/blocks.py); the book's kernels leave theirs unscoped.
BLOCK_SCOPES = ("mlp/up", "mlp/down")


@dataclass(frozen=True)
class ExpectedCollective:
    """A collective the estimate says the program runs: kind, mesh axes, bytes (V summed over calls)."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    dtype: str
    op: str
    steps: int = 1  # issued as this many equal collectives (a ring schedule)


@dataclass(frozen=True)
class OpEstimate:
    """One named op of the estimate, on one device, for one run of the program.

    Attributes:
        name: the kernels' named scope (compute ops) or what a collective carries.
        kind: ``matmul``, ``attention``, ``elementwise`` or a collective kind.
        time_s: seconds per run on the Plan's chip.
        flops, bytes: FLOPs; HBM bytes (compute ops) or V summed over calls (collectives).
        calls: executions per run.
        axes: mesh axes a collective spans.
        scope: the named scope it joins in the compiled program (None: any op of its kind not otherwise joined).
        hidden: what a collective overlaps with, when the estimate hides it.
    """

    name: str
    kind: str
    time_s: float
    flops: float = 0.0
    bytes: float = 0.0
    calls: float = 1.0
    axes: tuple[str, ...] = ()
    dtype: str = ""
    scope: str | None = None
    hidden: str | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes"] = list(self.axes)
        return d


@dataclass(frozen=True)
class ProgramEstimate:
    """The estimate of one Plan on one chip (see the module docstring)."""

    program: str
    hardware: str
    step_time_s: float
    ops: tuple[OpEstimate, ...]
    source: str
    flops: float
    memory: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        if not self.memory:
            return None
        return self.memory["total"] <= self.memory["hbm_bytes"]

    def collectives(self) -> list[ExpectedCollective]:
        """What the audit checks: every collective op over live mesh axes."""
        return [
            ExpectedCollective(o.kind, o.axes, o.bytes, o.dtype or "fp32", o.name, max(1, int(o.calls)))
            for o in self.ops
            if o.is_collective and o.axes and o.bytes > 0
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "hardware": self.hardware,
            "step_time_s": self.step_time_s,
            "source": self.source,
            "flops": self.flops,
            "memory": self.memory,
            "fits": self.fits,
            "notes": list(self.notes),
            "ops": [o.to_dict() for o in self.ops],
        }


# ----- the Transformer -------------------------------------------------------------------------------------------


def _check_estimable(plan: Plan) -> None:
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
    _check_estimable(plan)
    deg, opts = plan.degrees(), plan.options
    slow = tuple(role for role, link in plan.role_links().items() if link == "slow")
    layout = Layout(
        dp=deg["dp"],
        fsdp=deg["fsdp"],
        tp=deg["tp"],
        pp=deg["pp"],
        cp=deg["cp"],
        ep=deg["ep"],
        zero=opts.zero,
        sequence_parallel=deg["sequence_parallel"],
        pp_schedule=opts.pp_schedule,
        interleave=opts.interleave,
        cross_node=slow,
    )
    batch, replicas = plan.sizes["batch"], deg["dp"] * deg["fsdp"]
    assert plan.model is not None
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
        flash_attention=opts.flash_attention,
        causal=opts.causal,
        param_dtype=plan.param_dtype,
        fused_projections=opts.fused_projections,
    )


def infer_config(plan: Plan, chip: Chip) -> InferConfig:
    """The inference estimator's config of a decode Plan: the program reads the whole allocated cache each step."""
    _check_estimable(plan)
    deg, m = plan.degrees(), plan.model
    assert m is not None and plan.rules is not None
    return InferConfig(
        model=m,
        chip=chip,
        batch=plan.sizes["batch"],
        context=m.max_seq_len,
        tp=deg["tp"],
        dp=deg["dp"] * deg["fsdp"],
        weights=plan.param_dtype,
        kv=plan.dtype,
        compute=plan.dtype,
        prefill_len=plan.sizes["prompt_len"],
        generate=plan.sizes["steps"],
        achievable=True,
        vocab_parallel=bool(plan.rules.live("vocab", plan.shape)),
        flash_attention=plan.options.flash_attention,
    )


def _op(plan: Plan, d: dict[str, Any]) -> OpEstimate:
    kind = "permute" if d["kind"] == "collective-permute" else d["kind"]
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


def _live(axes: tuple[str, ...], mesh: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.get(a, 1) > 1)


def _collective_op(
    kind: str, axes: tuple[str, ...], v: float, dtype: str, chip: Chip, plan: Plan, name: str, steps: int = 1
) -> OpEstimate:
    mesh, where = plan.shape, over_axes(axes, plan.shape, plan.slow_axes)  # a slow axis: priced across nodes
    one = collective_time(kind, v / steps, [mesh[a] for a in axes], chip, **where).time_s
    return OpEstimate(name, kind, steps * one, bytes=v, calls=steps, axes=axes, dtype=dtype)


def _ring_attention(plan: Plan, chip: Chip) -> ProgramEstimate:
    """Ring attention (kernels/ring_attention.py) per device: c blocks of attention, c - 1 passes of K and V.

    FLOPs: each of the c blocks is two matmuls (scores ``q k^T`` and ``p v``) of ``2 * B/data * T/c * T/c * H * D``
    each, ``4 * B/data * T/c * T * H * D`` in all. That is non-causal attention's work, not half of it: the kernel
    drops a future block's update with a select, so the compiled dots still compute every block (which blocks lie
    in the future depends on the device), and the causal saving is not realised; the estimate counts what is
    compiled. Collective: K and V travel stacked as one ``[2, B/data, T/c, H, D]`` block, so each of the c - 1 ring
    steps is one collective-permute of ``2 * B/data * T/c * H * D`` elements (no combining or splitting to
    describe). Time: the pass of step s and the block computation of step s read only the block held, so they can
    run at once (asynchronous collective-permutes on TPU and GPU): the step is max(compute, comm), as for the
    collective matmuls. Compute is priced by the roofline on the HBM traffic of this unfused kernel (below).
    """
    plan.validate(executable=False)  # its sizes B, T, H, D, whole over data and context (a UserError naming them)
    mesh, dtype = plan.shape, plan.dtype
    b = dtype_bytes(dtype)
    bt, t, h, d = (plan.sizes[k] for k in ("B", "T", "H", "D"))
    c = mesh.get("context", 1)
    bl, tl = bt / mesh.get("data", 1), t / c
    block = bl * tl * h * d * b  # one of q, k, v or out on one device
    acc = bl * tl * h * d * 4  # the float32 running output
    scores = bl * h * tl * tl * (4 + b)  # one block's float32 scores and its probabilities in the compute dtype
    flops = 4 * bl * tl * t * h * d
    # HBM per block: q, K, V read; scores and probabilities written and read once (the kernel is not fused: they
    # are materialised); the running output read and written. Then the output written once.
    hbm = c * (3 * block + 2 * scores + 2 * acc) + block
    cost = roofline(chip, flops, hbm, dtype, op="attention/ring")
    ops = [OpEstimate("attention/ring", "attention", cost.time_s, flops, hbm, scope="attention/ring")]
    if c > 1:
        name = f"{c - 1} ring steps of K, V over context"
        ops.append(_collective_op("permute", ("context",), (c - 1) * 2 * block, dtype, chip, plan, name, c - 1))
    compute = ops[0].time_s
    comm = sum(o.time_s for o in ops[1:])
    # q, k, v, out; the stacked K and V held and the one arriving; one block's scores; the running state
    held = {"total": 8 * block + scores + acc + 2 * bl * h * tl * 4, "hbm_bytes": chip.hbm_bytes}
    note = "every block is computed (future blocks' updates dropped by a select): the causal saving is not realised"
    return ProgramEstimate(
        plan.program, chip.name, max(compute, comm), tuple(ops), "ring-attention model", flops, held, (note,)
    )


def _moe_mlp(plan: Plan, chip: Chip) -> ProgramEstimate:
    """The MoE MLP (kernels/moe.py) per device: route t tokens, AllToAll them to the experts, run the experts,
    AllToAll the results back.

    With ``n`` devices on ``expert`` and ``t = T / (data * n)`` tokens per device, each expert has ``C = ceil(k * t
    * capacity_factor / E)`` slots in each device's send buffer (k and the factor: ``MOE_TOPK``,
    ``MOE_CAPACITY_FACTOR``, which the Plan cannot carry). FLOPs: the router matmul ``2 * t * D * E``, plus the
    experts' three matmuls (gate, up, down) of ``2 * D * F`` per slot over the ``n * C`` slots each of the ``E / n``
    local experts receives: ``6 * D * F * E * C``. That counts every slot the compiled program computes, padding
    included: the dots multiply all ``E * C`` slots whether a token fills them or not (an empty slot holds zeros),
    so the work is that of ``E * C >= k * t * capacity_factor`` slots (about the capacity factor times the ``k * t``
    assignments the router makes), not of the assignments alone. Collectives: dispatch and combine are one
    AllToAll over ``expert`` each, of the send buffer ``[E, C, D]`` a device holds before and after (``E * C * D``
    elements); in the collective model's convention (the array whole over the axis, as
    ``lab.compile.hlo.collectives`` reads an AllToAll: its operand times the group) that is ``V = n * E * C * D *
    dtype bytes`` each. Time: the four stages depend on each other (route, dispatch, experts, combine), so they
    add. Compute is priced by the roofline on the HBM traffic of the unfused stages (below).
    """
    plan.validate(executable=False)  # T, D, F, E; E whole over expert, T over data x expert (a UserError)
    mesh, dtype = plan.shape, plan.dtype
    b = dtype_bytes(dtype)
    t_all, d, f, e = (plan.sizes[k] for k in ("T", "D", "F", "E"))
    n = mesh.get("expert", 1)
    t = t_all // (mesh.get("data", 1) * n)
    c = moe_capacity(t, e, MOE_TOPK, MOE_CAPACITY_FACTOR)
    slots = e * c  # the send buffer's rows, and the rows the local experts receive
    buffer = slots * d * b
    router_flops = 2 * t * d * e
    expert_flops = 3 * 2 * d * f * slots
    # HBM: the router reads x and W_router and writes float32 logits; the experts read their weights and the
    # received slots (twice: gate and up), write and read float32 gate and up, write and read the activation, and
    # write their output.
    router_hbm = t * d * b + d * e * b + t * e * 4
    expert_hbm = 3 * (e // n) * d * f * b + 2 * buffer + slots * f * (4 * 4 + 2 * b) + buffer
    router = roofline(chip, router_flops, router_hbm, dtype, op="moe/router")
    experts = roofline(chip, expert_flops, expert_hbm, dtype, op="moe/experts")
    ops = [
        OpEstimate("moe/router", "matmul", router.time_s, router_flops, router_hbm, scope="moe/router"),
        OpEstimate("moe/experts", "matmul", experts.time_s, expert_flops, expert_hbm, scope="moe/experts"),
    ]
    if n > 1:
        for stage in ("dispatch", "combine"):
            name = f"{stage} [E, C, D] over expert"
            ops.append(_collective_op("all-to-all", ("expert",), n * buffer, dtype, chip, plan, name))
    # x and out; the router and the local experts' weights; the send and received buffers both ways; the float32
    # gate and up and the activation of every slot
    weights = d * e * b + 3 * (e // n) * d * f * b
    held = {"total": 2 * t * d * b + weights + 4 * buffer + slots * f * (8 + b), "hbm_bytes": chip.hbm_bytes}
    note = (
        f"top-{MOE_TOPK} routing, capacity factor {MOE_CAPACITY_FACTOR}: {slots} expert slots computed per device "
        f"for {MOE_TOPK * t} assignments (padding included)"
    )
    return ProgramEstimate(
        plan.program,
        chip.name,
        sum(o.time_s for o in ops),
        tuple(ops),
        "MoE model",
        router_flops + expert_flops,
        held,
        (note,),
    )


def _kernel(plan: Plan, chip: Chip) -> ProgramEstimate:
    spec, mesh, dtype = plan.spec, plan.shape, plan.dtype
    if spec.family == "attention":
        return _ring_attention(plan, chip)
    if spec.family == "moe":
        return _moe_mlp(plan, chip)
    b = dtype_bytes(dtype)
    sizes = dict(plan.sizes)
    ops: list[OpEstimate] = []
    if spec.family == "collective":
        kind = spec.name.removeprefix("collective_").replace("_", "-")
        ax = _live(tuple(plan.axes or mesh), mesh)
        g, n = math.prod(mesh[a] for a in ax), sizes["N"]
        v = {"all-gather": n * g, "reduce-scatter": n, "all-reduce": n, "all-to-all": n * g, "permute": n}[kind] * b
        if g > 1:
            ops.append(_collective_op(kind, ax, v, dtype, chip, plan, f"{kind} over {','.join(ax)}"))
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
                    _collective_op(
                        "permute", ("Y",), (y - 1) * chunk, dtype, chip, plan, f"{y - 1} ring steps over Y", steps=y - 1
                    )
                )
            continue
        for c in mp.collectives:
            axes = _live(c.axes, mesh)
            if axes:
                ops.append(_collective_op(c.kind, axes, c.bytes, dtype, chip, plan, c.describe()))
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
