"""Estimates of the kernels over named mesh axes: ring attention (``context``), the MoE MLP (``expert``) and the
pipelined MLP (``pipe``), each priced per device as its compiled program runs (kernels/ring_attention.py,
kernels/moe.py, kernels/pipeline.py), with the collectives the audit expects of it.
"""

from __future__ import annotations

from lab.core.hardware import Chip
from lab.core.plan import Plan
from lab.core.programs import MOE_CAPACITY_FACTOR, MOE_TOPK, pipeline_split
from lab.core.units import dtype_bytes
from lab.predict.axis_costs import bubble_fraction, moe_exchange_bytes, moe_slots, ring_kv_block_bytes, ring_passes
from lab.predict.program.ops import OpEstimate, ProgramEstimate, collective_op, live
from lab.predict.roofline import roofline


def ring_attention(plan: Plan, chip: Chip) -> ProgramEstimate:
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
        passes = ring_passes(c)  # forward only: this program is one attention call
        kv = passes * ring_kv_block_bytes(bl * tl, h, d, b)
        ops.append(collective_op("permute", ("context",), kv, dtype, chip, plan, name, passes))
    compute = ops[0].time_s
    comm = sum(o.time_s for o in ops[1:])
    # q, k, v, out; the stacked K and V held and the one arriving; one block's scores; the running state
    held = {"total": 8 * block + scores + acc + 2 * bl * h * tl * 4, "hbm_bytes": chip.hbm_bytes}
    note = "every block is computed (future blocks' updates dropped by a select): the causal saving is not realised"
    return ProgramEstimate(
        plan.program, chip.name, max(compute, comm), tuple(ops), "ring-attention model", flops, held, (note,)
    )


def moe_mlp(plan: Plan, chip: Chip) -> ProgramEstimate:
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
    slots = moe_slots(t, e, MOE_TOPK, MOE_CAPACITY_FACTOR)  # the send buffer's rows, and the local experts' rows
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
    sf = plan.sizes.get("S", 0) * f  # moe_shared_mlp: the shared experts, one SwiGLU of width S F on every token
    if sf:
        # the three [D, S F] weights read; x read twice; float32 gate and up written and read; the activation
        # written and read; the output written
        shared_flops = 3 * 2 * t * d * sf
        shared_hbm = 3 * d * sf * b + 2 * t * d * b + t * sf * (4 * 4 + 2 * b) + t * d * b
        cost = roofline(chip, shared_flops, shared_hbm, dtype, op="moe/shared")
        ops.append(OpEstimate("moe/shared", "matmul", cost.time_s, shared_flops, shared_hbm, scope="moe/shared"))
    if n > 1:
        for stage in ("dispatch", "combine"):
            name = f"{stage} [E, C, D] over expert"
            v = moe_exchange_bytes(n, t, MOE_TOPK, d, b, MOE_CAPACITY_FACTOR, experts=e)
            ops.append(collective_op("all-to-all", ("expert",), v, dtype, chip, plan, name))
    # x and out; the router and the local experts' weights; the send and received buffers both ways; the float32
    # gate and up and the activation of every slot
    weights = d * e * b + 3 * (e // n) * d * f * b + 3 * d * sf * b
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
        router_flops + expert_flops + (shared_flops if sf else 0),
        held,
        (note,),
    )


def pipeline_mlp(plan: Plan, chip: Chip) -> ProgramEstimate:
    """The pipelined MLP's GPipe train step (kernels/pipeline.py) per device: M + p - 1 steps of one stage's layers,
    forward and backward, the activations passed down the pipe and their cotangents back, the gradients summed.

    With ``p`` stages on ``pipe``, ``Lmax`` layers per stage (the even split ``L / p``: a Plan carries no other) and
    ``b = B / (data * M)`` rows per microbatch. FLOPs: a block is two matmuls of ``2 * b * D * F`` forward and four
    backward (the input's and each weight's gradient), ``12 * b * D * F``; every stage runs its ``Lmax`` layers in
    every one of the ``M + p - 1`` steps, the ``p - 1`` idle ones included (they compute on zeros, and the compiled
    program computes them: which steps are idle depends on the device), padding layers too. Less one matmul per step
    in which nothing was received (step 0; every step when ``p = 1``): there the input gradient of the stage's first
    layer goes nowhere and XLA drops it. So ``12 * b * D * F * Lmax * (M + p - 1) - 2 * b * D * F * (M if p = 1,
    else 1)``. The bubble ``(p - 1) / (M + p - 1)`` is the fraction of those steps a stage idles (its note).

    Collectives: ``M + p - 2`` collective-permutes over ``pipe`` of one ``[b, D]`` activation each (none after the
    last step), and in the backward their transposes, as many of the ``[b, D]`` cotangents; the weights' gradients
    (the local ``[Lmax, D, F]`` and ``[Lmax, F, D]``, padding included) summed over ``data`` by one AllReduce (data
    parallelism); the float32 loss summed over ``data`` and ``pipe`` by a scalar AllReduce. Time: each step's pass
    waits for its compute and the next step waits for the pass, so compute and communication add. Compute is priced
    by the roofline on the HBM traffic below.
    """
    plan.validate(executable=False)  # B, D, F, L, M; L over pipe, B over data x M (a UserError naming them)
    mesh, dtype = plan.shape, plan.dtype
    nbytes = dtype_bytes(dtype)
    bt, d, f, n_layers, m = (plan.sizes[k] for k in ("B", "D", "F", "L", "M"))
    data, p = mesh.get("data", 1), mesh.get("pipe", 1)
    v = plan.sizes.get("V", 1)  # chunks per stage: the circular schedule (pipeline_circular)
    circular = plan.program == "pipeline_circular"
    lmax = n_layers // (p * v) if circular else max(pipeline_split(plan.program, n_layers, p))
    b, steps = bt // (data * m), m * v + p - 1
    flops = 12 * b * d * f * lmax * steps - 2 * b * d * f * (m if p == 1 else 1)
    # HBM per layer and step, in elements: forward reads h and both weights and writes and reads the pre-activation
    # and gelu [b, F]; backward reads the weights again, reads and writes both weight gradients, and moves the
    # [b, F] and [b, D] cotangents. Circular: in a step whose stages span two repeats each weight is selected from
    # two chunks (read both, write one) and its gradient split back (read one, write two)
    hbm = lmax * steps * (8 * d * f + 8 * b * f + 5 * b * d) * nbytes
    if circular:
        hbm += lmax * _two_repeat_steps(p, m, v) * 12 * d * f * nbytes
    cost = roofline(chip, flops, hbm, dtype, op="pipeline/stage")
    ops = [OpEstimate("pipeline/stage", "matmul", cost.time_s, flops, hbm, scope="pipeline/stage")]
    if p > 1:
        act = b * d * nbytes
        for what in ("activation passes down", "cotangent passes back up"):
            name = f"{steps - 1} [b, D] {what} the pipe" + (", round the ring" if circular else "")
            ops.append(collective_op("permute", ("pipe",), (steps - 1) * act, dtype, chip, plan, name, steps - 1))
    if data > 1:
        grads = 2 * v * lmax * d * f * nbytes
        ops.append(collective_op("all-reduce", ("data",), grads, dtype, chip, plan, "weight gradients over data"))
    loss_axes = live(("data", "pipe"), mesh)
    if loss_axes:
        ops.append(collective_op("all-reduce", loss_axes, 4, "fp32", chip, plan, "the loss (a float32 scalar)"))
    return _pipeline_estimate(plan, chip, ops, flops, lmax, steps, m, p, v, b)


def _two_repeat_steps(p: int, m: int, v: int) -> int:
    """Steps of the circular schedule whose stages run two different repeats (kernels/pipeline_circular.py: item
    ``j`` is at repeat ``(j // p) mod v``; stage ``i`` works on item ``s - i`` in step ``s``)."""
    n = m * v
    return sum(len({((s - i) // p) % v for i in range(p) if 0 <= s - i < n}) > 1 for s in range(n + p - 1))


def _pipeline_estimate(plan: Plan, chip: Chip, ops: list, flops, lmax, steps, m, p, v, b) -> ProgramEstimate:
    """The pipelined MLP's estimate from its ops: the bubble noted, the memory it holds."""
    mesh, nbytes = plan.shape, dtype_bytes(plan.dtype)
    bt, d, f = (plan.sizes[k] for k in ("B", "D", "F"))
    data = mesh.get("data", 1)
    bubble = bubble_fraction(p, m, v)  # (p - 1) / (V M + p - 1), as the training estimator prices a pipeline
    kind, formula = ("GPipe", "(p-1)/(M+p-1)") if v == 1 else (f"circular (V={v})", "(p-1)/(V M+p-1)")
    note = (
        f"{kind} bubble {formula} = {p - 1}/{steps} = {bubble:.4f}: each stage idles {p - 1} of {steps} steps "
        "on zeros; the FLOPs count every step, forward and backward, idle ones included"
    )
    if m < p:
        note += f"; fewer microbatches (M={m}) than stages (p={p}): at least half of every stage's steps idle"
    # the weights, their gradients and the updated weights; x; each layer-step's input and pre-activation, saved
    # for the backward
    held = 6 * v * lmax * d * f * nbytes + bt // data * d * nbytes + steps * lmax * b * (d + f) * nbytes
    if v > 1:  # the weights selected in a step that spans two repeats, saved for the backward
        held += _two_repeat_steps(p, m, v) * lmax * 2 * d * f * nbytes
    return ProgramEstimate(
        plan.program,
        chip.name,
        sum(o.time_s for o in ops),
        tuple(ops),
        "pipeline model",
        flops,
        {"total": held, "hbm_bytes": chip.hbm_bytes},
        (note,),
        {"bubble": bubble, "steps": steps, "layers_per_stage": lmax},
    )


AXIS_ESTIMATES = {"attention": ring_attention, "moe": moe_mlp, "pipeline": pipeline_mlp}

__all__ = ["AXIS_ESTIMATES", "moe_mlp", "pipeline_mlp", "ring_attention"]
