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
  ``(pp-1)/v`` microbatch-times (v = 1 unless interleaved).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.predict import efficiency as eff

REMAT = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
OPTIMIZERS = {"adam": 12.0, "sgd": 8.0, "adafactor": 4.0}  # optimizer bytes per parameter (master + moments)
UPDATE_BYTES = {"adam": 30.0, "sgd": 20.0, "adafactor": 18.0}  # HBM traffic of one update per parameter
WEIGHT_BYTES, GRAD_BYTES = 2.0, 4.0


@dataclass(frozen=True)
class Layout:
    """Parallelism degrees and their options."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    interleave: int = 1

    @property
    def chips(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    @property
    def fsdp_eff(self) -> int:
        """Weight-sharding degree: fsdp, times dp under ZeRO-3."""
        return self.fsdp * (self.dp if self.zero == 3 else 1)

    @property
    def dp_eff(self) -> int:
        """Replicas that all-reduce gradients once per step."""
        return 1 if self.zero == 3 else self.dp

    @property
    def v(self) -> int:
        return self.interleave if self.pp_schedule == "interleaved" else 1

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "fsdp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"x{self.interleave}" if self.pp_schedule == "interleaved" else ""))
        return " ".join(parts) or "single chip"


@dataclass(frozen=True)
class TrainConfig:
    """One training job: model, hardware, layout, batch and policies."""

    model: ModelConfig
    chip: Chip
    layout: Layout
    seq_len: int
    global_batch: int  # sequences per step
    microbatch: int = 1
    remat: str = "selective"
    checkpoints_per_layer: float | None = None
    dtype: str = "bf16"
    optimizer: str = "adam"
    flash_attention: bool = True
    causal: bool = True  # for the MFU convention and flash attention's skipped blocks

    @property
    def batch_tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per step."""
        return self.global_batch // (self.microbatch * self.layout.dp * self.layout.fsdp)


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    activations_per_layer: float
    hbm_bytes: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm_bytes

    def to_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "activations_per_layer": self.activations_per_layer,
            "total": self.total,
            "hbm_bytes": self.hbm_bytes,
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
    min_chips: int | None
    assumptions: tuple[str, ...] = field(default_factory=tuple)

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
        }


# ----- validation ---------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(n: int, options: list[int]) -> int:
    return min(options, key=lambda d: (abs(d - n), d))


def check_config(cfg: TrainConfig) -> None:
    """Raise a UserError naming the bad value and a nearby valid one."""
    m, lay = cfg.model, cfg.layout
    for name in ("dp", "fsdp", "tp", "pp", "cp", "ep", "interleave"):
        v = getattr(lay, name)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"--{name} must be a positive integer, got {v!r}")
    if lay.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero {lay.zero} is not one of 0, 1, 2, 3")
    if lay.pp_schedule not in SCHEDULES:
        raise UserError(f"--pp-schedule {lay.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.remat not in REMAT:
        raise UserError(f"--remat {cfg.remat!r} is not one of {', '.join(REMAT)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {cfg.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    for name in ("seq_len", "global_batch", "microbatch"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    cfg.chip.flops(cfg.dtype)
    if m.heads % lay.tp:
        raise UserError(
            f"--tp {lay.tp} does not divide {m.heads} attention heads; try --tp {_nearest(lay.tp, _divisors(m.heads))}"
        )
    if m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        raise UserError(f"--tp {lay.tp} neither divides nor is a multiple of {m.kv_heads} KV heads")
    if m.layers % (lay.pp * lay.v):
        opts = [d for d in _divisors(m.layers) if d % lay.v == 0 or lay.v == 1]
        raise UserError(
            f"--pp {lay.pp}"
            + (f" x --interleave {lay.v}" if lay.v > 1 else "")
            + f" does not divide {m.layers} layers; try --pp "
            f"{_nearest(lay.pp, [d // lay.v for d in opts if d // lay.v >= 1] or [1])}"
        )
    if cfg.seq_len % lay.cp:
        raise UserError(f"--cp {lay.cp} does not divide --seq-len {cfg.seq_len}")
    if lay.sequence_parallel and cfg.seq_len % (lay.tp * lay.cp):
        raise UserError(f"sequence parallelism needs --seq-len divisible by tp x cp = {lay.tp * lay.cp}")
    if lay.ep > 1:
        if not m.is_moe:
            raise UserError(f"--ep {lay.ep} needs a mixture-of-experts model; {m.name} is dense (use --ep 1)")
        if m.experts % lay.ep or (lay.dp * lay.fsdp) % lay.ep:
            raise UserError(f"--ep {lay.ep} must divide the {m.experts} experts and dp x fsdp = {lay.dp * lay.fsdp}")
    replicas = lay.dp * lay.fsdp
    per_replica = cfg.global_batch / replicas
    if cfg.global_batch % replicas:
        lo = max(replicas, cfg.global_batch // replicas * replicas)
        raise UserError(
            f"global batch {cfg.global_batch} sequences does not divide over dp x fsdp = {replicas}; "
            f"try {lo} or {lo + replicas}"
        )
    if cfg.microbatch > per_replica:
        raise UserError(
            f"--microbatch {cfg.microbatch} is larger than the {int(per_replica)} sequences each "
            f"data-parallel replica gets; use at most {int(per_replica)}"
        )
    if per_replica % cfg.microbatch:
        raise UserError(
            f"--microbatch {cfg.microbatch} does not divide the {int(per_replica)} sequences per "
            f"replica; try {_nearest(cfg.microbatch, _divisors(int(per_replica)))}"
        )
    if lay.pp_schedule == "interleaved" and lay.pp > 1 and cfg.microbatches % lay.pp:
        raise UserError(
            f"the interleaved schedule needs the {cfg.microbatches} microbatches to be a multiple of "
            f"--pp {lay.pp} (Megatron's requirement)"
        )


# ----- memory -------------------------------------------------------------------------------


def activation_bytes_per_layer(
    model: ModelConfig,
    layout: Layout,
    seq_len: int,
    microbatch: int,
    remat: str,
    flash_attention: bool,
    checkpoints: float | None = None,
) -> float:
    """Stored activations of one layer for one microbatch on one chip (16-bit activations).

    For a GPT-style layer (MHA, 4h GeLU MLP, dropout, unfused attention) this is Korthikanti et al.
    Table 2: ``sbh(10 + 24/t + 5as/ht)``, ``sbh(34 + 5as/h)/t`` with SP, ``sbh(10 + 24/t)`` selective,
    ``34 sbh/t`` selective + SP, and ``2 sbh`` under full recomputation.
    """
    t, s, b = layout.tp, seq_len / layout.cp, microbatch
    h = model.d_model
    sp = layout.sequence_parallel
    if checkpoints is not None:  # the book's form: k saved [B, D] per layer
        return checkpoints * 2.0 * s * b * h / (t if sp else 1)
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
    f_local = model.d_ff * model.experts_per_token / t
    mlp = 2.0 * s * b * f_local * ((3 if model.gated_mlp else 2) - (1 if dots_only else 0))
    scores = 0.0
    if not flash_attention and remat == "none":
        # softmax output (2 bytes), its dropout mask (1) and dropout output (2): 5 a s^2 b / t
        scores = (2.0 + 3.0 * drop) * (model.heads / t) * s * seq_len * b  # local queries x all keys
    return (shared / (t if sp else 1)) + attn + mlp + scores


def local_params(m: ModelConfig, lay: Layout) -> float:
    """Parameters one chip owns before ZeRO/FSDP: everything / (tp x pp), experts also / ep."""
    dense = m.params - m.expert_params_total
    return dense / (lay.tp * lay.pp) + m.expert_params_total / (lay.tp * lay.pp * lay.ep)


def layer_params_local(m: ModelConfig, lay: Layout) -> float:
    """One layer's parameters on one tensor/expert-parallel rank (what FSDP gathers for that layer)."""
    experts = m.experts * m.expert_params if m.is_moe else 0
    return (m.layer_params - experts + experts / lay.ep) / lay.tp


def memory_per_chip(cfg: TrainConfig) -> Memory:
    m, lay = cfg.model, cfg.layout
    local = local_params(m, lay)
    f = lay.fsdp_eff
    zero_group = lay.dp * lay.fsdp
    params = local * WEIGHT_BYTES / f
    if f > 1:  # the layer being computed (and the next, prefetched) are gathered whole
        params += 2 * layer_params_local(m, lay) * WEIGHT_BYTES
    grads = local * GRAD_BYTES / (zero_group if lay.zero >= 2 else f)
    opt = local * OPTIMIZERS[cfg.optimizer] / (zero_group if lay.zero >= 1 else f)
    per_layer = activation_bytes_per_layer(
        m, lay, cfg.seq_len, cfg.microbatch, cfg.remat, cfg.flash_attention, cfg.checkpoints_per_layer
    )
    layers_per_stage = m.layers / lay.pp
    if lay.pp == 1:
        in_flight = 1.0
    elif lay.pp_schedule == "gpipe":
        in_flight = float(cfg.microbatches)
    else:
        in_flight = float(min(lay.pp, cfg.microbatches))
        if lay.pp_schedule == "interleaved":
            in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.v)
    acts = per_layer * layers_per_stage * in_flight
    # Korthikanti Sec. 4.3: embeddings and logits, 4 s b (h + V) / t on a single stage; s b h p / t otherwise.
    s, b, h = cfg.seq_len / lay.cp, cfg.microbatch, m.d_model
    acts += 4.0 * s * b * (h + m.vocab) / lay.tp if lay.pp == 1 else s * b * h * lay.pp / lay.tp
    return Memory(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=acts,
        activations_per_layer=per_layer,
        hbm_bytes=cfg.chip.hbm_bytes,
    )


# ----- time ---------------------------------------------------------------------------------


def _placement(chip: Chip, size: int, stride: int) -> dict[str, Any]:
    """Where a parallel group of ``size`` chips, ``stride`` apart, sits on the fabric."""
    if size <= 1:
        return {}
    if chip.topology == "torus":
        pod = math.prod(chip.pod_shape or (size,))
        if size * stride <= pod:
            return {"scope": "node"}
        return {"scope": "cross-node"}  # across slices, over DCN
    n = chip.node_size or 1
    if size * stride <= n:
        return {"scope": "node"}
    per_node = max(1, min(size, n // stride)) if stride < n else 1
    while size % per_node:
        per_node -= 1
    return {"scope": "cross-node", "members_per_node": per_node}


@dataclass(frozen=True)
class LayerCost:
    """One layer, one microbatch, one chip: seconds per phase and the communication it exposes."""

    fwd: float
    bwd: float
    recompute: float
    tp_comm: float
    ep_comm: float
    cp_exposed: float
    ops: tuple[tuple[str, str, float, float], ...]  # (name, kind, forward s, backward s)


def _wide(dtype: str) -> str:
    """The dtype of matmuls that low-precision recipes keep wide (attention, logits)."""
    return "bf16" if dtype in ("fp8", "fp4", "int8", "int4") else dtype


def layer_cost(cfg: TrainConfig) -> LayerCost:
    """Per-op forward/backward times of one layer (see the module docstring for the model)."""
    m, lay, chip, dt = cfg.model, cfg.layout, cfg.chip, cfg.dtype
    t, cp = lay.tp, lay.cp
    s_local = cfg.seq_len / cp
    tokens = cfg.microbatch * s_local
    d, h = m.d_model, m.head_dim
    q = m.heads / t
    kv = max(m.kv_heads / t, 1.0)
    ops: list[tuple[str, str, float, float]] = []

    def mm(name: str, mm_m: float, k: float, n: float, batch: float = 1.0) -> None:
        tm = eff.matmul_time(chip, mm_m, k, n, dt, batch)
        ops.append((name, "matmul", tm, 2 * tm))

    def mem(name: str, nbytes: float, kind: str = "elementwise") -> None:
        tm = eff.memory_time(chip, nbytes)
        ops.append((name, kind, tm, 2 * tm))

    mm("qkv", tokens, d, (q + 2 * kv) * h)
    causal_skip = 0.5 if (cfg.flash_attention and cfg.causal) else 1.0
    # fp8 recipes (Transformer Engine and the like) keep attention and the output layer in bf16.
    bmm = 2 * eff.matmul_time(chip, s_local, h, cfg.seq_len, _wide(dt), cfg.microbatch * q) * causal_skip
    if cfg.flash_attention:
        ops.append(("attention", "attention", bmm, 2.5 * bmm))
    else:
        ops.append(("attention.bmm", "attention", bmm, 2 * bmm))
        scores = cfg.microbatch * q * s_local * cfg.seq_len
        mem("attention.softmax", scores * (4.0 + (5.0 if m.dropout else 0.0)), "attention")
    mm("out_proj", tokens, q * h, d)
    if m.is_moe:
        mm("router", tokens, d, m.experts)
    experts_local = m.experts / lay.ep
    per_expert = tokens * m.experts_per_token * lay.ep / m.experts
    up_n = m.d_ff * (2 if m.gated_mlp else 1) / t
    mm("mlp.up", per_expert, d, up_n, experts_local)
    act_elems = tokens * m.experts_per_token * m.d_ff / t
    mem("mlp.activation", act_elems * (6.0 if m.gated_mlp else 4.0))
    mm("mlp.down", per_expert, m.d_ff / t, d, experts_local)
    sp_div = t if lay.sequence_parallel else 1
    mem("norms", tokens / sp_div * d * 8.0)  # two norms: read and write 2 bytes per element each
    mem("residuals", tokens / sp_div * d * (12.0 + (2.0 if m.dropout else 0.0)))  # two (bias-dropout-)adds

    fwd = sum(o[2] for o in ops)
    bwd = sum(o[3] for o in ops)

    # Tensor parallelism: per direction two AllReduces of [tokens, D], or AllGather + ReduceScatter with SP.
    act_bytes = tokens * d * 2.0
    tp_place = _placement(chip, t, 1)
    if lay.sequence_parallel:
        one = eff.comm_time(chip, "all-gather", act_bytes, t, **tp_place) + eff.comm_time(
            chip, "reduce-scatter", act_bytes, t, **tp_place
        )
    else:
        one = eff.comm_time(chip, "all-reduce", act_bytes, t, **tp_place)
    tp_fwd = 2 * one
    # Expert parallelism: dispatch and combine all-to-alls per direction.
    ep_fwd = 0.0
    if lay.ep > 1:
        ep_place = _placement(chip, lay.ep, t * cp)
        ep_fwd = 2 * eff.comm_time(chip, "all-to-all", lay.ep * act_bytes * m.experts_per_token, lay.ep, **ep_place)
    # Context parallelism: KV chunks travel the ring, hidden behind attention where they can be.
    cp_exposed = 0.0
    if cp > 1:
        kv_bytes = 2 * tokens * kv * h * 2.0
        ring = (cp - 1) * eff.comm_time(chip, "permute", kv_bytes, cp, **_placement(chip, cp, t))
        att = sum(o[2] for o in ops if o[1] == "attention")
        cp_exposed = max(0.0, ring - att) + max(0.0, 2 * ring - 2.5 * att)

    recompute = 0.0
    directions = 2  # forward and backward; full recomputation runs the forward's collectives again
    if cfg.remat == "full":
        recompute = fwd
        directions = 3
    elif cfg.remat == "selective" and not cfg.flash_attention:
        recompute = sum(o[2] for o in ops if o[1] == "attention")
    elif cfg.remat == "selective":  # fused attention: recompute the norms and the MLP activation instead
        recompute = sum(o[2] for o in ops if o[0] in ("norms", "mlp.activation"))
    return LayerCost(
        fwd=fwd,
        bwd=bwd,
        recompute=recompute,
        tp_comm=directions * tp_fwd,
        ep_comm=directions * ep_fwd,
        cp_exposed=cp_exposed,
        ops=tuple(ops),
    )


def _logits_time(cfg: TrainConfig) -> float:
    """Last stage: output projection forward and backward, and the cross-entropy over the vocabulary."""
    m, lay = cfg.model, cfg.layout
    tokens = cfg.microbatch * cfg.seq_len / lay.cp
    mm = eff.matmul_time(cfg.chip, tokens, m.d_model, m.vocab / lay.tp, _wide(cfg.dtype))
    ce = eff.memory_time(cfg.chip, tokens * m.vocab / lay.tp * 10.0)  # bf16 logits in, fp32 softmax, grads out
    return 3 * mm + ce


def estimate(cfg: TrainConfig, *, check: bool = True, layer: LayerCost | None = None) -> TrainEstimate:
    """Predict one training step (see the module docstring for the model and its assumptions)."""
    if check:
        check_config(cfg)
    m, lay, chip = cfg.model, cfg.layout, cfg.chip
    lc = layer if layer is not None else layer_cost(cfg)
    layers = m.layers / lay.pp
    n_mb = cfg.microbatches

    compute_mb = layers * (lc.fwd + lc.bwd + lc.recompute) + _logits_time(cfg)
    tp_mb = layers * lc.tp_comm
    ep_mb = layers * lc.ep_comm
    cp_mb = layers * lc.cp_exposed

    # Pipeline sends: activations forward, gradients backward, once per chunk boundary.
    pp_mb = 0.0
    if lay.pp > 1:
        # Megatron's scatter/gather: each tensor-parallel rank sends 1/tp of the activation (Narayanan Sec. 4.1).
        nbytes = cfg.microbatch * cfg.seq_len / lay.cp * m.d_model * 2.0 / lay.tp
        stride = lay.tp * lay.cp * lay.fsdp * lay.dp
        pp_mb = 2 * lay.v * eff.comm_time(chip, "permute", nbytes, lay.pp, **_placement(chip, lay.pp, stride))

    # FSDP: gather weights before each layer's forward and backward, scatter its gradients after.
    fsdp_mb = 0.0
    f = lay.fsdp_eff
    if f > 1:
        wbytes = layer_params_local(m, lay) * WEIGHT_BYTES
        place = _placement(chip, f, lay.tp * lay.cp)
        ag = eff.comm_time(chip, "all-gather", wbytes, f, **place)
        rs = eff.comm_time(chip, "reduce-scatter", wbytes, f, **place)
        fwd_c, bwd_c = lc.fwd, lc.bwd + lc.recompute
        fsdp_mb = layers * (max(0.0, ag - fwd_c) + max(0.0, ag + rs - bwd_c))

    t_mb = compute_mb + tp_mb + ep_mb + cp_mb + pp_mb + fsdp_mb
    bubble_mb = (lay.pp - 1) / lay.v if lay.pp > 1 else 0.0
    bubble = bubble_mb * t_mb

    # Data parallelism: one gradient reduction per step, behind the last microbatch's backward.
    local = local_params(m, lay)
    dp_exposed = 0.0
    dp_comm = 0.0
    if lay.dp_eff > 1:
        gbytes = local / f * 2.0  # bf16 gradients (the book's convention)
        place = _placement(chip, lay.dp_eff, lay.tp * lay.cp * lay.fsdp)
        dp_comm = eff.comm_time(chip, "all-reduce", gbytes, lay.dp_eff, **place)
        dp_exposed = max(0.0, dp_comm - layers * (lc.bwd + lc.recompute))

    # Optimizer: a memory-bound pass over this chip's share of the state.
    shard = lay.dp * lay.fsdp if lay.zero >= 1 else f
    optimizer = eff.memory_time(chip, local / shard * UPDATE_BYTES[cfg.optimizer])

    step = n_mb * t_mb + bubble + dp_exposed + optimizer
    breakdown = {
        "compute_s": n_mb * compute_mb,
        "exposed_comm_s": n_mb * (tp_mb + ep_mb + cp_mb + pp_mb + fsdp_mb) + dp_exposed,
        "bubble_s": bubble,
        "optimizer_s": optimizer,
        "comm_tp_s": n_mb * tp_mb,
        "comm_ep_s": n_mb * ep_mb,
        "comm_cp_s": n_mb * cp_mb,
        "comm_pp_s": n_mb * pp_mb,
        "comm_fsdp_s": n_mb * fsdp_mb,
        "comm_dp_s": dp_exposed,
        "dp_reduction_s": dp_comm,
    }
    tokens = cfg.batch_tokens
    model_flops = m.flops_per_token(cfg.seq_len, causal=cfg.causal) * tokens
    # Under fused attention, selective recomputation reruns elementwise ops only: no extra FLOPs.
    counted = "none" if (cfg.remat == "selective" and cfg.flash_attention) else cfg.remat
    hw_flops = m.flops_per_token(cfg.seq_len, causal=cfg.causal, recompute=counted) * tokens
    mem = memory_per_chip(cfg)
    return TrainEstimate(
        config=cfg,
        step_time_s=step,
        breakdown=breakdown,
        memory=mem,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        min_chips=min_chips(cfg, mem),
        assumptions=ASSUMPTIONS,
    )


ASSUMPTIONS = (
    "TP and EP collectives and pipeline sends are not overlapped with compute",
    "FSDP gathers/scatters overlap the same layer's compute; DP gradient reduction overlaps the last backward",
    "gradients reduced in bf16; weights bf16; optimizer state fp32",
)


def min_chips(cfg: TrainConfig, mem: Memory | None = None) -> int | None:
    """Smallest chip count whose HBM holds the job with weights, gradients and optimizer state sharded over
    every chip (ZeRO-3), at this config's per-chip activations. None if the activations alone overflow."""
    mem = mem or memory_per_chip(cfg)
    state = cfg.model.params * (WEIGHT_BYTES + GRAD_BYTES + OPTIMIZERS[cfg.optimizer])
    room = cfg.chip.hbm_bytes - mem.activations
    if room <= 0:
        return None
    return max(1, math.ceil(state / room))


# ----- the book's thresholds -----------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Communication thresholds of the scaling book (training.md; gpus.md for GPUs).

    ``alpha = C / W`` with W the bandwidth an AllGather sees per chip: the bidirectional ICI link
    times the number of axes on a TPU, NVLink egress inside a GPU node, node egress across nodes.
    """

    hardware: str
    d_ff: int | None
    axes: int
    tp_axes: int
    alpha: float
    dp_min_tokens_per_chip: float
    dp_min_tokens_per_chip_cross_node: float
    tp_max_degree: float | None
    fsdp_tp_min_tokens_per_chip: float | None
    fsdp_opt_degree: float | None
    dcn_min_tokens_per_slice: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def limits(
    chip: Chip,
    d_ff: int | None = None,
    *,
    axes: int = 1,
    tp_axes: int = 1,
    chips: int | None = None,
    batch_tokens: float | None = None,
    dtype: str = "bf16",
) -> Limits:
    """The book's DP, TP and FSDP+TP thresholds for ``chip`` (and a model's ``d_ff``)."""
    for name, v in (("--axes", axes), ("--tp-axes", tp_axes)):
        if v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    c = chip.flops(dtype)
    if chip.topology == "torus":
        w = chip.ici_bidirectional
        cross = c / chip.scaleout_bandwidth
        dcn = c / chip.scaleout_bandwidth
    else:
        w = chip.link_bandwidth
        cross = c / (chip.node_size * chip.scaleout_bandwidth)
        dcn = None
    alpha = c / w
    tp_max = fsdp_tp = opt = None
    if d_ff is not None:
        tp_max = tp_axes * d_ff * w / c  # training.md: Y < M_Y F / alpha
        fsdp_tp = alpha**2 / (axes * tp_axes * d_ff)  # B/N > alpha^2 / (M_X M_Y F)
        if chips and batch_tokens:
            opt = math.sqrt(batch_tokens / d_ff * axes / tp_axes * chips)  # X_opt = sqrt(B/F * M_X/M_Y * N)
    return Limits(
        hardware=chip.name,
        d_ff=d_ff,
        axes=axes,
        tp_axes=tp_axes,
        alpha=alpha,
        dp_min_tokens_per_chip=alpha / axes,
        dp_min_tokens_per_chip_cross_node=cross,
        tp_max_degree=tp_max,
        fsdp_tp_min_tokens_per_chip=fsdp_tp,
        fsdp_opt_degree=opt,
        dcn_min_tokens_per_slice=dcn,
    )
