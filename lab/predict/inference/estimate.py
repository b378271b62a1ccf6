"""Inference estimator: prefill and decode latency, KV cache, minimum topology, throughput.

Serving after the scaling book's inference chapters (inference.md, applied-inference.md):

* **Layout.** ``chips = dp x tp x ep``: ``dp`` independent replicas (the batch is split over them),
  each of ``tp x ep`` chips. Inside a replica attention and dense layers are Megatron tensor-parallel
  over ``tp`` (and data-parallel over ``ep``, which only MoE layers shard); experts are spread over
  ``ep`` and split by ``tp``. The KV cache is sharded by KV heads over ``tp`` (replicated when
  ``tp`` exceeds the KV heads) and by sequence over ``ep`` and ``dp``.
* **Decode step** (one new token for every sequence), per chip, the book's form:
  ``T = KV bytes / W_hbm + max(weight bytes / W_hbm, matmul FLOPs / C) + collectives``. Attention
  reads the whole cache and is always bandwidth-bound; the weights are read once per step and the
  matmuls become compute-bound past the critical batch. Each layer adds two tensor-parallel
  AllReduces of ``[batch, D]`` (attention output and MLP output), priced by the collective model
  with its latency floor: at small batch they are latency-bound, which is what makes TP=2 slower
  than bandwidth alone predicts. MoE layers add two AllToAlls over ``ep`` and read only the experts
  the batch routes to.
* **Quantisation** changes bytes, not FLOPs: int8/int4/fp8 weights or KV are read at their width
  and computed in bf16, unless ``compute`` is set to the narrow dtype (int8 or fp8 units).
* **Prefill** of ``P`` tokens per sequence: ``2 N_active P B`` matmul FLOPs plus causal attention;
  at ``--mfu`` when given, otherwise the roofline max of FLOPs and weight bytes plus the same
  AllReduces over ``[B P, D]``.
* **Ideal by default** (here; ``infer estimate`` prices achievable unless ``--ideal``). Like the book, the default
  prices peak FLOP/s and bandwidth; ``achievable=True`` applies the efficiency model of :mod:`lab.predict.efficiency`
  instead: the GEMM ceiling and, as the training estimator prices a matmul, the tile factor of every dimension: the
  pass's rows (a decode batch of 128 computes at half the ceiling) and each projection's K and N on one chip
  (rates.matmul_shape_factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.core.units import canonical_dtype, dtype_bytes, wire_bytes
from lab.predict import efficiency as eff
from lab.predict.inference.allreduce import check_tp_allreduce, comm_time, priced_allreduce
from lab.predict.inference.attention_kernels import decode_attention_flops, prefill_attention_flops
from lab.predict.inference.holdings import kv_bytes_per_sequence, kv_shards, weight_bytes_per_chip
from lab.predict.inference.rates import flop_time, matmul_shape_factor, mem_time

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4", "fp4", "fp32")  # storage: fp16 is bf16's width
MOE_WEIGHTS = ("all", "routed")
SAMPLE_BYTES = 8.0  # greedy sampling over vocab shards: each shard's best logit (fp32) and its index (int32)


@dataclass(frozen=True)
class InferConfig:
    """One serving configuration."""

    model: ModelConfig
    chip: Chip
    batch: int  # concurrent sequences, over all replicas
    context: int  # tokens in each sequence's KV cache
    tp: int = 1
    dp: int = 1
    ep: int = 1
    weights: str = "bf16"
    kv: str = "bf16"
    compute: str = "bf16"
    prefill_len: int | None = None
    generate: int | None = None
    mfu: float | None = None
    achievable: bool = False
    # How the serving program is written (defaults: the book's form). ``vocab_parallel``: the embedding table and
    # logits are split over tp, so each step adds an AllReduce after the lookup and an AllGather of every
    # shard's best token for greedy sampling; ``flash_attention``: prefill skips the masked half of the scores.
    vocab_parallel: bool = False
    flash_attention: bool = True
    # fp8 weights with fp8 compute (W8A8): ``dynamic`` activation scales computed as the step runs (vLLM, SGLang,
    # TorchAO), or ``static`` ones fused into the kernel before (efficiency.FP8_DECODE_TIME_VS_BF16; achievable only)
    fp8_scaling: str = "dynamic"
    # A mixture of experts' decode step streams ``all`` experts' weights (the dense einsum over experts that common
    # JAX implementations run at small batch) or only the ``routed`` ones some token of the step chose (vLLM's and
    # SGLang's fused MoE kernels, JAX's megablox gmm: microbenchmarks-added.md M1, M2).
    moe_weights: str = "all"
    # The serving stack's host work per decode step that the device does not overlap (scheduling, input preparation,
    # detokenising: microbenchmarks-added.md S1-S5), seconds; 0 prices the device alone.
    step_overhead_s: float = 0.0
    # The lab's Pallas kernels (attention = "pallas"): (block_q, block_k) of the prefill's flash kernel, block_k also
    # the decode kernel's page; their FLOPs as they compute them (lab.predict.inference.attention_kernels).
    pallas_blocks: tuple[int, int] | None = None
    # PyTorch eager generate (Hugging Face transformers without CUDA graphs or torch.compile) on one GPU: every step's
    # ops are issued from Python, and a step takes the longer of the host's time and the GPU's (efficiency
    # .eager_host_time; achievable only).
    eager: bool = False
    # The tensor-parallel all-reduces (achievable): ``custom``, the serving stack's own kernel inside a node, or
    # ``nccl``; None: what the stacks run on the chip (lab.predict.inference.allreduce).
    tp_allreduce: str | None = None
    # Attention data-parallel over the tp ranks (SGLang's --enable-dp-attention): each rank holds the whole attention
    # and its own requests' cache, the MLP or MoE stays tensor-parallel (lab.predict.inference.holdings).
    attention_dp: bool = False

    @property
    def chips(self) -> int:
        return self.dp * self.tp * self.ep

    @property
    def replica_batch(self) -> float:
        return self.batch / self.dp


def check_infer(cfg: InferConfig) -> None:
    m = cfg.model
    for name in ("batch", "context", "tp", "dp", "ep"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(f"--{name} must be a positive integer, got {v!r}")
    for name in ("prefill_len", "generate"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    for name in ("weights", "kv"):
        dt = canonical_dtype(getattr(cfg, name))
        if dt not in WEIGHT_DTYPES:
            raise UserError(f"--{name} {dt} is not one of {', '.join(WEIGHT_DTYPES)}")
    cfg.chip.flops(cfg.compute)
    if cfg.moe_weights not in MOE_WEIGHTS:
        raise UserError(f"--moe-weights {cfg.moe_weights!r} is not one of {', '.join(MOE_WEIGHTS)}")
    overhead = cfg.step_overhead_s
    if isinstance(overhead, bool) or not isinstance(overhead, int | float) or not 0 <= overhead < 10:
        raise UserError(f"--step-overhead must be seconds in [0, 10), e.g. 0.002, got {overhead!r}")
    if cfg.fp8_scaling not in eff.FP8_SCALINGS:
        raise UserError(f"--fp8-scaling {cfg.fp8_scaling!r} is not one of {', '.join(eff.FP8_SCALINGS)}")
    check_tp_allreduce(cfg)
    if cfg.attention_dp and cfg.tp < 2:
        raise UserError("--attention-dp splits the requests' attention over the --tp group; give --tp 2 or more")
    if cfg.eager:
        _check_eager(cfg)
    if cfg.mfu is not None and not 0 < cfg.mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], got {cfg.mfu}")
    if m.heads % cfg.tp:
        small = [d for d in range(1, math.isqrt(m.heads) + 1) if m.heads % d == 0]  # O(sqrt) divisors
        opts = small + [m.heads // d for d in small]
        raise UserError(
            f"--tp {cfg.tp} does not divide {m.heads} attention heads; try --tp "
            f"{min(opts, key=lambda d: (abs(d - cfg.tp), d))}"
        )
    if cfg.ep > 1 and (not m.is_moe or m.experts % cfg.ep):
        raise UserError(
            f"--ep {cfg.ep} needs a mixture-of-experts model whose experts it divides ({m.name} has {m.experts})"
        )
    if cfg.batch % cfg.dp:
        raise UserError(
            f"--batch {cfg.batch} does not divide over --dp {cfg.dp}; try {max(cfg.dp, cfg.batch // cfg.dp * cfg.dp)}"
        )


def _check_eager(cfg: InferConfig) -> None:
    """PyTorch eager generate is priced on GPUs, one model copy per GPU, under the efficiency model."""
    if cfg.chip.kind != "gpu":
        raise UserError(
            f"--eager prices PyTorch eager generate on a GPU; {cfg.chip.name} is a {cfg.chip.kind}: drop --eager"
        )
    if cfg.tp * cfg.ep > 1:
        raise UserError(
            f"--eager prices a model on one GPU (Hugging Face generate); got tp={cfg.tp}, ep={cfg.ep}: give --tp 1 "
            "(replicas with --dp), or drop --eager"
        )
    if not cfg.achievable:
        raise UserError("--eager prices the host's work under the efficiency model; drop --ideal")


@dataclass(frozen=True)
class InferEstimate:
    """Result of :func:`estimate_inference`; bytes per chip unless named otherwise."""

    config: InferConfig
    param_bytes: float  # the whole model at the weight dtype
    kv_bytes: float  # the whole batch at --context
    param_bytes_per_chip: float
    kv_bytes_per_chip: float
    decode_step_s: float
    compute_s: float
    memory_s: float
    kv_s: float
    weights_s: float
    comm_s: float
    latency_bound_collectives: bool
    prefill_s: float | None
    generate_s: float | None
    max_batch: int
    min_chips: int
    tp_max_degree: float | None
    host_s: float = 0.0  # PyTorch eager: the host's seconds a decode step (InferConfig.eager)

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.kv_bytes

    @property
    def total_bytes_per_chip(self) -> float:
        return self.param_bytes_per_chip + self.kv_bytes_per_chip

    @property
    def fits(self) -> bool:
        return self.total_bytes_per_chip <= self.config.chip.hbm_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.config.batch / self.decode_step_s

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens_per_s / self.config.chips

    @property
    def bound(self) -> str:
        terms = {
            "KV reads": self.kv_s,
            "weight reads": self.weights_s,
            "compute": self.compute_s,
            "collectives": self.comm_s,
        }
        if self.host_s >= self.decode_step_s:  # PyTorch eager: the GPU waits for the host
            return "host (eager)"
        if self.weights_s >= self.compute_s:
            terms.pop("compute")
        else:
            terms.pop("weight reads")
        return max(terms, key=terms.get)

    @property
    def cost_per_million_tokens_usd(self) -> float | None:
        price = self.config.chip.price_per_hour
        if not price:
            return None
        return self.config.chips * price / 3600 / self.tokens_per_s * 1e6

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "model": c.model.name,
            "hardware": c.chip.name,
            "chips": c.chips,
            "tp": c.tp,
            "dp": c.dp,
            "ep": c.ep,
            "batch": c.batch,
            "context": c.context,
            "weights": c.weights,
            "kv": c.kv,
            "compute": c.compute,
            "ideal": not c.achievable,
            "fp8_scaling": c.fp8_scaling,
            "param_bytes": self.param_bytes,
            "kv_bytes": self.kv_bytes,
            "total_bytes": self.total_bytes,
            "param_bytes_per_chip": self.param_bytes_per_chip,
            "kv_bytes_per_chip": self.kv_bytes_per_chip,
            "total_bytes_per_chip": self.total_bytes_per_chip,
            "hbm_bytes": c.chip.hbm_bytes,
            "fits": self.fits,
            "min_chips": self.min_chips,
            "max_batch": self.max_batch,
            "decode_step_s": self.decode_step_s,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "kv_s": self.kv_s,
            "weights_s": self.weights_s,
            "comm_s": self.comm_s,
            "bound": self.bound,
            "latency_bound_collectives": self.latency_bound_collectives,
            "tp_allreduce": priced_allreduce(c) if c.achievable and c.tp > 1 else None,
            "attention_dp": c.attention_dp,
            "tp_max_degree": self.tp_max_degree,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
            "prefill_len": c.prefill_len,
            "prefill_s": self.prefill_s,
            "moe_weights": c.moe_weights if c.model.is_moe else None,
            "step_overhead_s": c.step_overhead_s,
            "eager": c.eager,
            "host_s": self.host_s,
            "time_to_first_token_s": self.prefill_s,
            "generate": c.generate,
            "generate_s": self.generate_s,
            "cost_per_million_tokens_usd": self.cost_per_million_tokens_usd,
        }


def fused_moe_layers(cfg: InferConfig) -> int:
    """MoE layers a routed-expert kernel runs (``moe_weights = routed``: vLLM's and SGLang's fused MoE), whose own
    fixed cost a decode step pays (efficiency.FUSED_MOE_FIXED_S); none for the dense einsum over every expert."""
    return cfg.model.moe_layers if cfg.model.is_moe and cfg.moe_weights == "routed" else 0


def step_weight_bytes(cfg: InferConfig, tokens: float) -> float:
    """One chip's weight bytes a step over ``tokens`` tokens of a replica reads: with a mixture of experts every
    local expert's (``moe_weights`` all) or each some token routes to (routed)."""
    return weight_bytes_per_chip(cfg.model, cfg.tp, cfg.ep, cfg.weights, cfg.attention_dp, experts_read(cfg, tokens))


def experts_read(cfg: InferConfig, tokens: float) -> float:
    """The share of a MoE layer's experts a step over ``tokens`` tokens reads: all of them (``moe_weights`` all), or
    the expected share some token routes to, each choosing ``experts_per_token`` of ``experts`` (routed); 1.0 for a
    dense model."""
    m = cfg.model
    if m.is_moe and cfg.moe_weights == "routed":
        return 1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens
    return 1.0


def _kv_shards(cfg: InferConfig, seqs: float | None = None) -> float:
    """:func:`holdings.kv_shards` of the config's replica (``seqs`` a rank group's sequences, default its share)."""
    return kv_shards(cfg.model, cfg.tp, cfg.replica_batch / cfg.ep if seqs is None else seqs, cfg.attention_dp)


def _act_bytes(cfg: InferConfig) -> float:
    """Bytes per activation on the wire: the compute dtype's (16-bit for int8/fp8 compute)."""
    return wire_bytes(cfg.compute)


def comms(cfg: InferConfig, tokens: float) -> list[tuple[str, float, float, int, str]]:
    """The collectives of one forward pass over ``tokens`` tokens per replica (one decode step: its batch;
    prefill: batch x prompt): ``(kind, bytes of one call, calls, group, what)``."""
    m = cfg.model
    act = tokens * m.d_model * _act_bytes(cfg)
    syncs = m.tp_reductions_per_layer * m.layers
    out = [("all-reduce", act / cfg.ep, syncs, cfg.tp, "TP AllReduces: attention out, MLP down (or their sum)")]
    if cfg.ep > 1:
        out.append(("all-to-all", act * m.experts_per_token, 2 * m.layers, cfg.ep, "EP dispatch and combine"))
    if cfg.tp > m.kv_heads and not (m.is_mla or cfg.attention_dp):  # batch-sharded attention: queries to the cache
        out.append(("all-to-all", act / cfg.ep, 2 * m.layers, cfg.tp, "batch-sharded attention"))
    if cfg.vocab_parallel:
        out.append(("all-reduce", act / cfg.ep, 1, cfg.tp, "vocab-parallel embedding lookup"))
        seqs = cfg.replica_batch
        out.append(("all-gather", SAMPLE_BYTES * seqs * cfg.tp, 1, cfg.tp, "greedy sampling over the vocab shards"))
    return [c for c in out if c[3] > 1]


def decode_step(cfg: InferConfig, context: int | None = None) -> dict[str, float | bool]:
    """Terms of one decode step per chip at ``context`` tokens of cache (default: the config's)."""
    m, chip = cfg.model, cfg.chip
    ctx = cfg.context if context is None else context
    b = cfg.replica_batch  # sequences per replica, one new token each
    weight_bytes = step_weight_bytes(cfg, b)
    kv_bytes = kv_bytes_per_sequence(m, ctx, cfg.kv) * b / (_kv_shards(cfg, b / cfg.ep) * cfg.ep)
    # Matmul FLOPs per chip: 2 x active weights x tokens, attention scores 4 S N H per layer per token.
    mm = m.matmul_flops_per_token() * b / (cfg.tp * cfg.ep)
    att = m.attention_flops_per_token(ctx, causal=False) * b / (cfg.tp * cfg.ep)
    if cfg.pallas_blocks is not None:
        att = decode_attention_flops(cfg, ctx)
    tile = eff.decode_row_tile(chip, cfg)
    compute_s = flop_time(
        chip, mm + att, cfg.compute, cfg.achievable, b, tile, matmul_shape_factor(cfg.model, cfg.chip, cfg.tp)
    )
    # the weights stream through skinny GEMMs, which reach less of HBM than a copy (achievable)
    weights_s = (
        eff.decode_weights_time(chip, weight_bytes, cfg.weights, cfg.compute, cfg.fp8_scaling)
        if cfg.achievable
        else weight_bytes / chip.hbm_bandwidth
    )
    kv_s = mem_time(chip, kv_bytes, cfg.achievable) * (eff.EAGER_KV_PASSES if cfg.eager else 1.0)
    comm, lat = 0.0, False
    for kind, nbytes, calls, group, _ in comms(cfg, b):
        t, bound = comm_time(cfg, kind, nbytes, group, cfg.achievable)
        comm += calls * t
        lat = lat or (bound and kind != "all-gather")  # the sampling gather is tiny, not a TP verdict
    fixed = eff.decode_kernel_overhead(chip, m.layers, fused_moe_layers(cfg)) if cfg.achievable else 0.0
    fixed += cfg.step_overhead_s
    device = kv_s + max(weights_s, compute_s) + comm + fixed
    host = eff.eager_host_time(m.layers) if cfg.eager else 0.0
    return {
        "kv_s": kv_s,
        "weights_s": weights_s,
        "compute_s": compute_s,
        "comm_s": comm,
        "overhead_s": fixed,
        "host_s": host,
        "step_s": max(device, host),
        "latency_bound": lat,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "matmul_flops": mm,
        "attention_flops": att,
    }


def prefill_terms(cfg: InferConfig) -> dict[str, float]:
    """Prefill of ``prefill_len`` tokens for every sequence, per chip: FLOPs, bytes and the roofline core."""
    m, chip, p = cfg.model, cfg.chip, cfg.prefill_len or 0
    tokens = cfg.batch * p
    # the logits of each prompt's last position only: sampling reads nothing else, and engines make nothing else
    logits = 2.0 * m.d_model * m.vocab * cfg.batch / cfg.chips if p else 0.0
    mm = m.matmul_flops_per_token(include_logits=False) * tokens / cfg.chips + logits
    att = m.attention_flops_per_token(p, causal=cfg.flash_attention, windowed=cfg.flash_attention) * tokens / cfg.chips
    if cfg.pallas_blocks is not None:
        att = prefill_attention_flops(cfg)
    wbytes = weight_bytes_per_chip(m, cfg.tp, cfg.ep, cfg.weights, cfg.attention_dp)
    kv_write = kv_bytes_per_sequence(m, p, cfg.kv) * cfg.replica_batch / (_kv_shards(cfg) * cfg.ep)
    compute_s = flop_time(
        chip,
        mm + att,
        cfg.compute,
        cfg.achievable,
        tokens / cfg.dp,
        shape=matmul_shape_factor(cfg.model, cfg.chip, cfg.tp),
    )
    memory_s = mem_time(chip, wbytes + kv_write, cfg.achievable)
    comm = sum(
        calls * comm_time(cfg, k, b, g, cfg.achievable)[0] for k, b, calls, g, _ in comms(cfg, cfg.replica_batch * p)
    )
    return {
        "matmul_flops": mm,
        "logits_flops": logits,
        "attention_flops": att,
        "weight_bytes": wbytes,
        "kv_bytes": kv_write,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "comm_s": comm,
        "step_s": max(max(compute_s, memory_s) + comm, eff.eager_host_time(m.layers) if cfg.eager else 0.0),
    }


def prefill_time(cfg: InferConfig) -> float | None:
    """Time to prefill ``prefill_len`` tokens for every sequence of the batch."""
    if cfg.prefill_len is None:
        return None
    if cfg.mfu is not None:  # applied-inference.md: 2 x params x tokens / (N C MFU)
        tokens = cfg.batch * cfg.prefill_len
        return 2.0 * cfg.model.active_params * tokens / (cfg.chips * cfg.chip.flops(cfg.compute) * cfg.mfu)
    return prefill_terms(cfg)["step_s"]


def estimate_inference(cfg: InferConfig) -> InferEstimate:
    """Predict memory, decode step, prefill and generation for one serving configuration."""
    check_infer(cfg)
    m, chip = cfg.model, cfg.chip
    d = decode_step(cfg)
    gen = None
    if cfg.generate is not None:  # the cache grows by one token a step: price the mean context
        gen = cfg.generate * float(decode_step(cfg, cfg.context + cfg.generate // 2)["step_s"])
    p_chip = weight_bytes_per_chip(m, cfg.tp, cfg.ep, cfg.weights, cfg.attention_dp)
    kv_seq = kv_bytes_per_sequence(m, cfg.context, cfg.kv)
    kv_chip = kv_seq * cfg.replica_batch / (_kv_shards(cfg) * cfg.ep)
    per_replica = max_replica_batch(m, chip, cfg.tp, cfg.ep, cfg.context, cfg.weights, cfg.kv, cfg.attention_dp)
    total_params = m.params * dtype_bytes(cfg.weights)
    total_kv = kv_seq * cfg.batch
    min_chips = max(1, math.ceil((total_params + total_kv) / chip.hbm_bytes))
    w_ici = chip.ici_bidirectional if chip.topology == "torus" else chip.link_bandwidth
    # inference.md: TP stays memory-bound-friendly while Y < F / (B beta), beta = W_hbm / W_ici.
    tp_max = m.d_ff / (cfg.replica_batch * chip.hbm_bandwidth / w_ici)
    return InferEstimate(
        config=cfg,
        param_bytes=total_params,
        kv_bytes=total_kv,
        param_bytes_per_chip=p_chip,
        kv_bytes_per_chip=kv_chip,
        decode_step_s=float(d["step_s"]),
        compute_s=float(d["compute_s"]),
        memory_s=float(d["kv_s"]) + float(d["weights_s"]),
        kv_s=float(d["kv_s"]),
        weights_s=float(d["weights_s"]),
        comm_s=float(d["comm_s"]),
        latency_bound_collectives=bool(d["latency_bound"]),
        prefill_s=prefill_time(cfg),
        generate_s=gen,
        max_batch=int(per_replica * cfg.dp),
        min_chips=min_chips,
        tp_max_degree=tp_max,
        host_s=float(d["host_s"]),
    )


def max_replica_batch(
    m: ModelConfig, chip: Chip, tp: int, ep: int, context: int, weights: str, kv: str, attention_dp: bool = False
) -> int:
    """Largest batch one replica of tp x ep chips holds at ``context``: weights plus KV within HBM."""
    free = chip.hbm_bytes * tp * ep - weight_bytes_per_chip(m, tp, ep, weights, attention_dp) * tp * ep
    if free <= 0:
        return 0
    seq = kv_bytes_per_sequence(m, context, kv)
    # Fully sharded once the batch reaches tp / K sequences; below that, partly replicated.
    best = math.floor(free / seq)
    while best > 0 and seq * best / (kv_shards(m, tp, best / ep, attention_dp) * ep) > free / (tp * ep):
        best -= 1
    return best
