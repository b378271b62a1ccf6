"""Training estimator: memory per chip, step time under every parallelism, MFU, days and cost.

The model is a list of named per-layer ops priced by :mod:`lab.predict.efficiency` (matmuls by shape,
memory-bound ops by bytes, collectives by :mod:`lab.predict.collectives`), composed into a step:

* **Layout.** Degrees ``dp * fsdp * tp * pp * cp = chips``; mesh order, innermost first, is
  tp, cp, fsdp, dp, pp (tensor parallelism inside a node, pipeline stages across nodes). Expert
  parallelism ``ep`` draws its ranks from the fsdp x dp ones. ``zero=3`` over dp is FSDP.
* **Memory** (per chip, bytes). Weights, gradients and optimizer state per parameter are
  2 + 4 + 12 = 18 bytes for mixed-precision Adam (bf16 weights, fp32 gradients, fp32 master weights
  and two moments; Korthikanti et al. 2022, Fig. 1), 2 + 4 + 8 for SGD with momentum and
  2 + 4 + 4 for Adafactor (factored moments are negligible); each is divided by tp x pp (experts
  also by ep) and sharded by ZeRO/FSDP. Activations follow Korthikanti et al. Table 2 per layer, in
  a form that reproduces it exactly for GPT-style layers and generalises to GQA, gated MLPs and
  fused (flash) attention; times the layers a stage holds and the microbatches in flight (1F1B's
  first stage holds ``pp``; interleaving adds ``1 + (pp-1)/(pp*v)``; GPipe holds all), plus
  Korthikanti's embedding/logit term. The book's ``k`` checkpoints of ``[B, D]`` per layer replace
  the per-layer form when ``checkpoints_per_layer`` is given.
  ``selective`` is Korthikanti's (the attention core is recomputed) with unfused attention; with
  fused (flash) attention, which never stores scores, it keeps matmul outputs only and recomputes
  the norms and the MLP activation (JAX's ``dots_saveable``).
* **Time.** Per microbatch and layer: the forward ops, the backward ones (matmuls twice their
  forward time; flash attention 2.5x; memory-bound ops twice), recomputation (whatever the policy
  dropped, run again; full: the whole forward, collectives included), and tensor-parallel
  collectives (two AllReduces, or AllGather/ReduceScatter pairs with sequence parallelism, per
  direction). Overlap assumptions, stated once: TP and EP collectives and pipeline sends are
  exposed; context-parallel KV passing hides behind attention; FSDP gathers and scatters hide
  behind the same layer's compute (exposed only beyond it); the data-parallel gradient reduction
  hides behind the last microbatch's backward. The pipeline adds its bubble:
  ``(pp-1)/v`` microbatch-times (v = 1 unless interleaved). The step is composed from its parts in
  :mod:`lab.predict.training.step`, one formula for :func:`estimate` and the layout planner.
"""
# Over 500 lines on purpose: the training step's composition (layers, pipeline, data parallelism, optimizer) reads as
# one account; memory, communication and the Pallas pricing already live apart.

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lab.predict import efficiency as eff
from lab.predict.training import attention_kernels as kernels
from lab.predict.training.attention_kernels import BACKWARD_FLOPS, pallas_attention
from lab.predict.training.comm import calls_per_step, collectives
from lab.predict.training.config import (
    GRAD_BYTES,
    OPTIMIZERS,
    REMAT,
    SCHEDULES,
    WEIGHT_BYTES,
    Layout,
    TrainConfig,
    check_config,
)
from lab.predict.training.memory import (
    Memory,
    activation_bytes_per_layer,
    layer_params_local,
    local_params,
    memory_per_chip,
    min_chips,
    state_min_chips,
)
from lab.predict.training.remat import policy as remat_policy
from lab.predict.training.remat import recomputed as remat_recomputed
from lab.predict.training.remat import saved_elements
from lab.predict.training.step import (
    FsdpTerms,
    LayerCost,
    LayoutTerms,
    MicrobatchTerms,
    breakdown,
    comm_time,
    dp_times,
    fsdp_terms,
    layout_terms,
    microbatch_terms,
    pp_time,
    prices,
    role_comms,
    step_parts,
    tp_microbatch_time,
    tp_overlapped,
)

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

# The kernels' named scope each estimator op is joined to (lab/report/ledger.py); ops sharing a scope are one row.
SCOPES = {
    "qkv": "attention/qkv",
    "attention": "attention/scores",
    "attention.bmm": "attention/scores",
    "attention.pallas": "attention/scores",
    "attention.softmax": "attention/scores",
    "out_proj": "attention/out",
    "rope": "attention/rope",
    "router": "mlp/router",
    "mlp.up": "mlp/up",
    "mlp.activation": "mlp/up",
    "mlp.down": "mlp/down",
    "mlp.shared": "mlp/shared",
    "mlp.dense": "mlp/dense",
    "mlp.dense_down": "mlp/dense",
    "moe.dispatch": "mlp/dispatch",
    "norms": "norm",
    "residuals": "residual",
}

# A mixture of experts' MLP ops, joined to kernels/transformer/moe_layer.py's scopes instead.
MOE_SCOPES = {
    "router": "moe/router",
    "mlp.up": "moe/experts",
    "mlp.activation": "moe/experts",
    "mlp.down": "moe/experts",
    "mlp.shared": "moe/shared",
    "moe.dispatch": "moe/dispatch",
    "mlp.dense": "mlp/up",  # the leading dense layers, as a dense model's MLP
    "mlp.dense_down": "mlp/down",
}


@dataclass(frozen=True)
class TrainEstimate:
    """Result of :func:`estimate`. Times in seconds, memory in bytes per chip."""

    config: TrainConfig
    step_time_s: float
    breakdown: dict[str, float]
    memory: Memory
    model_flops_per_step: float
    hardware_flops_per_step: float
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    layer: LayerCost | None = None

    @property
    def min_chips(self) -> int:
        """Chips that hold the whole job, its whole batch's activations included (``training.memory.min_chips``);
        computed when asked, not in the planner's loop."""
        return min_chips(self.config)

    @property
    def tokens_per_s(self) -> float:
        return self.config.batch_tokens / self.step_time_s

    @property
    def peak_flops_total(self) -> float:
        return self.config.layout.chips * self.config.chip.flops(self.config.dtype)

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step_time_s * self.peak_flops_total)

    @property
    def hfu(self) -> float:
        return self.hardware_flops_per_step / (self.step_time_s * self.peak_flops_total)

    @property
    def bottleneck(self) -> str:
        b = self.breakdown
        terms = {"compute": b["compute_s"], "bubble": b["bubble_s"], "optimizer": b["optimizer_s"]}
        terms["host offload"] = b.get("offload_s", 0.0)
        terms |= {
            k.removeprefix("comm_").removesuffix("_s") + " comm": v for k, v in b.items() if k.startswith("comm_")
        }
        return max(terms, key=terms.get)

    def overflow(self) -> str | None:
        """The largest memory part when the job does not fit."""
        if self.memory.fits:
            return None
        parts = {k: v for k, v in self.memory.to_dict().items() if k in ("params", "grads", "optimizer", "activations")}
        return max(parts, key=parts.get)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "model": c.model.name,
            "hardware": c.chip.name,
            "chips": c.layout.chips,
            "layout": dataclasses.asdict(c.layout),
            "layout_text": c.layout.describe(),
            "seq_len": c.seq_len,
            "global_batch": c.global_batch,
            "batch_tokens": c.batch_tokens,
            "microbatch": c.microbatch,
            "microbatches": c.microbatches,
            "remat": c.remat,
            "dtype": c.dtype,
            "optimizer": c.optimizer,
            "flash_attention": c.flash_attention,
            "attention_kernel": c.attention_kernel,
            "elementwise": c.elementwise,
            "tp_comm_overlap": c.tp_comm_overlap,
            "step_time_s": self.step_time_s,
            "breakdown": dict(self.breakdown),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "flops_convention": "model FLOPs from matmul shapes + "
            + ("causal" if c.causal else "full")
            + " attention; hardware FLOPs add recomputation",
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "memory": self.memory.to_dict(),
            "fits": self.memory.fits,
            "overflow": self.overflow(),
            "min_chips": self.min_chips,
            "bottleneck": self.bottleneck,
            "assumptions": list(self.assumptions),
            "ops": step_ops(self),
        }


# ----- time ---------------------------------------------------------------------------------


def _wide(dtype: str) -> str:
    """The dtype of matmuls that low-precision recipes keep wide (attention, logits)."""
    return "bf16" if dtype in ("fp8", "fp4", "int8", "int4") else dtype


# HBM bytes per element of a layer's small ops in the forward pass, bf16 activations (the backward moves twice as
# much, as for every memory-bound op here), by how the stack runs them (TrainConfig.elementwise). Fused: one kernel
# reads its input and writes its output. Eager: PyTorch ops as the reference LLaMA code (Meta's llama/model.py)
# writes them, each kernel reading and writing whole tensors, counted kernel by kernel:
# * RMSNorm, ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w``: cast up 2+4, square 4+4,
#   mean 4, scale 4+4, cast down 4+2, weight 2+2 = 36 (fused: 2+2);
# * rotary embedding of each query and key element, through complex fp32: cast up 2+4, complex product 4+4, cast
#   down 4+2 = 20 (fused: 2+2);
# * SwiGLU, ``silu(a) * b`` on [tokens, F]: silu 2+2, product 2+2+2 = 10 (fused: read a and b, write one: 6); GeLU
#   is one kernel either way (2+2).
NORM_BYTES = {"fused": 4.0, "eager": 36.0}
ROPE_BYTES = {"fused": 4.0, "eager": 20.0}
SWIGLU_BYTES = {"fused": 6.0, "eager": 10.0}
GELU_BYTES = 4.0
# fp8 GEMMs on a GPU take fp8 operands in both layouts, so Transformer Engine casts around every Linear (its
# cast_transpose kernels): in the forward each input's fp8 transpose for the weight gradient (2 bytes an element where
# the kernel before already wrote the fp8 copy: the norms for the QKV and MLP-up inputs, the activation for the
# MLP-down input; 4, a cast and a transpose from bf16, for the attention output going into its projection), in the
# backward each output gradient cast and transposed from bf16 (4 bytes an element). The measured fp8 GEMM rates
# (efficiency.GEMM_CEILING) time the GEMM alone.
FP8_TRANSPOSE_BYTES = 2.0
FP8_CAST_TRANSPOSE_BYTES = 4.0


def _compute_ops(cfg: TrainConfig) -> list[tuple[str, str, float, float, float, float]]:
    """The forward and backward ops of one layer for one microbatch (matmuls by shape, the rest by bytes)."""
    m, lay, chip, dt = cfg.model, cfg.layout, cfg.chip, cfg.dtype
    t, cp = lay.tp, lay.cp
    s_local = cfg.seq_len / cp
    tokens = cfg.microbatch * s_local
    d = m.d_model
    q = m.heads / t
    kv = max(m.kv_heads / t, 1.0)
    # the attention head width the score matmuls see: H, or with MLA the mean of the Q/K width and V's
    h = (m.q_dim + m.v_dim) / (2 * m.heads)
    ops: list[tuple[str, str, float, float, float, float]] = []

    def mm(name: str, mm_m: float, k: float, n: float, batch: float = 1.0) -> None:
        tm = eff.matmul_time(chip, mm_m, k, n, dt, batch)
        ops.append((name, "matmul", tm, 2 * tm, 2.0 * batch * mm_m * k * n, 0.0))

    def mem(name: str, nbytes: float, kind: str = "elementwise") -> None:
        tm = eff.memory_time(chip, nbytes)
        ops.append((name, kind, tm, 2 * tm, 0.0, nbytes))

    if m.is_mla:  # the query and the latent KV projections, down and up, as one product of their weights
        mm("qkv", tokens, d, (m.attention_matmul_params - m.v_dim * d) / (d * t))
    else:
        mm("qkv", tokens, d, (q + 2 * kv) * m.head_dim)
    if cfg.pallas_blocks is not None:  # the lab's Pallas kernel: priced from its block pairs
        ops.append(pallas_attention(cfg, q, kv, h, s_local, _wide(cfg.dtype)))
        return _rest_of_layer(cfg, tokens, q, kv, ops, mm, mem)
    # The share of the score matrix computed: a fused kernel skips the blocks the causal mask and a sliding window
    # leave out (the layers' mean, ModelConfig.attended); the unfused path computes every score and masks them.
    visited = m.attended(cfg.seq_len, cfg.causal) / (m.layers * cfg.seq_len) if cfg.flash_attention else 1.0
    # fp8 recipes (Transformer Engine and the like) keep attention and the output layer in bf16.
    bmm = 2 * eff.matmul_time(chip, s_local, h, cfg.seq_len, _wide(dt), cfg.microbatch * q) * visited
    bmm_flops = 2 * 2.0 * cfg.microbatch * q * s_local * h * cfg.seq_len * visited  # QK^T and AV
    if cfg.flash_attention and kernels.measured_kernel(cfg, s_local):
        fwd = kernels.fused_attention_time(cfg, s_local, bmm_flops, _wide(dt))
        ops.append(("attention", "attention", fwd, 2.5 * fwd, bmm_flops, 0.0))
    elif cfg.flash_attention:
        ops.append(("attention", "attention", bmm, 2.5 * bmm, bmm_flops, 0.0))
    else:
        ops.append(("attention.bmm", "attention", bmm, 2 * bmm, bmm_flops, 0.0))
        scores = cfg.microbatch * q * s_local * cfg.seq_len
        mem("attention.softmax", scores * (4.0 + (5.0 if m.dropout else 0.0)), "attention")
    return _rest_of_layer(cfg, tokens, q, kv, ops, mm, mem)


def _rest_of_layer(cfg: TrainConfig, tokens: float, q: float, kv: float, ops: list, mm, mem) -> list:
    """The layer's ops after attention's scores: rotary embedding, the output projection, the MLP, the norms and
    the residual adds (and a calibrated host's op factors over them all)."""
    m, lay, chip, dt = cfg.model, cfg.layout, cfg.chip, cfg.dtype
    t, d = lay.tp, m.d_model
    if not m.learned_positions:  # rotary embedding of the queries and keys (MLA: their decoupled RoPE part)
        rotated = (q + 1) * m.rope_head_dim if m.is_mla else (q + kv) * m.head_dim
        mem("rope", tokens * rotated * ROPE_BYTES[cfg.elementwise])
    mm("out_proj", tokens, m.v_dim / t, d)
    _mlp_ops(cfg, tokens, ops, mm, mem)
    if dt == "fp8" and chip.kind == "gpu":
        qkv_flops = next(o[4] for o in ops if o[0] == "qkv")
        ops.append(_fp8_casts(cfg, tokens, qkv_flops / (2.0 * tokens * d)))
    sp_div = t if lay.sequence_parallel else 1
    mem("norms", tokens / sp_div * d * 2 * NORM_BYTES[cfg.elementwise])  # two per layer
    mem("residuals", tokens / sp_div * d * (12.0 + (2.0 if m.dropout else 0.0)))  # two (bias-dropout-)adds
    if chip.kind == "cpu" and chip.calibration.get("op_factor"):  # a calibrated host: its measured op factors
        ops = [(o[0], o[1], *(x * eff.host_factor(chip, o[1]) for x in o[2:4]), *o[4:]) for o in ops]
    return ops


def _fp8_casts(cfg: TrainConfig, tokens: float, qkv_width: float) -> tuple[str, str, float, float, float, float]:
    """Transformer Engine's casts around a layer's four projections in fp8 (FP8_CAST_TRANSPOSE_BYTES), for ``tokens``
    on one TP rank; ``qkv_width``: the QKV projection's output per token on it. Its bytes are a third of forward and
    backward together, as the op list counts an op's bytes (its backward moves twice its forward's)."""
    m, t, d = cfg.model, cfg.layout.tp, cfg.model.d_model
    ff = m.d_ff * ((m.experts_per_token + m.shared_experts) if m.is_moe else 1)  # an expert layer's, all its experts
    gate = 2 if m.gated_mlp else 1
    fwd = tokens * ((2 * d + ff / t) * FP8_TRANSPOSE_BYTES + m.v_dim / t * FP8_CAST_TRANSPOSE_BYTES)
    bwd = tokens * (qkv_width + gate * ff / t + 2 * d) * FP8_CAST_TRANSPOSE_BYTES
    chip = cfg.chip
    return ("fp8.casts", "elementwise", eff.memory_time(chip, fwd), eff.memory_time(chip, bwd), 0.0, (fwd + bwd) / 3)


def _mlp_ops(cfg: TrainConfig, tokens: float, ops: list, mm, mem) -> None:
    """The MLP's ops of the average layer: the routed experts (each expert's share of the tokens, padded to the
    capacity factor) and the shared ones in an expert layer, the dense MLP in a dense one, weighted by how many
    layers are which (an MoE model's leading dense layers)."""
    m, lay, t = cfg.model, cfg.layout, cfg.layout.tp
    d, gate = m.d_model, (2 if m.gated_mlp else 1)
    moe_share = m.moe_layers / m.layers if m.is_moe else 1.0
    start = len(ops)
    if m.is_moe:
        mm("router", tokens, d, m.experts)
    experts_local = m.experts / lay.ep
    per_expert = tokens * m.experts_per_token * lay.ep / m.experts * (cfg.capacity_factor if m.is_moe else 1.0)
    mm("mlp.up", per_expert, d, m.d_ff * gate / t, experts_local)
    if m.is_moe:  # dispatch and combine: each routed token's row copied out to its expert slot and back (bf16)
        mem("moe.dispatch", tokens * m.experts_per_token * cfg.capacity_factor * d * 2.0 * 2 * 2)
    if m.shared_experts:
        mm("mlp.shared", tokens, d, m.shared_experts * m.d_ff * (gate + 1) / t)  # up (and gate) and down, fused
    act_elems = tokens * (m.experts_per_token + m.shared_experts) * m.d_ff / t
    mem("mlp.activation", act_elems * (SWIGLU_BYTES[cfg.elementwise] if m.gated_mlp else GELU_BYTES))
    mm("mlp.down", per_expert, m.d_ff / t, d, experts_local)
    if moe_share < 1.0:  # the expert layers' MLP ops for their share of the layers, the dense MLP for the rest
        _weigh(ops, start, moe_share)
        dense = len(ops)
        mm("mlp.dense", tokens, d, m.dense_ff * gate / t)  # up (and gate)
        mm("mlp.dense_down", tokens, m.dense_ff / t, d)
        _weigh(ops, dense, 1.0 - moe_share)


def _weigh(ops: list, start: int, w: float) -> None:
    """Scale the times, FLOPs and bytes of ``ops[start:]`` by ``w`` (their share of the layers)."""
    ops[start:] = [(n, k, f * w, b * w, fl * w, by * w) for n, k, f, b, fl, by in ops[start:]]


def layer_key(lay: Layout, microbatch: int) -> tuple[tuple, tuple]:
    """What :func:`layer_compute` and :func:`layer_cost` depend on, of a layout and a microbatch size, besides the
    recomputation policy (which the layer cost reads too), with the model, the chip and the job's other settings
    held fixed, as a search's cache keys: the ops' (tp, cp, ep, sequence parallelism and the microbatch), and the
    layer cost's (those, and the groups known to cross the slow link)."""
    ops = (lay.tp, lay.cp, lay.ep, lay.sequence_parallel, microbatch)
    return ops, (ops, lay.cross_node)


def layer_compute(cfg: TrainConfig) -> tuple[tuple[tuple[str, str, float, float, float, float], ...], float]:
    """One layer's ops for one microbatch (``LayerCost.ops``) and the logits' time: what no recomputation policy
    changes."""
    return tuple(_compute_ops(cfg)), _logits_time(cfg)


def layer_cost(cfg: TrainConfig, compute: tuple | None = None) -> LayerCost:
    """Per-op forward/backward times of one layer, and the communication it exposes (module docstring).

    ``compute``: this config's :func:`layer_compute` (a search shares it between policies, :func:`layer_key`)."""
    ops, logits = compute if compute is not None else layer_compute(cfg)
    fwd = sum(o[2] for o in ops)
    bwd = sum(o[3] for o in ops)
    per_layer = collectives(cfg, roles=("tp", "ep", "cp"), per="layer")
    times = list(zip(per_layer, prices(cfg.chip, cfg.layout, per_layer), strict=True))
    tp_times = [(c, t) for c, t in times if c.role == "tp" and not c.hidden]
    tp = tp_overlapped(cfg, ops, tp_times) if cfg.tp_comm_overlap else sum(c.calls * t for c, t in tp_times)
    ep = sum(c.calls * t for c, t in times if c.role == "ep")
    cp_exposed = 0.0
    for c, t in times:
        if c.role == "cp" and cfg.spmd_context:  # gathered and reduced in line with the attention around them
            cp_exposed += c.calls * t
        elif c.role == "cp":  # the ring's passes hide behind attention where they can (forward 1, backward 2)
            ring = c.calls / 3 * t
            att = sum(o[2] for o in ops if o[1] == "attention")
            cp_exposed = max(0.0, ring - att) + max(0.0, 2 * ring - 2.5 * att)
    named = remat_policy(cfg.remat)
    offload = 0.0
    if named is not None:  # what the policy did not keep (lab.predict.training.remat)
        recomputed = tuple(o[0] for o in ops if o[0] in remat_recomputed(named))
        if named.offloaded:  # kept in host memory: out in the forward, back in the backward, behind the compute
            tokens = cfg.microbatch * cfg.seq_len / cfg.layout.cp
            moved = 2.0 * tokens * saved_elements(named, cfg.model, cfg.layout.tp, cfg.layout.sequence_parallel)
            link = moved / eff.host_link_bandwidth(cfg.chip)
            again = sum(o[2] for o in ops if o[0] in recomputed)
            offload = max(0.0, link - fwd) + max(0.0, link - bwd - again)
    elif cfg.remat == "full":  # JAX's recomputation skips the layer's last projection (TrainConfig); an expert
        # layer ends in the combine, so its experts' down projection runs again
        last = "mlp.down" if not cfg.model.is_moe else "mlp.dense_down"  # a leading dense layer's
        recomputed = tuple(o[0] for o in ops if not (cfg.jax_remat and o[0] == last))
    elif cfg.remat == "selective" and cfg.pallas_blocks is not None:  # the kernel's forward is no saved matmul
        recomputed = ("attention.pallas", "norms", "mlp.activation")
    elif cfg.remat == "selective" and not cfg.flash_attention:
        recomputed = tuple(o[0] for o in ops if o[1] == "attention")
    elif cfg.remat == "selective":  # fused attention: recompute the norms and the MLP activation instead
        recomputed = ("norms", "mlp.activation")
    else:
        recomputed = ()
    recompute = sum(o[2] for o in ops if o[0] in recomputed)
    return LayerCost(
        fwd=fwd,
        bwd=bwd,
        recompute=recompute,
        tp_comm=tp,
        ep_comm=ep,
        cp_exposed=cp_exposed,
        logits=logits,
        ops=ops,
        recomputed=recomputed,
        offload=offload,
    )


def _logits_time(cfg: TrainConfig) -> float:
    """Last stage: output projection forward and backward, and the cross-entropy over the vocabulary."""
    m, lay = cfg.model, cfg.layout
    tokens = cfg.microbatch * cfg.seq_len / lay.cp
    mm = eff.matmul_time(cfg.chip, tokens, m.d_model, m.vocab / lay.tp, _wide(cfg.dtype))
    ce = eff.memory_time(cfg.chip, tokens * m.vocab / lay.tp * 10.0)  # bf16 logits in, fp32 softmax, grads out
    chip = cfg.chip
    return 3 * mm * eff.host_factor(chip, "matmul") + ce * eff.host_factor(chip, "elementwise")


def step_terms(cfg: TrainConfig) -> tuple[LayoutTerms, MicrobatchTerms, FsdpTerms | None]:
    """The step's parts besides the layer cost (:mod:`lab.predict.training.step`), priced for ``cfg``."""
    chip, lay = cfg.chip, cfg.layout
    local = local_params(cfg.model, lay, ends_on_every_stage=cfg.spmd_pipeline)
    dp, loss, tail, gather = dp_times(chip, lay, role_comms(cfg, "dp"), cfg.dp_bucket_bytes, cfg.weights_per_grad)
    terms = (dp, loss, local, tail, gather, cfg.dp_overlap, cfg.spmd_pipeline)
    lt = layout_terms(cfg.model, chip, lay, cfg.optimizer, *terms)
    pp, tp = pp_time(chip, lay, role_comms(cfg, "pp")), tp_microbatch_time(chip, lay, role_comms(cfg, "tp"))
    mt = microbatch_terms(lay, cfg.microbatches, pp, tp)
    return lt, mt, fsdp_terms(chip, lay, role_comms(cfg, "fsdp"))


def estimate(
    cfg: TrainConfig, *, check: bool = True, layer: LayerCost | None = None, terms: tuple | None = None
) -> TrainEstimate:
    """Predict one training step (see the module docstring for the model and its assumptions).

    The step time is :func:`lab.predict.training.step.step_parts` of the layer cost and the other terms
    (:func:`step_terms`); ``layer`` and ``terms``, when given, are this config's, priced already (the planner caches
    them on what they depend on: :func:`layer_key`, ``training.comm.content_key``).
    """
    if check:
        check_config(cfg)
    m, lay, chip = cfg.model, cfg.layout, cfg.chip
    lc = layer if layer is not None else layer_cost(cfg)
    lt, mt, ft = terms if terms is not None else step_terms(cfg)
    parts = step_parts(chip, lc, lt, mt, ft)
    layers, n_mb = lt.layers, mt.n_mb
    tokens = cfg.batch_tokens
    model_flops = m.flops_per_token(cfg.seq_len, causal=cfg.causal) * tokens
    # Under fused attention, selective recomputation reruns elementwise ops only: no extra FLOPs.
    if remat_policy(cfg.remat) is not None:  # the recomputed ops' FLOPs, over every layer, microbatch and chip
        again = sum(o[4] for o in lc.ops if o[0] in lc.recomputed)
        hw_flops = model_flops + again * layers * n_mb * lay.chips  # layers: this chip's stage's
    else:
        counted = "none" if (cfg.remat == "selective" and cfg.flash_attention) else cfg.remat
        hw_flops = m.flops_per_token(cfg.seq_len, causal=cfg.causal, recompute=counted) * tokens
    mem = memory_per_chip(cfg)
    return TrainEstimate(
        config=cfg,
        step_time_s=parts[0],
        breakdown=breakdown(parts, lt, mt),
        memory=mem,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        assumptions=(*(_TP_OVERLAPPED if cfg.tp_comm_overlap else ASSUMPTIONS), _precision(cfg)),
        layer=lc,
    )


def step_ops(est: TrainEstimate) -> list[dict[str, Any]]:
    """The step as named ops on one chip: each kernel scope's compute (forward, backward and recomputation over
    every layer and microbatch), the logits, the optimizer, and every collective with its calls and bytes."""
    cfg, lc = est.config, est.layer
    m, lay = cfg.model, cfg.layout
    runs = cfg.pipeline_steps * lay.stage_layers(m.layers)  # layer executions per step (the SPMD pipeline's idle too)
    rows: dict[str, dict[str, Any]] = {}
    for name, kind, f, b, flops, nbytes in lc.ops:
        again = name in lc.recomputed
        scope = (m.is_moe and MOE_SCOPES.get(name)) or SCOPES.get(name, name)
        r = rows.setdefault(scope, {"name": scope, "kind": kind, "time_s": 0.0, "flops": 0.0, "bytes": 0.0})
        r["time_s"] += runs * (f + b + (f if again else 0.0))
        r["flops"] += runs * flops * (1 + BACKWARD_FLOPS.get(name, 2.0) + (1 if again else 0))
        r["bytes"] += runs * nbytes * (3 + (1 if again else 0))
        if kind == "matmul":
            r["kind"] = "matmul"
    tokens = cfg.microbatch * cfg.seq_len / lay.cp
    logits_flops = 3 * 2.0 * tokens * m.d_model * m.vocab / lay.tp
    out = list(rows.values())
    out.append(
        {
            "name": "logits",
            "kind": "matmul",
            "time_s": cfg.microbatches * lc.logits,
            "flops": cfg.microbatches * logits_flops,
            "bytes": 0.0,
        }
    )
    out.append(
        {"name": "optimizer", "kind": "elementwise", "time_s": est.breakdown["optimizer_s"], "flops": 0.0, "bytes": 0.0}
    )
    for c in collectives(cfg):
        n = calls_per_step(cfg, c)
        hidden = c.hidden or ("gemm" if cfg.tp_comm_overlap and c.role == "tp" and c.per == "layer" else "")
        out.append(
            {
                "name": c.what,
                "kind": c.kind,
                "time_s": n * comm_time(cfg, c),
                "flops": 0.0,
                "bytes": n * c.bytes,
                "role": c.role,
                "calls": n,
                "dtype": c.dtype,
                "hidden": hidden or None,  # gemm: under the GEMM it feeds or follows (tp_comm_overlap)
            }
        )
    return out


def _precision(cfg: TrainConfig) -> str:
    kept = "bf16; optimizer state fp32" if cfg.param_dtype == "bf16" else "fp32 (master copy); optimizer moments fp32"
    return f"gradients reduced in {'fp32' if cfg.grad_reduce_bytes == 4.0 else 'bf16'}; weights {kept}"


ASSUMPTIONS = (
    "TP and EP collectives and pipeline sends are not overlapped with compute",
    "FSDP gathers/scatters overlap the same layer's compute; DP gradient reduction overlaps the last backward",
    "SP's re-gathered inputs for the weight gradients overlap the input-gradient matmul",
)
_TP_OVERLAPPED = (
    "TP's AllGathers and ReduceScatters run in chunks under the layer's GEMMs (--tp-comm-overlap); EP collectives "
    "and pipeline sends are not overlapped with compute",
    *ASSUMPTIONS[1:],
)


__all__ = [
    "ASSUMPTIONS",
    "BACKWARD_FLOPS",
    "GRAD_BYTES",
    "MOE_SCOPES",
    "OPTIMIZERS",
    "REMAT",
    "SCHEDULES",
    "SCOPES",
    "WEIGHT_BYTES",
    "LayerCost",
    "Layout",
    "Memory",
    "TrainConfig",
    "TrainEstimate",
    "activation_bytes_per_layer",
    "check_config",
    "estimate",
    "layer_compute",
    "layer_cost",
    "layer_key",
    "layer_params_local",
    "local_params",
    "memory_per_chip",
    "min_chips",
    "state_min_chips",
    "step_ops",
    "step_terms",
]


def __getattr__(name: str):
    """``Limits`` and ``limits`` (the book's thresholds, :mod:`lab.predict.training.limits`, whose ``__all__`` lists
    them) are read from here on first use: an estimate does not need them, and importing them cost every
    estimate's start-up a frozen dataclass."""
    if name in ("Limits", "limits"):
        from lab.predict.training import limits as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
