"""Training's collectives: every one a step issues, over which parallelism, how many bytes, behind what.

One list (:func:`collectives`) serves both the step time (:mod:`lab.predict.training.estimate` prices each entry with
:mod:`lab.predict.efficiency` and applies its overlap rule) and the compiled-program audit (which checks the
same entries, byte for byte, against the collectives XLA emitted). Bytes are V, the collective model's
convention, on one device: an AllGather's output, a ReduceScatter's or AllReduce's input.

Per layer and microbatch, with ``act = tokens x D x bytes`` the activations a TP group shares
(``row`` = 2 row-parallel projections: attention out, MLP down; ``col`` = the column-parallel ones, 2 when Q/K/V
and gate/up are fused as in Megatron, 5 when they are separate weights as in the lab's Transformer):

* **TP** (Megatron): forward ``row`` AllReduces (twice under full recomputation), backward ``col`` (the input
  gradients of the column-parallel projections). With sequence parallelism each becomes an AllGather or
  ReduceScatter of the same ``act``: forward ``row`` AllGathers and ``row`` ReduceScatters, backward ``row``
  AllGathers (transposes of the forward ReduceScatters) and ``col`` ReduceScatters, plus ``row`` AllGathers of
  the sequence-sharded inputs again for the weight gradients (Megatron overlaps them with the input-gradient
  matmul: hidden here).
* **Vocab-parallel embedding and loss** (per microbatch, TP): an AllReduce of ``act`` after the embedding
  lookup and one in the logits' backward, and the softmax's max and sum (and the sum's backward) over the
  vocabulary, ``tokens x 4`` bytes each; with SP the logits' input and the embedding's gradient are
  all-gathered (2 x ``act``) and the norm scales' gradients, partial over the sequence, all-reduced.
* **FSDP**: each layer's weights all-gathered before its forward and again before its backward, its
  gradients reduce-scattered; the embeddings once per microbatch. Hidden behind the same layer's compute.
* **DP**: one AllReduce of the gradients per step, hidden behind the last microbatch's backward; the loss mean
  adds a 4-byte AllReduce over every batch axis.
* **EP**: dispatch and combine AllToAlls per direction; **CP**: KV chunks around the ring (hidden behind
  attention where they can be); **PP**: activations and gradients sent once per chunk boundary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.predict.axis_costs import moe_exchange_bytes, ring_kv_block_bytes, ring_passes
from lab.predict.placement import placement
from lab.predict.training.config import Layout, TrainConfig, reduces_each_microbatch
from lab.predict.training.memory import end_params, layer_params_local, local_params, routed_params_local
from lab.predict.training.remat import policy as remat_policy
from lab.predict.training.remat import recomputed

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

LOSS_BYTES = 4.0  # the float32 loss
SOFTMAX_BYTES = 4.0  # max and sum of float32 logits per token
ROLES = ("tp", "ep", "cp", "pp", "fsdp", "dp", "edp", "batch")


@dataclass(frozen=True)
class Comm:
    """One collective of a training step.

    Attributes:
        role: the parallelism whose group it spans (``tp``, ``fsdp``, ``dp``, ``batch``, ``ep``, ``cp``, ``pp``).
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or ``permute``.
        bytes: V of one call on one device.
        calls: calls per ``per``.
        per: ``layer`` (per layer and microbatch), ``microbatch`` or ``step``.
        what: what it carries, in words.
        hidden: what it overlaps with (``""``: exposed; ``layer``, ``backward``, ``dgrad``, ``attention``).
        dtype: the element type its bytes are counted in.
    """

    role: str
    kind: str
    bytes: float
    calls: float
    per: str
    what: str
    hidden: str = ""
    dtype: str = "bf16"


def experts_from_dp(lay: Layout) -> bool:
    """Expert parallelism carved out of the data-parallel replicas, so a routed expert's gradient is summed over
    ``dp / ep`` replicas only: where the FSDP group cannot hold the expert ranks (without FSDP, as Megatron-Core
    and the lab's Transformer place it). Where it can, they come out of it (``lab.core.plan_degrees.plan_from_degrees``)
    and the DP reduction is whole."""
    return lay.ep > 1 and lay.fsdp % lay.ep != 0 and lay.dp_eff % lay.ep == 0


def layout_group(lay: Layout, role: str) -> tuple[int, int, bool]:
    """``(size, stride, cross_node)`` of the group a ``role`` collective spans in ``lay``: its chips, the chips
    between neighbours (tp innermost, then cp, fsdp, dp, pp: the estimator's mesh order) and whether it is known to
    cross the slow link. All that :func:`placement` reads of a layout."""
    cross = role in lay.cross_node
    if role == "tp":
        return lay.tp, 1, cross
    if role == "cp":
        return lay.cp, lay.tp, cross
    if role == "ep":
        return lay.ep, lay.tp * lay.cp, cross
    if role == "fsdp":  # the context shards inside it where they share its weights (Layout.cp_in_fsdp)
        return lay.fsdp_eff, lay.tp * (1 if lay.cp_in_fsdp else lay.cp), cross
    if role == "batch":  # every batch axis: it crosses where the data-parallel or FSDP group does (as a Plan reads)
        return lay.dp * lay.fsdp, lay.tp * lay.cp, cross or bool({"dp", "fsdp"} & set(lay.cross_node))
    # the data-parallel reduction, the context shards inside it where they join it (Layout.cp_in_dp_group)
    cp = 1 if lay.cp_in_dp_group else lay.cp
    if role == "dp":
        return lay.dp_eff, lay.tp * cp * lay.fsdp, cross
    if role == "edp":  # the replicas holding the same experts: the DP group less the expert ranks carved out of it
        cross = "dp" in lay.cross_node
        if experts_from_dp(lay):
            return lay.dp_eff // lay.ep, lay.tp * cp * lay.fsdp * lay.ep, cross
        return lay.dp_eff, lay.tp * cp * lay.fsdp, cross
    if role == "pp":
        return lay.pp, lay.tp * lay.cp * lay.fsdp * lay.dp, cross
    raise KeyError(role)


def group_size(cfg: TrainConfig, role: str) -> int:
    return layout_group(cfg.layout, role)[0]


def place(cfg: TrainConfig, role: str) -> dict[str, Any]:
    return placement(cfg.chip, *layout_group(cfg.layout, role))


def content_key(role: str, lay: Layout, remat: str, regathers_norms: bool = False) -> tuple:
    """What the collectives of ``role`` (which, their bytes and calls; where their group sits is
    :func:`layout_group`'s) depend on, of a layout and a recomputation policy, with the model, the chip and the job's
    other settings held fixed (``regathers_norms``: the job's ``remat_regathers_norms``), and for ``pp`` and ``tp``
    (:data:`PER_MICROBATCH`) on the microbatch size besides: a search's cache key. ``role`` is ``pp``, ``fsdp``,
    ``dp``, ``edp``, ``batch`` or ``tp`` (the TP collectives once per microbatch; the per-layer ones are the layer
    cost's).
    Read off the functions below; tests/test_training.py checks it against them."""
    # A group of one has none at all: (role, None).
    if role == "pp":  # a microbatch's activations on a tp rank and cp shard, each way per chunk
        return (role, lay.v, lay.tp, lay.cp) if lay.pp > 1 else (role, None)
    if role == "tp":  # a microbatch's tokens on a cp shard; with SP, the norm-scale gradients of the stage's layers
        stage = (lay.pp, lay.pp_embedding_slots, lay.stage_split)
        return (role, lay.cp, lay.sequence_parallel, stage) if lay.tp > 1 else (role, None)
    if role == "fsdp":  # a tp/ep rank's layer and stage weights; the norm scales again under recomputation
        again = regathers_norms and remat != "none"
        return (role, lay.tp, lay.ep, lay.pp, again) if lay.fsdp_eff > 1 else (role, None)
    carved = experts_from_dp(lay)  # the routed experts' gradients go to edp
    if role == "dp":  # a tp/ep rank's stage gradients over fsdp; ZeRO splits their reduction (training.step.dp_times)
        zero = (lay.zero >= 1, lay.zero_group)
        return (role, lay.tp, lay.ep, lay.pp, lay.fsdp_eff, carved, *zero) if lay.dp_eff > 1 else (role, None)
    if role == "edp":  # the routed experts' share of them
        return (role, lay.tp, lay.ep, lay.pp, lay.fsdp_eff) if carved and lay.dp_eff > lay.ep else (role, None)
    if role == "batch":  # the loss
        return (role, LOSS_BYTES) if lay.dp * lay.fsdp > 1 else (role, None)
    raise KeyError(role)


CONTENT_ROLES = ("pp", "tp", "fsdp", "dp", "edp", "batch")  # content_key's
PER_MICROBATCH = ("pp", "tp")  # roles whose content_key leaves out the microbatch size they depend on


def _tokens(cfg: TrainConfig) -> float:
    """Tokens of one microbatch on one chip."""
    return cfg.microbatch * cfg.seq_len / cfg.layout.cp


def _recomputed_tp(cfg: TrainConfig, row: int) -> tuple[int, int, int]:
    """TP collectives the recomputed forward issues again, per layer: the row-parallel outputs' reductions, the
    (SP) input gathers, and the inputs SP gathers again for the weight gradients (none where the recomputed forward
    gathered them: its gathered inputs serve the weight gradients, as JAX compiles it)."""
    named = remat_policy(cfg.remat)
    if named is not None:
        ops = recomputed(named)
        gathers = ("qkv" in ops) + ("mlp.up" in ops)
        return int("out_proj" in ops), gathers, row - gathers
    if cfg.remat != "full":
        return 0, 0, row
    if cfg.jax_remat:  # everything but the layer's last projection (lab.predict.training.config)
        return row - 1, row, 0
    return row, row, row  # Megatron: the whole layer again, and the weight gradients' inputs gathered again


def _dtype(nbytes: float) -> str:
    return "fp32" if nbytes == 4 else "bf16"


def _tp(cfg: TrainConfig, per: str | None = None) -> list[Comm]:
    """TP's collectives: each layer's, then those once per microbatch (``per``: only those)."""
    if cfg.layout.tp <= 1:
        return []
    out = _tp_layer(cfg) if per != "microbatch" else []
    return out + _tp_microbatch(cfg) if per != "layer" else out


def _tp_layer(cfg: TrainConfig) -> list[Comm]:
    m, lay = cfg.model, cfg.layout
    act = _tokens(cfg) * m.d_model * cfg.act_bytes
    dt = "fp32" if cfg.act_bytes == 4 else "bf16"
    # The input gradients: Megatron's two fused projections; the lab's q, k, v and gate, up apart, and its expert
    # layers' one (kernels/transformer/moe_layer.py: the routed tokens' gradient summed once).
    share = m.moe_layers / m.layers if m.is_moe else 0.0
    row = m.tp_reductions_per_layer  # a parallel block sums attention's and the MLP's outputs (and input grads) once
    col = row if cfg.fused_projections or m.parallel_block else 5 - share
    rows_again, gathers_again, regather = (min(n, row) for n in _recomputed_tp(cfg, row))
    if not cfg.fused_projections and regather:  # an expert layer keeps its gathered input for the weight gradients
        regather -= share

    def on_act(kind: str, calls: float, what: str, hidden: str = "") -> Comm:
        return Comm("tp", kind, act, calls, "layer", what, hidden, dt)

    router = []
    if share and cfg.moe_partial_router:  # the lab's combine weighs partial sums: the router's gradient is too
        what = "MoE: the router's gradient, partial on each TP rank"
        router = [Comm("tp", "all-reduce", m.d_model * m.experts * cfg.act_bytes, share, "layer", what, "", dt)]
    if not lay.sequence_parallel:
        what = f"TP AllReduces: {row} forward, {col:g} backward"
        return [on_act("all-reduce", row + rows_again + col, what), *router]
    return [
        *router,
        on_act("all-gather", row + gathers_again + row, "SP AllGathers: forward, and the transposes"),
        on_act("all-gather", regather, "SP inputs gathered again for the weight gradients", "dgrad"),
        on_act("reduce-scatter", row + rows_again + col, f"SP ReduceScatters: {row} fwd, {col:g} bwd"),
    ]


def _tp_microbatch(cfg: TrainConfig) -> list[Comm]:
    m, lay = cfg.model, cfg.layout
    tokens = _tokens(cfg)
    dt = "fp32" if cfg.act_bytes == 4 else "bf16"
    out = []
    if lay.sequence_parallel:
        act = tokens * m.d_model * cfg.act_bytes
        grads = (2 * lay.stage_layers(m.layers) + 1) * m.d_model * cfg.grad_reduce_bytes
        what = "norm-scale gradients, partial over the sequence shards"
        out = [
            Comm("tp", "all-gather", act, 2, "microbatch", "SP: the logits' input, the embedding's gradient", "", dt),
            Comm("tp", "all-reduce", grads, 1, "microbatch", what, dtype=_dtype(cfg.grad_reduce_bytes)),
        ]
    # The lookup's partial rows are summed in the table's dtype, and with fp32 weights the logits' input gradient
    # comes out of an fp32-accumulating matmul: both fp32 there (the lab's Transformer), activations' elsewhere.
    vocab_dt = "fp32" if cfg.param_dtype == "fp32" else dt
    vocab_act = tokens * m.d_model * (4.0 if vocab_dt == "fp32" else cfg.act_bytes)
    what = "vocab-parallel embedding (forward), logits (backward)"
    out.append(Comm("tp", "all-reduce", vocab_act, 2, "microbatch", what, "", vocab_dt))
    what = "vocab-parallel softmax: max, sum, sum's backward"
    out.append(Comm("tp", "all-reduce", tokens * SOFTMAX_BYTES, 3, "microbatch", what, dtype="fp32"))
    return out


def _output_table_share(m) -> float:
    """The output embedding's share of the embedding parameters (0 when tied to the input one)."""
    if m.tied_embeddings:
        return 0.0
    tables = m.embedding_params - m.d_model * (2 if m.norm == "layernorm" else 1)
    return m.vocab * m.d_model / tables


def _fsdp(cfg: TrainConfig) -> list[Comm]:
    m, lay = cfg.model, cfg.layout
    if lay.fsdp_eff <= 1:
        return []
    wdt = "fp32" if cfg.weight_bytes == 4 else "bf16"
    gdt = _dtype(cfg.grad_reduce_bytes)
    if cfg.spmd_pipeline and lay.pp > 1:  # the lab's pipeline: a stage's weights gathered whole, once a step
        return _fsdp_in_pipeline(cfg, wdt, gdt)
    layer = layer_params_local(m, lay)
    # A stage holds its share of the embeddings (the first stage the input table, the last the output one and the
    # final norm), averaged over the stages as local_params averages them.
    final = m.d_model * (2 if m.norm == "layernorm" else 1) / lay.pp
    rest = local_params(m, lay) - m.layers / lay.pp * layer - final  # embeddings (and learned positions)
    out_table = rest * _output_table_share(m)
    norms = float(m.norm_params_per_layer)
    # the norm scales gathered again for the recomputed forward (XLA:CPU)
    again = Comm("fsdp", "all-gather", norms * cfg.weight_bytes, 1, "layer", _NORMS_AGAIN, "layer", wdt)
    if not (cfg.remat_regathers_norms and cfg.remat != "none"):
        again = dataclasses.replace(again, calls=0)  # dropped by collectives()
    if cfg.cast_first and cfg.weight_bytes > cfg.act_bytes:
        return [*_fsdp_cast_first(cfg, layer, final, rest, out_table), again]
    out = [
        again,
        Comm("fsdp", "all-gather", layer * cfg.weight_bytes, 2, "layer", _LAYER_GATHER, "layer", wdt),
        Comm("fsdp", "reduce-scatter", layer * cfg.grad_reduce_bytes, 1, "layer", _LAYER_GRADS, "layer", gdt),
        Comm("fsdp", "all-gather", final * cfg.weight_bytes, 2, "microbatch", _FINAL_NORM, "layer", wdt),
        Comm("fsdp", "all-gather", rest * cfg.weight_bytes, 1, "microbatch", "FSDP: embeddings", "layer", wdt),
        # fp32 weights computed in a 16-bit dtype: the cast sits between the gathered output table and its two
        # uses, and XLA gathers it again for the logits' backward (the input table's lookup has no second use)
        Comm(
            "fsdp",
            "all-gather",
            out_table * cfg.weight_bytes * (cfg.param_dtype == "fp32" and cfg.dtype != "fp32"),
            1,
            "microbatch",
            "FSDP: the output table again, for the logits' backward",
            "layer",
            wdt,
        ),
        Comm(
            "fsdp", "reduce-scatter", (rest + final) * cfg.grad_reduce_bytes, 1, "microbatch", _REST_GRADS, "layer", gdt
        ),
    ]
    return [c for c in out if c.bytes > 0]


def _fsdp_in_pipeline(cfg: TrainConfig, wdt: str, gdt: str) -> list[Comm]:
    """FSDP inside the lab's SPMD pipeline, as XLA compiles it: the stage's weights (its layers, and the embeddings
    and final norm every stage holds) are loop-invariant in the pipeline's loop over steps, so XLA gathers them
    whole once, before it, and reduces their gradients, summed over the steps, once after it: an AllReduce of the
    whole gradients over the FSDP group (each shard then keeps its slice), not a ReduceScatter per layer."""
    stage = local_params(cfg.model, cfg.layout, ends_on_every_stage=True)
    what = "FSDP: the stage's weights, once a step (before the pipeline's loop)"
    grads = "FSDP: the stage's gradients, once a step (after the pipeline's loop)"
    return [
        Comm("fsdp", "all-gather", stage * cfg.weight_bytes, 1, "step", what, "", wdt),
        Comm("fsdp", "all-reduce", stage * cfg.grad_reduce_bytes, 1, "step", grads, "", gdt),
    ]


_LAYER_GATHER = "FSDP: each layer's weights, fwd and bwd"
_LAYER_GRADS = "FSDP: each layer's gradients"
_FINAL_NORM = "FSDP: the final norm scale"
_REST_GRADS = "FSDP: their gradients"
_NORMS_AGAIN = "FSDP: each layer's norm scales again, for the recomputation"


def _fsdp_cast_first(cfg: TrainConfig, layer: float, final: float, rest: float, out_table: float) -> list[Comm]:
    """FSDP of fp32 weights computed in a 16-bit dtype, as the TPU compiler builds it (``cast_first``): it moves the
    cast ahead of the gather, so a layer's matmul weights cross the wire in the compute dtype (its norm scales,
    used in fp32, stay fp32) and their gradients are reduced in it before the fp32 update. The weights outside the
    layer loop are gathered once and kept for the backward: the final norm, the input table (fp32: the lookup
    reads table rows) and the output table (16-bit: the logits' matmul input; XLA:GPU gathers it in fp32 and casts
    after, ``cast_first_out_table`` False)."""
    m, act = cfg.model, cfg.act_bytes
    adt = "bf16" if act == 2 else "fp32"
    norms = float(m.norm_params_per_layer)
    matmuls = layer - norms
    in_table = rest - out_table
    return [
        c
        for c in (
            Comm("fsdp", "all-gather", matmuls * act, 2, "layer", _LAYER_GATHER + " (cast first)", "layer", adt),
            Comm(
                "fsdp",
                "all-gather",
                norms * 4.0,
                2,
                "layer",
                "FSDP: each layer's norm scales, fwd and bwd",
                "layer",
                "fp32",
            ),
            Comm(
                "fsdp",
                "reduce-scatter",
                matmuls * act,
                1,
                "layer",
                _LAYER_GRADS + " (reduced before the cast)",
                "layer",
                adt,
            ),
            Comm(
                "fsdp",
                "reduce-scatter",
                norms * 4.0,
                1,
                "layer",
                "FSDP: each layer's norm scales' gradients",
                "layer",
                "fp32",
            ),
            Comm("fsdp", "all-gather", final * 4.0, 1, "microbatch", _FINAL_NORM + ", kept", "layer", "fp32"),
            Comm("fsdp", "all-gather", in_table * 4.0, 1, "microbatch", "FSDP: the input table, kept", "layer", "fp32"),
            Comm(
                "fsdp",
                "all-gather",
                out_table * (act if cfg.cast_first_out_table else 4.0),
                1,
                "microbatch",
                "FSDP: the output table, " + ("cast, kept" if cfg.cast_first_out_table else "kept (cast after)"),
                "layer",
                adt if cfg.cast_first_out_table else "fp32",
            ),
            Comm("fsdp", "reduce-scatter", (rest + final) * 4.0, 1, "microbatch", _REST_GRADS, "layer", "fp32"),
        )
        if c.bytes > 0
    ]


def _reduced_grads(cfg: TrainConfig) -> float:
    """Bytes of the gradients one chip reduces over its replicas (data parallelism, or the context shards): its
    stage's share, and every stage's embeddings in the SPMD pipeline, over FSDP's shards."""
    local = local_params(cfg.model, cfg.layout, ends_on_every_stage=cfg.spmd_pipeline)
    return local / cfg.layout.fsdp_eff * cfg.grad_reduce_bytes


def _dp(cfg: TrainConfig) -> list[Comm]:
    """The gradients' reduction over the data-parallel replicas; with expert parallelism carved out of them, the
    routed experts' gradients over the replicas holding the same experts (``edp``) and the rest over all."""
    lay = cfg.layout
    out = []
    if lay.dp_eff > 1:
        grads, dt = _reduced_grads(cfg), _dtype(cfg.grad_reduce_bytes)
        if experts_from_dp(lay):
            experts = routed_params_local(cfg.model, lay) / lay.fsdp_eff * cfg.grad_reduce_bytes
            grads -= experts
            if lay.dp_eff > lay.ep:
                what = "EP: the routed experts' gradients over the replicas holding them"
                out.append(Comm("edp", "all-reduce", experts, 1, "step", what, "backward", dt))
        what = "DP gradient AllReduce"
        if reduces_each_microbatch(lay, cfg.spmd_pipeline):  # the step's breakdown counts each microbatch's
            what += f" (ZeRO-2: its ReduceScatter after each of the {cfg.microbatches} microbatches)"
        out.append(Comm("dp", "all-reduce", grads, 1, "step", what, "backward", dt))
    if lay.dp * lay.fsdp > 1:
        out.append(Comm("batch", "all-reduce", LOSS_BYTES, 1, "step", "the loss mean over the batch", dtype="fp32"))
    return out


def _slot_experts(tokens: float, experts: int) -> int | None:
    """Count the send buffer's slots whole per expert (``E ceil(k t cf / E)``, what a device's buffer holds) when a
    device's tokens are whole; else (an average over a search's layouts) as ``k t cf``."""
    return experts if float(tokens).is_integer() else None


def _ep_cp_pp(cfg: TrainConfig) -> list[Comm]:
    m, lay = cfg.model, cfg.layout
    tokens = _tokens(cfg)
    directions = 3 if cfg.remat == "full" else 2
    out = []
    if lay.ep > 1:  # dispatch and combine per direction, in the expert layers (not the leading dense ones)
        k, cf = m.experts_per_token, cfg.capacity_factor
        a2a = moe_exchange_bytes(lay.ep, tokens, k, m.d_model, cfg.act_bytes, cf, _slot_experts(tokens, m.experts))
        share = m.moe_layers / m.layers
        out.append(Comm("ep", "all-to-all", a2a, 2 * directions * share, "layer", "EP dispatch and combine"))
    if lay.cp > 1 and cfg.spmd_context:  # K and V gathered whole (forward, backward), their gradients summed
        kv = tokens * lay.cp * max(m.kv_heads / lay.tp, 1.0) * m.head_dim * cfg.act_bytes  # one of them, gathered
        # K and V, forward and backward (a recomputed forward's gathers serve the backward, as XLA compiles it)
        what = "CP: K and V gathered over the context shards, forward and again backward"
        out.append(Comm("cp", "all-gather", kv, 4, "layer", what))
        out.append(Comm("cp", "all-reduce", 2 * kv, 1, "layer", "CP: the K and V gradients over the context shards"))
        if not lay.cp_in_dp:  # else the data-parallel reduction spans the context shards (Layout.cp_in_dp)
            what = "the weight gradients (and the loss) over the context shards"
            grads, dt = _reduced_grads(cfg) + LOSS_BYTES, _dtype(cfg.grad_reduce_bytes)
            out.append(Comm("cp", "all-reduce", grads, 1, "step", what, "backward", dt))
    elif lay.cp > 1:  # KV chunks around the ring: once forward, twice backward
        kv_bytes = ring_kv_block_bytes(tokens, max(m.kv_heads / lay.tp, 1.0), m.head_dim, 2.0)
        passes: float = ring_passes(lay.cp, directions=3)
        if m.window_layers:  # a windowed layer needs the chunks of the shards its window reaches back over only
            near = min(lay.cp, 1 + math.ceil(m.sliding_window / (cfg.seq_len / lay.cp)))
            passes = ((m.layers - m.window_layers) * passes + m.window_layers * ring_passes(near, 3)) / m.layers
        out.append(Comm("cp", "permute", kv_bytes, passes, "layer", "CP ring passes of K and V", "attention"))
    if lay.pp > 1 and cfg.spmd_pipeline:  # the lab's: whole activations (split over tp only by SP), every step
        n_mb = cfg.microbatches
        split = lay.tp if lay.sequence_parallel else 1
        nbytes = cfg.microbatch * cfg.seq_len / lay.cp * m.d_model * cfg.act_bytes / split
        sends = 2.0 * (lay.v * n_mb + lay.pp - 2) / n_mb  # v M + p - 2 each way (every step but the last), per mb
        out.append(Comm("pp", "permute", nbytes, sends, "microbatch", "pipeline sends: activations and gradients"))
        what = "the embeddings' and final norm's gradients over the stages"
        ends, dt = end_params(m, lay) * cfg.grad_reduce_bytes, _dtype(cfg.grad_reduce_bytes)
        out.append(Comm("pp", "all-reduce", ends, 1, "step", what, "backward", dt))
        out.append(Comm("pp", "all-reduce", LOSS_BYTES, 1, "step", "the loss from the last stage", dtype="fp32"))
    elif lay.pp > 1:  # Megatron's scatter/gather: each TP rank sends 1/tp of the activation (Narayanan Sec. 4.1)
        nbytes = cfg.microbatch * cfg.seq_len / lay.cp * m.d_model * 2.0 / lay.tp
        out.append(Comm("pp", "permute", nbytes, 2 * lay.v, "microbatch", "pipeline sends: activations and gradients"))
    return out


def collectives(cfg: TrainConfig, roles: tuple[str, ...] = ROLES, per: str | None = None) -> list[Comm]:
    """Every collective of one training step (see the module docstring), or those of ``roles`` (and issued once
    per ``per``: ``layer``, ``microbatch`` or ``step``)."""
    out = []
    if "tp" in roles:
        out += _tp(cfg, per)
    if "ep" in roles or "cp" in roles or "pp" in roles:
        out += [c for c in _ep_cp_pp(cfg) if c.role in roles]
    if "fsdp" in roles:
        out += _fsdp(cfg)
    if "dp" in roles or "edp" in roles or "batch" in roles:
        out += [c for c in _dp(cfg) if c.role in roles]
    return [c for c in out if c.calls > 0 and (per is None or c.per == per)]


def calls_per_step(cfg: TrainConfig, c: Comm) -> float:
    """How many times a step issues ``c`` on one chip (its stage's layers, every microbatch)."""
    if c.per == "step":
        return c.calls
    if c.per == "layer":  # in every step a stage computes (the SPMD pipeline's idle ones too)
        return cfg.pipeline_steps * c.calls * cfg.layout.stage_layers(cfg.model.layers)
    return cfg.microbatches * c.calls


__all__ = [
    "CONTENT_ROLES",
    "PER_MICROBATCH",
    "ROLES",
    "Comm",
    "calls_per_step",
    "collectives",
    "content_key",
    "group_size",
    "layout_group",
    "place",
    "placement",
]
