"""One training job as the estimator sees it: parallel degrees (:class:`Layout`) and the job (:class:`TrainConfig`),
and the checks that refuse a job that cannot run, naming the bad value and a nearby valid one."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.core.degrees import DEGREES
from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.core.units import wire_bytes
from lab.predict.training.remat import policy as remat_policy

REMAT = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
OPTIMIZERS = {"adam": 12.0, "sgd": 8.0, "adafactor": 4.0}  # optimizer bytes per parameter (master + moments)
UPDATE_BYTES = {"adam": 30.0, "sgd": 20.0, "adafactor": 18.0}  # HBM traffic of one update per parameter
WEIGHT_BYTES, GRAD_BYTES = 2.0, 4.0  # mixed precision: bf16 weights, fp32 gradients (Korthikanti et al., Fig. 1)
MASTER_BYTES = 4.0  # the fp32 master copy inside OPTIMIZERS' bytes: not kept when the weights are fp32 already
PARAM_DTYPES = ("bf16", "fp32")
# How a stack runs a layer's small ops (norms, rotary embedding, the gated activation); bytes per element in
# lab.predict.training.estimate: fused (one kernel each: Megatron/Transformer Engine, XLA, torch.compile) or eager
# (PyTorch eager ops as the reference LLaMA code writes them, fp32 intermediates between kernels).
ELEMENTWISE = ("fused", "eager")
GRAD_REDUCE = ("fp32", "bf16")


# The book's k saved [tokens, d_model] tensors per layer: a few (selective recomputation) to a few hundred (every
# activation kept, the attention scores of a long sequence included); more is past any layer, a typo.
MAX_CHECKPOINTS_PER_LAYER = 1000


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
    cross_node: tuple[str, ...] = ()  # roles whose group is known to cross the slow link (DCN / scale-out)
    # Pipeline split: the embedding and the loss each take a layer's slot, on the first and the last stage
    # (Megatron-Core's account_for_embedding/loss_in_pipeline_split): layers + 2 slots over pp x v chunks.
    pp_embedding_slots: bool = False
    # Uneven pipeline stages: the layers each stage holds, first to last (e.g. fewer on the first and last stage,
    # which also hold the embedding and the loss); empty: layers / pp on every stage.
    stage_split: tuple[int, ...] = ()
    # The data-parallel ranks ZeRO shards the optimizer state (and, from stage 2, the gradients) over: 0 for every rank
    # of the DP group; a smaller group (a node's: DeepSpeed's MiCS and hpZ partitions, Megatron's distributed-optimizer
    # instances) keeps the states of each group, gathers the updated weights inside it and all-reduces gradients
    # across groups.
    zero_shard: int = 0
    # Context-parallel ranks hold the same weights (each a share of a sequence's tokens), so their gradients are
    # reduced, and ZeRO's or FSDP's state sharded, with the data-parallel ranks': one group over dp x cp
    # (Megatron-Core's data-parallel group with context parallelism, parallel_state's _DATA_PARALLEL_GROUP_WITH_CP,
    # which its DDP and distributed optimizer use; torchtitan's FSDP over its dp_shard x cp mesh). False: the context
    # shards sum their gradients apart and the state is sharded over dp alone, as the lab's Transformer compiles
    # (TrainConfig.spmd_context).
    cp_in_dp: bool = True

    @property
    def chips(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    def degrees(self) -> dict[str, int]:
        """The degrees as a Plan gives them (:meth:`lab.core.plan.Plan.degrees`, the keywords of
        :func:`lab.core.plan_degrees.plan_from_degrees`): ``dp, fsdp, tp, pp, cp, ep`` and ``sequence_parallel``."""
        return {k: getattr(self, k) for k in DEGREES} | {"sequence_parallel": self.sequence_parallel}

    @property
    def cp_in_fsdp(self) -> bool:
        """The context shards join FSDP's shard group (``cp_in_dp``, with weights sharded over fsdp or ZeRO-3)."""
        return self.cp_in_dp and self.cp > 1 and (self.fsdp > 1 or self.zero == 3)

    @property
    def cp_in_dp_group(self) -> bool:
        """The context shards join the data-parallel reduction (``cp_in_dp``, no FSDP sharding to join)."""
        return self.cp_in_dp and self.cp > 1 and not self.cp_in_fsdp

    @property
    def fsdp_eff(self) -> int:
        """Weight-sharding degree: fsdp, times dp under ZeRO-3, times the context shards (``cp_in_fsdp``)."""
        return self.fsdp * (self.dp if self.zero == 3 else 1) * (self.cp if self.cp_in_fsdp else 1)

    @property
    def dp_eff(self) -> int:
        """Replicas that all-reduce gradients once per step (with the context shards, ``cp_in_dp_group``)."""
        return 1 if self.zero == 3 else self.dp * (self.cp if self.cp_in_dp_group else 1)

    @property
    def zero_group(self) -> int:
        """DP ranks one copy of the ZeRO-sharded state spans (zero_shard, or the whole DP group)."""
        return self.zero_shard or self.dp * (self.cp if self.cp_in_dp_group else 1)

    @property
    def zero_shards(self) -> int:
        """Shards ZeRO's state (zero >= 1) is split over: its group's, times FSDP's (the context shards in one)."""
        return self.zero_group * self.fsdp * (self.cp if self.cp_in_fsdp else 1)

    @property
    def v(self) -> int:
        return self.interleave if self.pp_schedule == "interleaved" else 1

    def stage_layers(self, layers: int) -> float:
        """Transformer layers on the busiest pipeline stage (slots, with ``pp_embedding_slots``)."""
        if self.stage_split:
            return float(max(self.stage_split))
        if self.pp > 1 and self.pp_embedding_slots:
            return (layers + 2) / self.pp
        return layers / self.pp

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}" + (f"/{self.zero_shard}" if self.zero_shard else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"x{self.interleave}" if self.pp_schedule == "interleaved" else ""))
            if self.pp_embedding_slots:
                parts.append("embedding slots")
        if self.stage_split:
            parts.append("split " + "/".join(map(str, self.stage_split)))
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
    # The fused attention kernel on GPUs (lab.predict.efficiency): fa2, what PyTorch SDPA and most stacks run;
    # fa3, FlashAttention-3 / cuDNN (Megatron and NeMo with Transformer Engine).
    attention_kernel: str = "fa2"
    # The lab's Pallas flash attention (lab.core.pallas_cost), or splash, with these (block_q, block_k), clipped to
    # the sequence: its forward, dq and dk/dv kernels priced block pair by block pair (causal pairs above the
    # diagonal skipped). None: the attention ``flash_attention`` says.
    pallas_blocks: tuple[int, int] | None = None
    # The layer's small ops: "fused" kernels (Megatron/Transformer Engine, XLA, torch.compile), or PyTorch "eager"
    # ops as the reference LLaMA code writes them (ELEMENTWISE; bytes per element in lab.predict.training.estimate).
    elementwise: str = "fused"
    # Tensor parallelism's sequence-parallel AllGathers and ReduceScatters run in chunks under the GEMM each feeds or
    # follows (Transformer Engine's userbuffers: Megatron-Core's --tp-comm-overlap, NeMo's ub_tp_comm_overlap, set by
    # NVIDIA's MLPerf recipes); off, they are exposed, as Megatron-LM ran them (Korthikanti et al. 2022).
    tp_comm_overlap: bool = False
    # The data-parallel gradient reduction runs in buckets of ``dp_bucket_bytes`` issued as the backward fills them
    # (PyTorch DDP's 25 MiB by default; Megatron's 40M parameters, DeepSpeed's 5e8 elements: microbenchmarks-added.md
    # P1, P3), so all but the last bucket hide behind the last microbatch's backward and, under ZeRO, the gathered
    # weights behind the next forward (``dp_overlap``); off, the reduction runs after the backward, exposed (DeepSpeed's
    # ZeRO-1/2 default, overlap_comm false).
    dp_overlap: bool = True
    dp_bucket_bytes: float = 25 * 2**20
    # The dtype the gradients are reduced in (data parallel, FSDP, the sequence-parallel norms' over TP): None, the
    # weights' (bf16 under mixed precision: the book's convention); "fp32", the fp32 main gradients Megatron-LM reduces
    # in bf16 training unless --grad-reduce-in-bf16 (arguments.py: accumulate_allreduce_grads_in_fp32), torchtitan's
    # FSDP2 mixed_precision_reduce default and nanotron's ACCUMULATE_GRAD_IN_FP32.
    grad_reduce: str | None = None
    # How the program is written, where XLA or a framework does it differently (the lab's own Transformer keeps
    # fp32 weights and separate Q/K/V and gate/up projections; Megatron-style defaults below).
    param_dtype: str = "bf16"  # bf16: mixed precision (fp32 master copy in the optimizer state); fp32: weights are it
    fused_projections: bool = True  # QKV and gate/up fused: 2 input-gradient reductions per layer, not 5
    # fp32 weights computed in 16 bits: the cast moved ahead of FSDP's gather (the TPU compiler does; XLA:CPU gathers
    # the fp32 weights). Matters only when param_dtype is fp32.
    cast_first: bool = False
    cast_first_out_table: bool = True  # with cast_first, the output table too (XLA:GPU gathers it in fp32)
    # Mixture of experts: each expert computes capacity_factor x its share of the routed tokens (slots padded up to
    # the capacity, as GShard-style dispatch does), and the dispatch and combine move as much; 1.0: dropless and
    # balanced.
    capacity_factor: float = 1.0
    # The lab's expert layers weigh the TP ranks' partial sums in their combine (kernels/transformer/moe_layer.py), so
    # the router's gradient is partial on each TP rank and all-reduced, fused projections or not; Megatron's router
    # reads the whole input and needs no reduction.
    moe_partial_router: bool = False
    # Recomputation as JAX runs it (jax.checkpoint on a layer): under full recomputation XLA drops the layer's last
    # projection from the recomputed forward (nothing in the backward reads its output, the next layer's saved
    # input), so its matmul and its row-parallel collective are not run again. Megatron's recomputation repeats
    # the whole layer. With nothing recomputed, the activations JAX's autodiff saves (training.memory).
    jax_remat: bool = False
    # Under recomputation XLA:CPU gathers a layer's FSDP-sharded norm scales a third time, for the recomputed
    # forward (the TPU compiler keeps them).
    remat_regathers_norms: bool = False
    # A pipeline as the lab's Transformer runs it (GPipe in one SPMD program): every stage computes in all
    # M + p - 1 steps (the idle ones on values nothing reads) and sends after each but the last, whole activations
    # in the compute dtype (Megatron's sends go in M of the steps, split over the TP ranks); every stage holds the
    # embeddings and the final norm, whose gradients the stages sum, and the loss comes from the last stage.
    spmd_pipeline: bool = False
    # Context parallelism as the lab's Transformer compiles it (every activation's T over the context axes under
    # GSPMD): attention gathers K and V whole over the context shards, forward and again backward, and reduces
    # their gradients; the weight gradients are summed over the context shards apart from the data-parallel ones.
    # The all-gather form Llama 3 trained with (Dubey et al., arXiv:2407.21783, Sec. 3.3.2). False: a ring of
    # K, V passes hidden behind attention where it can be (Megatron's).
    spmd_context: bool = False

    @property
    def pipeline_steps(self) -> float:
        """Passes of each stage over all its layers in a step: the microbatches, plus the p - 1 idle steps where the
        SPMD pipeline computes them too (:attr:`spmd_pipeline`), each 1 / v of the stage's layers under the circular
        schedule (its V M + p - 1 steps of one chunk each)."""
        lay = self.layout
        return self.microbatches + ((lay.pp - 1) / lay.v if self.spmd_pipeline and lay.pp > 1 else 0)

    @property
    def weight_bytes(self) -> float:
        """Bytes per stored weight (what FSDP gathers)."""
        return WEIGHT_BYTES if self.param_dtype == "bf16" else 4.0

    @property
    def optimizer_bytes(self) -> float:
        """Optimizer state per parameter; an fp32-weight job keeps no separate master copy."""
        return OPTIMIZERS[self.optimizer] - (MASTER_BYTES if self.param_dtype == "fp32" else 0.0)

    @property
    def grad_reduce_bytes(self) -> float:
        """Bytes per gradient element on the wire: ``grad_reduce``'s, else the weights' (bf16 under mixed precision,
        the book's convention; fp32 weights, fp32)."""
        if self.grad_reduce is not None:
            return 4.0 if self.grad_reduce == "fp32" else 2.0
        return 2.0 if self.param_dtype == "bf16" else 4.0

    @property
    def weights_per_grad(self) -> float:
        """A weight's bytes over a reduced gradient's: what ZeRO's gather of the updated weights moves per byte the
        gradients' reduction moved (1 unless ``grad_reduce`` differs from the weights' dtype)."""
        return self.weight_bytes / self.grad_reduce_bytes

    @property
    def act_bytes(self) -> float:
        """Bytes per activation element on the wire: the compute dtype's, 16-bit for fp8/int8 recipes."""
        return wire_bytes(self.dtype)

    @property
    def batch_tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per step."""
        return self.global_batch // (self.microbatch * self.layout.dp * self.layout.fsdp)


# ----- validation ---------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending, in O(sqrt n) steps (model dims are at most 2**30: fast)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _nearest_divisor(n: int, target: int) -> int:
    """A divisor of ``n`` near ``target``: the nearest within 4096 of it, else ``gcd(n, target)``; bounded work
    whatever the size of ``n`` (a batch may be any integer below 2**63)."""
    close = [d for d in range(max(1, target - 4096), min(n, target + 4096) + 1) if n % d == 0]
    return _nearest(target, close) if close else math.gcd(n, target)


def _nearest(n: int, options: list[int]) -> int:
    return min(options, key=lambda d: (abs(d - n), d))


def reduces_each_microbatch(lay: Layout, spmd_pipeline: bool) -> bool:
    """Whether the data-parallel reduction follows every microbatch's backward: under ZeRO-2 (gradients partitioned,
    DeepSpeed's stage 2), except in the lab's SPMD pipeline, which sums its microbatches' gradients in the program."""
    return lay.zero == 2 and not spmd_pipeline


def check_config(cfg: TrainConfig) -> None:
    """Raise a UserError naming the bad value and a nearby valid one: the layout's own values, then the options,
    then how the layout fits the model and the batch (in that order, so the first error names the first cause)."""
    _check_layout(cfg)
    _check_options(cfg)
    _check_fit(cfg)


def _check_layout(cfg: TrainConfig) -> None:
    """Degrees, ZeRO and its shard group, the DP bucket."""
    lay = cfg.layout
    for name in (*DEGREES, "interleave"):
        v = getattr(lay, name)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"--{name} must be a positive integer, got {v!r}")
    if lay.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero {lay.zero} is not one of 0, 1, 2, 3")
    group = lay.dp * (lay.cp if lay.cp_in_dp_group else 1)  # the ranks ZeRO shards over: dp, with the context shards
    if lay.zero_shard and (not isinstance(lay.zero_shard, int) or lay.zero_shard < 1 or group % lay.zero_shard):
        ranks = f"--dp {lay.dp}" + (f" x --cp {lay.cp} = {group}" if group != lay.dp else "")
        raise UserError(
            f"--zero-shard {lay.zero_shard!r} must divide {ranks} (the DP ranks one copy of the state spans), "
            f"e.g. {_nearest_divisor(group, max(int(lay.zero_shard) if isinstance(lay.zero_shard, int) else 1, 1))}"
        )
    if lay.zero_shard and lay.zero not in (1, 2):
        raise UserError(
            f"--zero-shard shards ZeRO-1 or -2's state over part of the DP group; give --zero 1 or 2 "
            f"(got --zero {lay.zero})"
        )
    b = cfg.dp_bucket_bytes
    if isinstance(b, bool) or not isinstance(b, int | float) or not 2**10 <= b <= 2**40:
        raise UserError(
            f"--dp-bucket-mb {b / 2**20 if isinstance(b, int | float) else b!r} must be between 1 KiB and "
            "1 TiB in MiB, e.g. 25"
        )


def _check_options(cfg: TrainConfig) -> None:
    """Kernels, schedule, overlap, remat, MoE capacity, dtypes, optimizer, sizes."""
    lay = cfg.layout
    if cfg.attention_kernel not in ("fa2", "fa3"):
        raise UserError(f"--attention-kernel {cfg.attention_kernel!r} is not one of fa2, fa3")
    if cfg.elementwise not in ELEMENTWISE:
        raise UserError(f"--elementwise {cfg.elementwise!r} is not one of {', '.join(ELEMENTWISE)}")
    if cfg.grad_reduce is not None and cfg.grad_reduce not in GRAD_REDUCE:
        raise UserError(f"--grad-reduce {cfg.grad_reduce!r} is not one of {', '.join(GRAD_REDUCE)}")
    if lay.pp_schedule not in SCHEDULES:
        raise UserError(f"--pp-schedule {lay.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.tp_comm_overlap and not (lay.tp > 1 and lay.sequence_parallel):
        raise UserError(
            "--tp-comm-overlap hides sequence parallelism's AllGathers and ReduceScatters under the GEMMs; give it "
            "with --tp 2 or more and --sequence-parallel"
        )
    if cfg.tp_comm_overlap and cfg.chip.kind != "gpu":
        raise UserError(
            f"--tp-comm-overlap is Transformer Engine's (GPUs); {cfg.chip.name} is a {cfg.chip.kind}: drop it"
        )
    named = remat_policy(cfg.remat)  # a classic or a named policy (lab.predict.training.remat), else the choices
    if named is not None and cfg.checkpoints_per_layer is not None:
        raise UserError(
            f"--checkpoints-per-layer {cfg.checkpoints_per_layer:g} with --remat {cfg.remat}: the named policy says "
            "which tensors a layer keeps, and the count would silently replace it; give one of them"
        )
    cf = cfg.capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, int | float) or not 0 < cf <= 64:
        raise UserError(f"--capacity-factor {cf!r} must be a number in (0, 64], e.g. 1.25")
    if cf != 1.0 and not cfg.model.is_moe:
        raise UserError(f"--capacity-factor {cf} applies to a mixture of experts; {cfg.model.name} is dense")
    if cfg.param_dtype not in PARAM_DTYPES:
        raise UserError(f"param dtype {cfg.param_dtype!r} is not one of {', '.join(PARAM_DTYPES)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {cfg.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    for name in ("seq_len", "global_batch", "microbatch"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    cfg.chip.flops(cfg.dtype)


def _check_fit(cfg: TrainConfig) -> None:
    """The degrees against the model's heads, layers and experts and the batch's sequences and microbatches."""
    m, lay = cfg.model, cfg.layout
    if m.heads % lay.tp:
        raise UserError(
            f"--tp {lay.tp} does not divide {m.heads} attention heads; try --tp {_nearest(lay.tp, _divisors(m.heads))}"
        )
    if m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        raise UserError(f"--tp {lay.tp} neither divides nor is a multiple of {m.kv_heads} KV heads")
    if lay.stage_split:
        _check_split(lay, m.layers)
    else:
        _check_even_split(lay, m.layers)
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
    if cfg.global_batch % replicas:
        lo = max(replicas, cfg.global_batch // replicas * replicas)
        raise UserError(
            f"global batch {cfg.global_batch} sequences does not divide over dp x fsdp = {replicas}; "
            f"try {lo} or {lo + replicas}"
        )
    per_replica = cfg.global_batch // replicas  # exact: a float would round batches above 2**53
    if cfg.microbatch > per_replica:
        raise UserError(
            f"--microbatch {cfg.microbatch} is larger than the {per_replica} sequences each "
            f"data-parallel replica gets; use at most {per_replica}"
        )
    if per_replica % cfg.microbatch:
        raise UserError(
            f"--microbatch {cfg.microbatch} does not divide the {per_replica} sequences per "
            f"replica; try {_nearest_divisor(per_replica, cfg.microbatch)}"
        )
    if lay.pp_schedule == "interleaved" and lay.pp > 1 and cfg.microbatches % lay.pp:
        raise UserError(
            f"the interleaved schedule needs the {cfg.microbatches} microbatches to be a multiple of "
            f"--pp {lay.pp} (Megatron's requirement)"
        )


def _check_split(lay: Layout, layers: int) -> None:
    """An explicit stage split: one positive layer count per stage, adding up to the model's layers."""
    split = lay.stage_split
    if len(split) != lay.pp:
        raise UserError(f"--pp-split has {len(split)} stages but --pp is {lay.pp}; give one layer count per stage")
    if any(not isinstance(n, int) or n < 1 for n in split):
        raise UserError(f"--pp-split {','.join(map(str, split))}: every stage needs at least one layer")
    if sum(split) != layers:
        even = [layers // lay.pp + (1 if i < layers % lay.pp else 0) for i in range(lay.pp)]
        raise UserError(
            f"--pp-split {','.join(map(str, split))} adds up to {sum(split)} layers but the model has {layers}; "
            f"e.g. --pp-split {','.join(map(str, even))}"
        )
    if lay.pp_schedule == "interleaved" or lay.pp_embedding_slots:
        raise UserError("--pp-split takes the gpipe or 1f1b schedule, without --pp-embedding-slots (the split says it)")


def _slots_make_whole(lay: Layout, layers: int) -> bool:
    """The embedding and the loss taking a layer's slot each make the chunks whole where the layers alone do not."""
    chunks = lay.pp * lay.v
    return bool(layers % chunks) and not (layers + 2) % chunks


def uneven_stages(lay: Layout, layers: int) -> Layout:
    """A pipeline whose stages the layers do not divide, as such runs are built (LLaMA 3 405B's 126 layers over 16
    stages, BLOOM's 70 over 12, DeepSeek-V3's 61 over 16): the command line's default, where a Plan and this
    module's API refuse it (:func:`check_config`). 1F1B or GPipe: stages of ceil and floor layers, the busiest
    pricing the pipeline, shown as the layout's split (``--pp-split`` gives another). Interleaved: the embedding and
    the loss take a layer's slot each where that makes the chunks whole (``--pp-embedding-slots``, shown as such);
    otherwise the check refuses it with the degrees that divide."""
    if lay.v > 1 and not lay.pp_embedding_slots and _slots_make_whole(lay, layers):
        return dataclasses.replace(lay, pp_embedding_slots=True)
    if (
        lay.pp <= 1
        or lay.stage_split
        or lay.pp_embedding_slots
        or lay.v > 1
        or not lay.pp < layers
        or not layers % lay.pp
    ):
        return lay
    split = tuple(layers // lay.pp + (1 if i < layers % lay.pp else 0) for i in range(lay.pp))
    return dataclasses.replace(lay, stage_split=split)


def _check_even_split(lay: Layout, m_layers: int) -> None:
    """Layers spread evenly: pp x interleave divides them (with the embedding and loss slots when asked)."""
    slots = m_layers + (2 if lay.pp_embedding_slots and lay.pp > 1 else 0)
    stages = f"--pp {lay.pp}" + (f" x --interleave {lay.v}" if lay.v > 1 else "")
    if lay.pp_embedding_slots and lay.pp > 1 and slots % (lay.pp * lay.v):
        raise UserError(
            f"{stages} does not divide {m_layers} layers plus the embedding and loss slots ({slots}); "
            + _pipeline_hint(lay, slots, "with the slots")
        )
    if not lay.pp_embedding_slots and m_layers % (lay.pp * lay.v):
        raise UserError(
            f"{stages} does not divide {m_layers} layers; {_pipeline_hint(lay, m_layers, '')}"
            + (
                ", or --pp-embedding-slots (the embedding and the loss take a slot each)"
                if _slots_make_whole(lay, m_layers)
                else ""
            )
        )


def _pipeline_hint(lay: Layout, units: int, why: str) -> str:
    """What does divide ``units`` layers (or slots) into ``pp x interleave`` chunks: the nearest pipeline degree
    (2 or more) at this interleave, else the nearest interleave at this degree, else no interleave."""
    pps = [d // lay.v for d in _divisors(units) if d % lay.v == 0 and d // lay.v >= 2]
    if pps:
        return f"try --pp {_nearest(lay.pp, pps)}" + (f" {why}" if why else "")
    if lay.v > 1 and units % lay.pp == 0:
        vs = [v for v in _divisors(units // lay.pp) if v >= 2]
        if vs:
            return f"try --interleave {_nearest(lay.v, vs)}" + (f" {why}" if why else "")
    return "try --pp-schedule 1f1b (stages of uneven layers)" if lay.v > 1 else "drop --pp-embedding-slots"
