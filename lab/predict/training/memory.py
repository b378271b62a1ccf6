"""Training memory per chip: weights, gradients, optimizer state and activations (Korthikanti et al. 2022)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.core.models import ModelConfig
from lab.predict.training.config import GRAD_BYTES, Layout, TrainConfig
from lab.predict.training.remat import policy as remat_policy
from lab.predict.training.remat import saved_elements


@dataclass(frozen=True)
class Memory:
    """Bytes per chip of one training step: parameters, gradients, optimizer state and activations."""

    params: float
    grads: float
    optimizer: float
    activations: float
    activations_per_layer: float
    hbm_bytes: float
    gathered: float = 0.0  # of params: the layers FSDP holds gathered whole (working copies, not state)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm_bytes

    def to_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "params_gathered": self.gathered,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "activations_per_layer": self.activations_per_layer,
            "total": self.total,
            "hbm_bytes": self.hbm_bytes,
        }


# ----- memory -------------------------------------------------------------------------------


def activation_bytes_per_layer(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    microbatch: int,
    remat: str,
    flash_attention: bool,
    checkpoints: float | None = None,
    jax_saved: bool = False,
) -> float:
    """Stored activations of one layer for one microbatch on one chip (16-bit activations).

    ``jax_saved`` (the lab's Transformer, differentiated by JAX; ``TrainConfig.jax_remat``): with nothing recomputed
    the backward pass keeps what autodiff saves, not what fused kernels keep. Read off libtpu's buffer report for
    LLaMA-3-8B (docs/validation/tpu_cross_compile.md): each RMSNorm's float32 input and normalised output (16 bytes
    of D a token for the two), the two 16-bit norm outputs (4), and six [tokens, F] 16-bit SwiGLU tensors (gate,
    up, the sigmoid, SiLU, their product and its cast), against Korthikanti's 8 of D and three of F.

    For a GPT-style layer (MHA, 4h GeLU MLP, dropout, unfused attention) this is Korthikanti et al.
    Table 2: ``sbh(10 + 24/t + 5as/ht)``, ``sbh(34 + 5as/h)/t`` with SP, ``sbh(10 + 24/t)`` selective,
    ``34 sbh/t`` selective + SP, and ``2 sbh`` under full recomputation.
    """
    t, s, b = layout.tp, seq_len / layout.cp, microbatch
    h = model.d_model
    sp = layout.sequence_parallel
    if checkpoints is not None:  # the book's form: k saved [B, D] per layer
        return checkpoints * 2.0 * s * b * h / (t if sp else 1)
    named = remat_policy(remat)
    if named is not None:  # the layer input, and what the policy keeps in HBM (nothing, when it offloads)
        kept = 0.0 if named.offloaded else saved_elements(named, model, t, sp)
        return 2.0 * s * b * (h / (t if sp else 1) + kept)
    if remat == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    drop = 1.0 if model.dropout else 0.0
    # With fused attention there is no score matrix for selective recomputation to drop; it then keeps
    # matmul outputs only and recomputes the norms and the MLP activation (JAX's dots_saveable policy).
    dots_only = remat == "selective" and flash_attention
    # Replicated across TP unless SP: two norm inputs (4sbh), attention and MLP inputs (4sbh, the norm
    # outputs, recomputed under dots_only), 2 dropout masks.
    shared = ((4.0 if dots_only else 8.0) + 2.0 * drop) * s * b * h
    kv_per_rank = max(model.kv_heads / t, 1.0) * model.head_dim
    q_per_rank = model.q_dim / t
    # Split by TP: Q, K, V, the attention output (out-projection input), and the MLP's internals.
    attn = 2.0 * s * b * (2 * q_per_rank + 2 * kv_per_rank)
    f_local = model.d_ff * (model.experts_per_token + model.shared_experts) / t
    mlp = 2.0 * s * b * f_local * ((3 if model.gated_mlp else 2) - (1 if dots_only else 0))
    if jax_saved and remat == "none" and model.gated_mlp and not drop:
        shared, mlp = 20.0 * s * b * h, 2.0 * s * b * f_local * 6
    scores = 0.0
    if not flash_attention and remat == "none":
        # softmax output (2 bytes), its dropout mask (1) and dropout output (2): 5 a s^2 b / t
        scores = (2.0 + 3.0 * drop) * (model.heads / t) * s * seq_len * b  # local queries x all keys
    return (shared / (t if sp else 1)) + attn + mlp + scores


def activation_key(lay: Layout, microbatch: int) -> tuple:
    """What :func:`activation_bytes_per_layer` reads of a layout and a microbatch size, besides the recomputation
    policy (the model, sequence length, attention and checkpoints held fixed): a search's cache key."""
    return (lay.tp, lay.cp, lay.sequence_parallel, microbatch)


def layer_params_key(lay: Layout) -> tuple[int, int]:
    """What :func:`layer_params_local` reads of a layout (the model held fixed): a search's cache key."""
    return lay.tp, lay.ep


def layer_params_local(m: ModelConfig, lay: Layout) -> float:
    """One layer's parameters on one tensor/expert-parallel rank (what FSDP gathers for that layer).

    Megatron's split, which the lab's Transformer follows: the projections and the column-parallel biases are
    split by tp (K and V replicated once tp exceeds the KV heads), experts also by ep; norms, the row-parallel
    output biases and the router are whole on every rank.
    """
    t = lay.tp
    kv_per_rank = max(m.kv_heads / t, 1.0) * m.head_dim
    attn = 2 * m.d_model * m.q_dim / t + 2 * m.d_model * kv_per_rank
    if m.is_mla:  # split by tp as the heads are (the latent down-projections too, an approximation)
        attn = (m.attention_matmul_params + m.q_lora_rank + m.kv_lora_rank) / t
    mlp = _mlp_local(m, t)
    if m.biases:  # Q, K, V biases split; the attention output's bias whole
        attn += m.q_dim / t + 2 * kv_per_rank + m.d_model
    experts = m.experts / (lay.ep if m.is_moe else 1)
    moe = experts * mlp + m.shared_experts * mlp + m.router_params_per_layer  # shared experts: split by tp only
    if m.dense_layers:  # leading dense layers: the average layer
        dense = m.mlp_matrices * m.d_model * m.dense_ff / t + (
            ((m.mlp_matrices - 1) * m.dense_ff / t + m.d_model) if m.biases else 0
        )
        moe = (m.moe_layers * moe + m.dense_layers * dense) / m.layers
    return attn + moe + m.norm_params_per_layer


def _mlp_local(m: ModelConfig, t: int) -> float:
    """One MLP (one expert's) on a tensor-parallel rank: its matrices split by tp; the first matrices' biases
    split, the output bias whole."""
    mlp = m.mlp_matrices * m.d_model * m.d_ff / t
    return mlp + ((m.mlp_matrices - 1) * m.d_ff / t + m.d_model if m.biases else 0.0)


def routed_params_local(m: ModelConfig, lay: Layout) -> float:
    """The routed experts' parameters one chip owns before ZeRO/FSDP (its stage's expert layers, its ``E / ep``
    experts on its tp rank): what expert parallelism shards, whose gradients only the ranks holding the same
    experts reduce."""
    if not m.is_moe:
        return 0.0
    return m.moe_layers * m.experts / lay.ep * _mlp_local(m, lay.tp) / lay.pp


def local_params(m: ModelConfig, lay: Layout, layer: float | None = None, ends_on_every_stage: bool = False) -> float:
    """Parameters one chip owns before ZeRO/FSDP: its stage's layers on its tp/ep rank, and the (vocab-parallel)
    embeddings, learned positions and final norm, averaged over the pipeline stages, or held by every stage
    (``ends_on_every_stage``: the SPMD pipeline, ``TrainConfig.spmd_pipeline``) (``layer``: the layout's
    :func:`layer_params_local`, when at hand)."""
    layer = layer_params_local(m, lay) if layer is None else layer
    if ends_on_every_stage:  # every stage stacks as many layers as the largest (an uneven split's padded)
        return lay.stage_layers(m.layers) * layer + end_params(m, lay)
    return (m.layers * layer + end_params(m, lay)) / lay.pp


def end_params(m: ModelConfig, lay: Layout) -> float:
    """Parameters outside the layers on one tp rank: the (vocab-parallel) embeddings, learned positions and the
    final norm."""
    emb = m.vocab * m.d_model * (1 if m.tied_embeddings else 2) / lay.tp
    pos = m.max_seq_len * m.d_model if m.learned_positions else 0.0
    return emb + pos + m.d_model * (2 if m.norm == "layernorm" else 1)


def state_bytes(
    m: ModelConfig,
    lay: Layout,
    weight_bytes: float,
    optimizer_bytes: float,
    ends_on_every_stage: bool = False,
    layer: float | None = None,
) -> tuple[float, ...]:
    """``(params, grads, optimizer, gathered, local)`` per chip: the state, which depends on the layout alone
    (``gathered``: of ``params``, the layers FSDP holds gathered whole; ``local``: :func:`local_params`; ``layer``:
    the layout's :func:`layer_params_local`, when at hand)."""
    layer = layer_params_local(m, lay) if layer is None else layer
    local = local_params(m, lay, layer, ends_on_every_stage)
    f = lay.fsdp_eff
    zero_group = lay.zero_shards
    params = local * weight_bytes / f
    gathered = 2 * layer * weight_bytes if f > 1 else 0.0
    grads = local * GRAD_BYTES / (zero_group if lay.zero >= 2 else f)
    if f > 1 and ends_on_every_stage and lay.pp > 1:  # the lab's SPMD pipeline (training.comm._fsdp_in_pipeline):
        gathered = local * weight_bytes  # the stage's weights gathered whole for the step,
        grads = local * GRAD_BYTES  # their gradients summed whole before the reduction
    params += gathered  # held whole: two layers (the one computed, the next prefetched), or the pipeline's stage
    opt = local * optimizer_bytes / (zero_group if lay.zero >= 1 else f)
    return params, grads, opt, gathered, local


def activation_terms(
    m: ModelConfig, lay: Layout, seq_len: int, microbatch: int, microbatches: int, spmd_pipeline: bool = False
) -> tuple[float, float, float]:
    """``(a, b, rest)``: a chip holds ``per_layer * a * b + rest`` bytes of activations (:func:`activations`), with
    ``per_layer`` one layer's for one microbatch (:func:`activation_bytes_per_layer`). ``spmd_pipeline``: the lab's
    pipeline, whose backward pass reads what every one of its steps saved (``M + p - 1`` of them for GPipe,
    ``v M + p - 1`` chunks for the circular schedule), and whose stages all compute the float32 logits of the
    replica's whole batch at once."""
    layers_per_stage = lay.stage_layers(m.layers)
    s, mb, h = seq_len / lay.cp, microbatch, m.d_model
    if lay.pp > 1 and spmd_pipeline and not lay.stage_split:
        steps = (lay.v * microbatches + lay.pp - 1) / lay.v  # in whole stages' layers of one microbatch
        return layers_per_stage, steps, 4.0 * s * mb * microbatches * (h + m.vocab) / lay.tp
    if lay.pp == 1:
        in_flight = 1.0
    elif lay.pp_schedule == "gpipe":
        in_flight = float(microbatches)
    else:
        in_flight = float(min(lay.pp, microbatches))
        if lay.pp_schedule == "interleaved":
            in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.v)
    a, b = layers_per_stage, in_flight
    if lay.stage_split and lay.pp_schedule == "1f1b":  # stage i holds min(pp - i, m) microbatches: the peak stage
        a, b = max(n * min(lay.pp - i, microbatches) for i, n in enumerate(lay.stage_split)), 1.0
    # Korthikanti Sec. 4.3: embeddings and logits, 4 s b (h + V) / t on a single stage; s b h p / t otherwise.
    rest = 4.0 * s * mb * (h + m.vocab) / lay.tp if lay.pp == 1 else s * mb * h * lay.pp / lay.tp
    return a, b, rest


def activations(per_layer: float, terms: tuple[float, float, float]) -> float:
    """Activation bytes per chip: the layers a stage holds for the microbatches in flight, and the embeddings' and
    logits' (:func:`activation_terms`)."""
    a, b, rest = terms
    return per_layer * a * b + rest


def memory_per_chip(cfg: TrainConfig) -> Memory:
    m, lay = cfg.model, cfg.layout
    params, grads, opt, gathered, _ = state_bytes(m, lay, cfg.weight_bytes, cfg.optimizer_bytes, cfg.spmd_pipeline)
    per_layer = activation_bytes_per_layer(
        m, lay, cfg.seq_len, cfg.microbatch, cfg.remat, cfg.flash_attention, cfg.checkpoints_per_layer, cfg.jax_remat
    ) * (cfg.act_bytes / 2.0)  # counted in 16-bit elements: an fp32 program stores each at 4 bytes
    terms = activation_terms(m, lay, cfg.seq_len, cfg.microbatch, cfg.microbatches, cfg.spmd_pipeline)
    return Memory(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=activations(per_layer, terms),
        activations_per_layer=per_layer,
        hbm_bytes=cfg.chip.hbm_bytes,
        gathered=gathered,
    )


def state_min_chips(cfg: TrainConfig, mem: Memory | None = None) -> int | None:
    """Smallest chip count whose HBM holds the weights, gradients and optimizer state sharded over every chip
    (ZeRO-3) beside this config's per-chip activations (what the planner's "nothing fits" says). None if the
    activations alone overflow."""
    mem = mem or memory_per_chip(cfg)
    state = cfg.model.params * (cfg.weight_bytes + GRAD_BYTES + cfg.optimizer_bytes)
    room = cfg.chip.hbm_bytes - mem.activations
    if room <= 0:
        return None
    return max(1, math.ceil(state / room))


def min_chips(cfg: TrainConfig) -> int:
    """Smallest chip count whose HBM holds the whole job: the weights, gradients and optimizer state, and the
    activations of the whole global batch at once (no gradient accumulation) at this layout's degrees, everything
    spread evenly over the chips (the book's question, applied-training.md, with the lab's memory model)."""
    lay = cfg.layout
    replicas = lay.dp * lay.fsdp
    whole = dataclasses.replace(cfg, microbatch=max(1, cfg.global_batch // replicas))
    acts = memory_per_chip(whole).activations * lay.chips
    state = cfg.model.params * (cfg.weight_bytes + GRAD_BYTES + cfg.optimizer_bytes)
    return max(1, math.ceil((state + acts) / cfg.chip.hbm_bytes))
