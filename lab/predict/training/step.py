"""A training step's time from parts, each a function of what it depends on: the estimator's one step formula.

:func:`lab.predict.training.estimate.estimate` prices a step with :func:`step_parts`, and the layout planner
(:mod:`lab.predict.planner.layouts`) prices every point of its search with the same function, computing each part once
for all the points that share it:

* :class:`LayerCost` (``training.layer_cost``): one layer, and the logits, for one microbatch (what
  ``training.layer_key`` holds);
* :class:`LayoutTerms` (:func:`layout_terms`): the layout's stage layers and optimizer pass, and the data-parallel
  gradient reduction and loss mean (:func:`dp_times`);
* :class:`FsdpTerms` (:func:`fsdp_terms`): the layout's FSDP gathers and scatters, per layer and per microbatch;
* :class:`MicrobatchTerms` (:func:`microbatch_terms`): the microbatch count, the pipeline sends (:func:`pp_time`),
  the TP collectives once per microbatch (:func:`tp_microbatch_time`) and the bubble.

What each role's collectives depend on is :func:`lab.predict.training.comm.content_key` and
:func:`lab.predict.training.comm.layout_group`. The overlap rules are the module docstring's of
:mod:`lab.predict.training.estimate`.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from dataclasses import dataclass

from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.predict import efficiency as eff
from lab.predict.axis_costs import bubble_over_work
from lab.predict.placement import placement
from lab.predict.training.comm import Comm, collectives, layout_group
from lab.predict.training.config import UPDATE_BYTES, Layout, TrainConfig, reduces_each_microbatch
from lab.predict.training.memory import local_params


@dataclass(frozen=True)
class LayerCost:
    """One layer, one microbatch, one chip: seconds per phase and the communication it exposes.

    ``ops`` are ``(name, kind, forward s, backward s, forward FLOPs, forward bytes)``; ``recomputed`` names the
    ops the remat policy runs again in the backward pass; ``logits`` is the last stage's output projection and
    cross-entropy (forward and backward), which depends on the same tp, cp and microbatch.
    """

    fwd: float
    bwd: float
    recompute: float
    tp_comm: float
    ep_comm: float
    cp_exposed: float
    logits: float
    ops: tuple[tuple[str, str, float, float, float, float], ...]
    recomputed: tuple[str, ...] = ()
    offload: float = 0.0  # host transfers of offloaded activations beyond the compute they hide behind


_PRICED: dict[int, tuple[object, dict[tuple, float]]] = {}  # chip id -> (the chip, its priced collectives)


def _memo(chip: Chip) -> dict[tuple, float]:
    held = _PRICED.get(id(chip))
    if held is None or held[0] is not chip:
        if len(_PRICED) > 32:
            _PRICED.clear()
        held = _PRICED[id(chip)] = (chip, {})
    return held[1]


def forget_prices() -> None:
    """Empty the memo of priced collectives (:func:`prices`), as a fresh process starts: what a benchmark of a
    first search clears."""
    _PRICED.clear()


def prices(chip: Chip, lay: Layout, comms: tuple[Comm, ...] | list[Comm]) -> list[float]:
    """Achievable time of one call of each of ``comms`` where its group sits in ``lay`` (memoised per chip: a search
    prices the same collectives over and over)."""
    memo, groups, out = _memo(chip), {}, []
    for c in comms:
        g = groups.get(c.role)
        if g is None:
            g = groups[c.role] = layout_group(lay, c.role)
        key = (c.kind, c.bytes, *g)  # placement() reads the chip and the group (size, stride, cross_node) alone
        t = memo.get(key)
        if t is None:
            t = memo[key] = eff.comm_time(chip, c.kind, c.bytes, g[0], **placement(chip, *g))
        out.append(t)
    return out


# Where Transformer Engine's userbuffers put each sequence-parallel collective of a layer: under the GEMM it feeds (an
# AllGather of the input, forward) or follows (a ReduceScatter of the output), and in the backward the transposes
# under the same GEMM's input-gradient half.
_TP_SITES = ("qkv", "out_proj", "mlp.up", "mlp.down")


def tp_overlapped(cfg: TrainConfig, ops: list, tp: list) -> float:
    """What a layer's TP collectives still cost with ``tp_comm_overlap``: each of the eight (four sites, forward and
    backward) at the overlap's cost under its own GEMM (efficiency.overlap_cost: what the GEMM does not cover is
    exposed, and the GEMM runs slower meanwhile); calls beyond those (a recomputed forward's) under the recomputed
    GEMMs together. A layer without the four sites (an expert layer) hides them under all of its GEMMs together
    (each one's forward and input-gradient half, as at the four sites)."""
    chip = cfg.chip
    calls = sum(c.calls for c, _ in tp)
    if not calls:
        return 0.0
    per_call = sum(c.calls * t for c, t in tp) / calls
    gemm = {o[0]: o for o in ops if o[1] == "matmul"}
    if cfg.model.is_moe or not all(s in gemm for s in _TP_SITES) or calls < 2 * len(_TP_SITES):
        return eff.overlap_cost(chip, calls * per_call, sum(o[2] + o[3] / 2 for o in gemm.values()))
    out = 0.0
    for site in _TP_SITES:
        fwd, bwd = gemm[site][2], gemm[site][3]
        out += eff.overlap_cost(chip, per_call, fwd) + eff.overlap_cost(chip, per_call, bwd / 2)
    extra = calls - 2 * len(_TP_SITES)
    again = sum(gemm[s][2] for s in _TP_SITES)
    return out + (eff.overlap_cost(chip, extra * per_call, again) if extra > 0 else 0.0)


def comm_time(cfg: TrainConfig, c: Comm) -> float:
    """Achievable time of one call of ``c`` in ``cfg``'s layout (:func:`prices`)."""
    return prices(cfg.chip, cfg.layout, (c,))[0]


# A layout's part of the step (seconds): what neither the layer cost nor the microbatch changes. layers: transformer
# layers on the busiest stage (Layout.stage_layers); split: uneven stages' layers (Layout.stage_split), else empty;
# slots: the embedding and the loss take a layer's slot on the first and last stage; dp: the data-parallel gradient
# reduction, once per step (0 without one); loss: the loss mean over the batch axes; optimizer: the optimizer's
# memory-bound pass over this chip's share of the state. (Plain named tuples: typing is not imported at run time.)
LayoutTerms = namedtuple(
    "LayoutTerms", "layers split slots dp loss optimizer dp_tail dp_gather dp_overlap dp_each_microbatch"
)
# dp_tail: the last bucket of the gradient reduction (exposed after the backward when it overlaps); dp_gather: under
# ZeRO, the updated weights gathered after the optimizer (behind the next forward when it overlaps); dp_overlap: the
# job's TrainConfig.dp_overlap. dp is the reduction, bucket by bucket: once a step, or under ZeRO-2 after every
# microbatch's backward (dp_each_microbatch): each rank keeps only its partition of the gradients, so they are
# reduced as each backward makes them (DeepSpeed's stage 2; its maintainers, deepspeedai/DeepSpeed issue #2252).
# FSDP's collectives per layer (ahead of the forward, in the backward) and per microbatch (seconds), and those once a
# step, exposed (the lab's SPMD pipeline gathers a stage's weights before its loop and reduces their gradients after);
# scatter: a layer's gradient ReduceScatter (the backward's last has no layer left to hide behind).
FsdpTerms = namedtuple("FsdpTerms", "fwd bwd rest step scatter")
# A layout and microbatch size's part of the step: n_mb microbatches per pipeline per step; pp: pipeline sends per
# microbatch, seconds; tp: TP collectives once per microbatch (the vocab-parallel embedding and loss, SP's norm
# gradients); bubble: the pipeline bubble as a multiple of the work (axis_costs.bubble_over_work).
MicrobatchTerms = namedtuple("MicrobatchTerms", "n_mb pp tp bubble")


# The roles each term prices; the pipeline's and context's once-a-step reductions (the SPMD pipeline's embedding
# gradients and loss over the stages, the weight gradients over the context shards) go with the DP gradient
# reduction, the pipeline's sends with the microbatch.
TERMS = {"dp": ("dp", "edp", "batch", "pp", "cp"), "fsdp": ("fsdp",), "pp": ("pp",), "tp": ("tp",)}
_PER = {"dp": "step", "pp": "microbatch", "tp": "microbatch"}


def role_comms(cfg: TrainConfig, term: str) -> tuple[Comm, ...]:
    """The collectives a term prices (:data:`TERMS`): for ``dp`` those once a step, for ``pp`` and ``tp`` those
    once per microbatch."""
    return tuple(collectives(cfg, roles=TERMS[term], per=_PER.get(term)))


def dp_times(
    chip: Chip, lay: Layout, comms: tuple[Comm, ...], bucket: float = 25 * 2**20, weights_per_grad: float = 1.0
) -> tuple[float, float, float, float]:
    """The DP gradient reduction (with the SPMD pipeline's reductions over the stages), the loss mean over the batch
    axes, the reduction's last bucket and ZeRO's gather of the updated weights (``role_comms(cfg, "dp")``): seconds,
    once per step. Under ZeRO sharded over the whole DP group the all-reduce is a
    ReduceScatter of the gradients and an AllGather of the weights, half each; sharded over part of it (zero_shard),
    the gradients are all-reduced whole and the weights gathered inside the part. The whole reduction is priced at its
    size (NCCL keeps the buckets in flight back to back); its last bucket, which the backward's end leaves exposed, at
    the bucket's (``bucket``: TrainConfig.dp_bucket_bytes). ``weights_per_grad``: a weight's bytes over a reduced
    gradient's (0.5 for bf16 weights and fp32 gradients, TrainConfig.grad_reduce), what ZeRO's gather moves per byte
    the reduction moved."""
    grads = loss = tail = 0.0
    dp_bytes = 0.0
    for c, t in zip(comms, prices(chip, lay, comms), strict=True):
        if c.role == "batch":
            loss += t
        elif c.role in ("dp", "edp", "pp", "cp"):
            grads += t
            if c.role in ("dp", "edp"):
                last = t if c.bytes <= bucket else prices(chip, lay, (dataclasses.replace(c, bytes=bucket),))[0]
                tail = max(tail, last)
                dp_bytes += c.bytes if c.role == "dp" else 0.0
    gather = 0.0
    if lay.zero >= 1 and lay.dp_eff > 1 and grads:
        if lay.zero_group >= lay.dp_eff:  # the all-reduce's AllGather half moves out of the backward
            gather = grads / 2 * weights_per_grad
            grads -= grads / 2
            tail = min(tail, grads)
        elif lay.zero_group > 1:  # the weights gathered inside the shard group (as the gradients were reduced)
            _, stride, cross = layout_group(lay, "dp")
            nbytes = dp_bytes * weights_per_grad
            gather = eff.comm_time(
                chip, "all-gather", nbytes, lay.zero_group, **placement(chip, lay.zero_group, stride, cross)
            )
    return grads, loss, tail, gather


def layout_terms(
    model: ModelConfig,
    chip: Chip,
    lay: Layout,
    optimizer: str,
    dp: float,
    loss: float,
    local: float | None = None,
    tail: float = 0.0,
    gather: float = 0.0,
    overlap: bool = True,
    spmd_pipeline: bool = False,
) -> LayoutTerms:
    """The layout's terms, with its DP reduction, loss mean, last bucket and ZeRO gather (:func:`dp_times`) priced
    (``local``: the layout's ``training.memory.local_params``, when at hand; ``overlap``: TrainConfig.dp_overlap;
    ``spmd_pipeline``: TrainConfig.spmd_pipeline, for :func:`reduces_each_microbatch`)."""
    shard = lay.zero_shards if lay.zero >= 1 else lay.fsdp_eff
    local = local_params(model, lay) if local is None else local
    update = eff.memory_time(chip, local / shard * UPDATE_BYTES[optimizer])
    slots = lay.pp > 1 and lay.pp_embedding_slots
    each = reduces_each_microbatch(lay, spmd_pipeline)
    layers = lay.stage_layers(model.layers)
    return LayoutTerms(layers, lay.stage_split, slots, dp, loss, update, tail, gather, overlap, each)


def fsdp_terms(chip: Chip, lay: Layout, comms: tuple[Comm, ...]) -> FsdpTerms | None:
    """FSDP's gathers and scatters (``role_comms(cfg, "fsdp")``), summed per layer, per microbatch and once a step;
    None without FSDP."""
    if lay.fsdp_eff <= 1:
        return None
    fwd = bwd = scatter = 0.0  # a gather issued twice per layer is one forward and one backward; once, a backward one
    rest = step = 0
    for c, t in zip(comms, prices(chip, lay, comms), strict=True):
        if c.per == "layer":
            ahead = c.calls // 2 if c.kind == "all-gather" else 0
            fwd += t * ahead
            bwd += t * (c.calls - ahead)
            if c.kind == "reduce-scatter":
                scatter += t * c.calls
        elif c.per == "microbatch":
            rest += c.calls * t
        elif c.per == "step":
            step += c.calls * t
    return FsdpTerms(fwd, bwd, rest, step, scatter)


def pp_time(chip: Chip, lay: Layout, comms: tuple[Comm, ...]) -> float:
    """The pipeline sends of one microbatch (``role_comms(cfg, "pp")``: once per chunk boundary, both ways)."""
    return sum(c.calls * t for c, t in zip(comms, prices(chip, lay, comms), strict=True))


def tp_microbatch_time(chip: Chip, lay: Layout, comms: tuple[Comm, ...]) -> float:
    """The TP collectives once per microbatch (``role_comms(cfg, "tp")``): the vocab-parallel embedding and loss,
    and with sequence parallelism the gathers around them and the norm-scale gradients of the stage's layers."""
    return sum(c.calls * t for c, t in zip(comms, prices(chip, lay, comms), strict=True) if c.per == "microbatch")


def microbatch_terms(lay: Layout, n_mb: int, pp: float, tp: float) -> MicrobatchTerms:
    """``n_mb`` microbatches of this layout, with their pipeline sends (:func:`pp_time`) and TP collectives
    (:func:`tp_microbatch_time`) priced."""
    return MicrobatchTerms(n_mb, pp, tp, bubble_over_work(lay.pp, n_mb, lay.v))


def fsdp_exposed(slowdown: float, ft: FsdpTerms, lc: LayerCost, layers: float) -> float:
    """FSDP per microbatch: each layer's gathers and scatter beyond the compute they overlap (a layer's gather runs
    under the layer before it, prefetched; its scatter under the one after), the embeddings' beyond the logits'; and
    the schedule's ends, which nothing covers: the first layer's gather before the forward starts and the last
    scatter after the backward ends. Hidden is not free: the overlapped compute runs ``slowdown`` slower on a GPU
    (efficiency.overlap_slowdown, efficiency.overlapped)."""
    hide = eff.overlapped
    exposed = layers * (hide(slowdown, ft.fwd, lc.fwd) + hide(slowdown, ft.bwd, lc.bwd + lc.recompute))
    exposed += ft.fwd + ft.scatter if layers else 0.0
    return exposed + hide(slowdown, ft.rest, lc.logits) if ft.rest else exposed


def dp_exposed(slowdown: float, lt: LayoutTerms, lc: LayerCost, n_mb: int = 1) -> float:
    """The data-parallel reduction per step: with overlap, every bucket but the last under the last microbatch's
    backward (the last bucket after it), and ZeRO's weight gather under the next step's first forward; without, all of
    it after the backward. Under ZeRO-2 (``lt.dp_each_microbatch``) the reduction follows each of the ``n_mb``
    microbatches' backward the same way. The loss mean besides."""
    layers, times = lt.layers, (n_mb if lt.dp_each_microbatch else 1)
    if not lt.dp_overlap:
        return times * lt.dp + lt.dp_gather + lt.loss
    under = eff.overlapped(slowdown, max(lt.dp - lt.dp_tail, 0.0), layers * (lc.bwd + lc.recompute))
    after = eff.overlapped(slowdown, lt.dp_gather, layers * lc.fwd) if lt.dp_gather else 0.0
    return times * (min(lt.dp_tail, lt.dp) + under) + after + lt.loss


def step_parts(
    chip: Chip, lc: LayerCost, lt: LayoutTerms, mt: MicrobatchTerms, ft: FsdpTerms | None
) -> tuple[float, ...]:
    """The step time and its parts: ``(step, compute, tp, ep, cp, pp, fsdp, offload, bubble, dp_exposed,
    fsdp_step)``, the six after compute per microbatch, the rest per step (:func:`breakdown` names them)."""
    layers, n_mb = lt.layers, mt.n_mb
    layer_t = lc.fwd + lc.bwd + lc.recompute
    if lt.split:  # uneven stages: the last one also computes the logits; the busiest sets the pace
        last = len(lt.split) - 1
        compute_mb = max(n * layer_t + (lc.logits if i == last else 0.0) for i, n in enumerate(lt.split))
    elif lt.slots:  # the last stage trades a layer for the loss; the busiest sets the pace
        compute_mb = max(layers * layer_t, (layers - 1) * layer_t + lc.logits)
    else:
        compute_mb = layers * layer_t + lc.logits
    tp_mb = layers * lc.tp_comm + mt.tp
    ep_mb = layers * lc.ep_comm
    cp_mb = layers * lc.cp_exposed
    pp_mb = mt.pp  # once per chunk boundary, both ways
    slowdown = eff.overlap_slowdown(chip)
    fsdp_mb = 0.0 if ft is None else fsdp_exposed(slowdown, ft, lc, layers)
    offload_mb = layers * lc.offload
    t_mb = compute_mb + tp_mb + ep_mb + cp_mb + pp_mb + fsdp_mb + offload_mb
    bubble = mt.bubble * n_mb * t_mb  # (p - 1) / v microbatch times (axis_costs)
    # Data parallelism: the gradient reduction in buckets behind the last microbatch's backward (dp_exposed)
    dp_exposed_s = dp_exposed(slowdown, lt, lc, n_mb)
    fsdp_step = 0.0 if ft is None else ft.step
    step = n_mb * t_mb + bubble + dp_exposed_s + fsdp_step + lt.optimizer
    return step, compute_mb, tp_mb, ep_mb, cp_mb, pp_mb, fsdp_mb, offload_mb, bubble, dp_exposed_s, fsdp_step


def breakdown(parts: tuple[float, ...], lt: LayoutTerms, mt: MicrobatchTerms) -> dict[str, float]:
    """The step's parts (:func:`step_parts`) as the estimate's breakdown: seconds per step."""
    _, compute_mb, tp_mb, ep_mb, cp_mb, pp_mb, fsdp_mb, offload_mb, bubble, dp_exposed, fsdp_step = parts
    n_mb = mt.n_mb
    return {
        "compute_s": n_mb * compute_mb,
        "exposed_comm_s": n_mb * (tp_mb + ep_mb + cp_mb + pp_mb + fsdp_mb) + fsdp_step + dp_exposed,
        "bubble_s": bubble,
        "optimizer_s": lt.optimizer,
        "comm_tp_s": n_mb * tp_mb,
        "comm_ep_s": n_mb * ep_mb,
        "comm_cp_s": n_mb * cp_mb,
        "comm_pp_s": n_mb * pp_mb,
        "comm_fsdp_s": n_mb * fsdp_mb + fsdp_step,
        "comm_dp_s": dp_exposed,
        "dp_reduction_s": (n_mb if lt.dp_each_microbatch else 1) * lt.dp + lt.dp_gather,
        "offload_s": n_mb * offload_mb,
    }


__all__ = [
    "TERMS",
    "FsdpTerms",
    "LayerCost",
    "LayoutTerms",
    "MicrobatchTerms",
    "breakdown",
    "comm_time",
    "dp_exposed",
    "dp_times",
    "forget_prices",
    "fsdp_exposed",
    "fsdp_terms",
    "layout_terms",
    "microbatch_terms",
    "pp_time",
    "prices",
    "role_comms",
    "step_parts",
    "tp_microbatch_time",
    "tp_overlapped",
]
