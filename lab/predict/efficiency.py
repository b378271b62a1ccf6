"""Achievable efficiency: what fraction of the roofline real kernels reach, from measurements of the pieces.

One documented model, the same for every estimate (no per-run constants). Each number below is a published
measurement of one kernel or collective (``shared/reference/microbenchmarks.md``; the ids in the comments are
its rows), per chip family where one was measured; a calibrated chip (``shardlab calibrate``) replaces them.

* **Matmuls.** ``t = max(2 m k n / (eta * peak), bytes / (hbm_fraction * W_hbm))`` with
  ``eta = ceiling(chip, dtype) * prod_{x in m, k, n} x / (x + tile)``. The ceiling is the best a large GEMM
  reaches sustained, as a training step runs at its power limit: in a size sweep after 10,000 warm-up iterations
  (A100 bf16 82%, G9, below a short best-shape burst's 87%; Hopper fp8 69-70%) or as the maximum sustainable matmul
  FLOPS (H100/H200 bf16 76%, B200 bf16 64% and fp8 62%: Blackwell throttles to ~0.72 of its boost clock at 1000 W),
  so fp8 is 1.8x bf16 on Hopper and not 2x; TPU v5e's XLA matmul at 8192^3 reaches 92%, and no figure is
  published for the other TPUs, which take it. The product is a smooth stand-in for tile quantisation (the
  MXU is 128 wide, 256 on v6e; GPU tensor-core tiles are of the same order): a dimension much larger than the
  tile costs nothing, one the size of a tile halves the rate.
* **Attention** (fused, flash-style): FLOPs over a measured kernel rate inside a training step, by kernel:
  ``fa2`` (FlashAttention-2, what PyTorch SDPA runs: 58% of peak on A100, 33% on Hopper) or ``fa3``
  (FlashAttention-3 / cuDNN, what Megatron/NeMo's Transformer Engine runs: 45% on H100/H200, FA4 37% on
  B200, measured in an 8k-token step). TPUs (splash attention: nothing published) keep the matmul model.
* **Memory-bound ops** (norms, activations, softmax, optimizer): ``bytes / (hbm_fraction * W_hbm)``, the
  STREAM copy rate (A100 79%, H100 87%, H200 84%, GB200 92%); TPUs 87% (TPU7x's copy, T3). Streaming
  weights through skinny decode GEMMs reaches less on GPUs: 68% of HBM on Hopper (mean of the DeepGEMM M=64 rows);
  weight-only int8/int4 kernels less again (Q6); TPUs stream them at their copy rate.
* **Collectives**: the collective model's time over the fraction of the link a ring reaches: NVLink 78%
  (A100), 81% (H100/H200), 75% (B200); NVLS all-reduce on 6 or more Hopper/Blackwell GPUs 107% (busbw);
  across nodes 72% of the NIC rate (4-node H100 and B200 sweeps); TPU ICI 95%. Inside a GPU node a collective
  reaches that rate only for large messages: its bandwidth term takes the share of the plateau the nccl-tests
  size sweeps measured at its size (A100, H100, H200: 47-50% at 16 MiB, 9-16% at 1 MiB; NVLINK_SWEEP).
* **Fixed per-kernel costs of a decode step** (GPUs): each of a layer's ~14 kernels adds a CUDA-graph gap of
  0.9 us and each of its ~8 small ones takes at least 1.5 us, about 25 us a layer, 2 ms for an 80-layer model.
  TPUs: the step's dispatch and sync, ~100 us (O4). Weights stream through a decode step's skinny GEMMs at 68%
  of HBM on H100 (G16), i.e. 0.78 of its copy rate (H2); other GPU families take 0.78 of their own measured copy
  rate (A100 62%, H200 66%, B200 72%); TPUs their copy rate, 87% (T3). fp8 weights multiplying fp8
  activations quantised as the step runs take 0.62 of bf16's GEMM time, not half (FP8_DECODE_TIME_VS_BF16).
* **PyTorch eager generate** (Hugging Face transformers, no CUDA graphs): the host issues each op from Python,
  0.61 ms a layer and 1.26 ms a step on a GPU (E1, E2 measured by this project; O1's launch), and a step takes the
  longer of the host's and the GPU's time.
* **Across nodes** a collective reaches 12.5% of the NIC rate at 16 MiB, 44% at 256 MiB, 70% at 1 GiB (C14);
  and on GPUs, computation overlapped with a collective runs 18.9% slower (arXiv:2507.03114), so a hidden
  collective is not free.
"""
# Over 500 lines on purpose: one documented model of achievable efficiency; each function is a cited piece of it and the
# module docstring describes the whole, which a split would put in two places.

from __future__ import annotations

import itertools
import math

from lab.core.hardware import COLLECTIVE_KINDS, COLLECTIVE_SCOPES, Chip
from lab.core.units import canonical_dtype, dtype_bytes
from lab.predict.collectives import collective_time, price_fields

# Fixed costs of a decode step's kernels on a GPU, where a layer's kernels take microseconds (microbenchmarks.md
# §5): every kernel of a CUDA graph adds ~0.9 us between nodes (O2: 3.3 -> 0.9 us per kernel with graphs), and
# an elementwise kernel takes ~1.5 us however few bytes it moves (O3: a 65,536-element add on H100, against
# 0.23 us of bandwidth). TPUs: no per-op figure is published (O4 is a whole call's dispatch), so none is added.
GRAPH_NODE_S = 0.9e-6  # O2
SMALL_KERNEL_S = 1.5e-6  # O3
# A LLaMA-style decoder layer's kernels in one decode step: the projections (QKV, out, gate/up, down: 4), two
# collectives under TP, and eight small ones (two norms, rotary embedding, the KV-cache write, attention over
# the cache at one query, the activation, two residual adds), counted as compiled decode stacks launch them.
DECODE_KERNELS_PER_LAYER = 14
DECODE_SMALL_KERNELS_PER_LAYER = 8


# A TPU decode step run as one compiled call per token pays the call's host dispatch and sync: O4, about 100 us
# of a timed jitted call on v5e that is not MXU time. No per-op figure is published, so this is the whole fixed
# cost of a TPU step.
TPU_STEP_DISPATCH_S = 100e-6  # O4


# PyTorch eager generate (Hugging Face transformers without CUDA graphs or torch.compile): the host dispatches every op
# of every layer from Python, and the GPU waits when its kernels are shorter (microbenchmarks-added.md §3b): E1, the
# host's seconds of an eager decode step measured without a GPU (a layer, and the step's own work outside the layers:
# embedding, final norm, logits, sampling, stopping criteria); E2, the kernels a step's ops launch on a GPU, each
# adding O1's asynchronous enqueue (2.65 us) beyond the CPU kernel E1 ran in its place.
EAGER_HOST_S_PER_LAYER = 0.507e-3  # E1
EAGER_HOST_S_PER_STEP = 1.09e-3  # E1
EAGER_KERNELS_PER_LAYER = 40  # E2
EAGER_KERNELS_PER_STEP = 63  # E2
CUDA_LAUNCH_S = 2.65e-6  # O1: asynchronous enqueue of one kernel
# Its KV cache grows by concatenation: transformers' DynamicCache.update (cache_utils.py, 4.46.3) runs torch.cat of each
# layer's whole cache with the new token's keys and values every step (E2's four cats a layer: two here, two in the
# rotary embedding), so the cache is read and written once more besides attention's read of it.
EAGER_KV_PASSES = 3.0


def eager_host_time(layers: int) -> float:
    """Seconds the host spends issuing one forward pass of ``layers`` layers in PyTorch eager on a GPU (E1, E2, O1):
    what a step costs when its kernels are shorter."""
    per_layer = EAGER_HOST_S_PER_LAYER + EAGER_KERNELS_PER_LAYER * CUDA_LAUNCH_S
    return layers * per_layer + EAGER_HOST_S_PER_STEP + EAGER_KERNELS_PER_STEP * CUDA_LAUNCH_S


# A fused MoE kernel's own fixed cost in a decode step (the routing sort, two grouped GEMMs over a few thin experts),
# beyond the routed experts' bytes: microbenchmarks-added.md M3-M5, each a time over touched-expert bytes at small
# batch, fitted as t0 + bytes / rate: A100 (M3, vLLM Triton fused_moe, B = 1-64) ~50 us, H200 (M5, SGLang, fp8 TP8)
# ~27 us, B200 (M4, B = 1-4) ~28 us a layer. Grade C (benchmark scripts in pull requests), GPUs only.
FUSED_MOE_FIXED_S = {"a100": 50e-6, "gpu": 28e-6}


def decode_kernel_overhead(chip: Chip, layers: int, moe_layers: int = 0) -> float:
    """Seconds of fixed cost in one decode step: on GPUs graph gaps and small kernels per layer, and a fused MoE
    kernel's own per MoE layer (``moe_layers``: those a routed-expert kernel runs); on TPUs the step's dispatch
    (O4); none on the host CPU."""
    if chip.kind == "tpu":
        return TPU_STEP_DISPATCH_S
    if chip.kind != "gpu":
        return 0.0
    moe = moe_layers * FUSED_MOE_FIXED_S.get(family(chip), FUSED_MOE_FIXED_S["gpu"])
    return moe + layers * (DECODE_KERNELS_PER_LAYER * GRAPH_NODE_S + DECODE_SMALL_KERNELS_PER_LAYER * SMALL_KERNEL_S)


# Best large-GEMM fraction of the dense peak, by chip family and dtype (microbenchmarks.md §1a, §1e).
# What a GEMM sustains once the chip runs at its power limit, as a training step does, where it is published: a size
# sweep after 10k warm-up iterations (G9, G11, G13) or the maximum sustainable matmul FLOPS (MSMF: the best shape held
# steady for seconds at full power with the node's other GPUs busy; stas00/ml-engineering compute/accelerator/
# README.md at 0359db8, 'Maximum Achievable and Sustainable Matmul FLOPS comparison table', torch 2.14+cu130). A
# short best-shape burst (G1-G7, MAMF) runs at the boost clock and low power, 5-23% above these.
GEMM_CEILING: dict[tuple[str, str], float] = {
    ("a100", "bf16"): 0.822,  # G9: 256.5 of 312 (fp16 16384^3, the same tensor-core peak); G1 best shape 0.869
    ("a100", "int8"): 0.822,  # no fp8 on A100; int8 assumed as bf16 (G25 measured it no faster)
    # MSMF of H200, the H100's GH100 die at the same 700 W: 755 of 989 (the burst, G2: 794.5); Hugging Face
    # gpu-fryer's 60 s bf16 burn of 8192^3 on all 8 GPUs of an H100 node reads ~730 (README), 3% below at one shape
    ("h100", "bf16"): 0.763,
    ("h100", "fp8"): 0.696,  # G11: 1377.3 of 1979 at 16384^3; G3 best shape 0.709
    ("h200", "bf16"): 0.763,  # MSMF: 755 of 989 at 1536x2816x6144, ~686 W, 1860-1918 MHz (burst 850)
    ("h200", "fp8"): 0.690,  # G13: 1366.3 of 1979 at 16384^3 (MSMF 1354: the same); G4 best shape 0.734
    ("b200", "bf16"): 0.640,  # MSMF: 1439 of 2250, ~980 W, 1399-1443 MHz (burst G6: 1745)
    ("b200", "fp8"): 0.620,  # MSMF: 2788 of 4500 (burst G7: 3432.5)
    # Inference cards (docs/reference/microbenchmarks-added.md §1b: torch.mm size sweeps, best size; grade C):
    ("a10g", "bf16"): 0.556,  # D8: 69.5 of the A10's 125 (AWS publishes no A10G peak)
    ("a10", "bf16"): 0.556,  # D8 (A10G, the same GA102 die); D10's host-timed 56 TF reads lower
    ("l4", "bf16"): 0.586,  # D7: 70.9 of 121
    ("l4", "fp8"): 0.586,  # no fp8 sweep: bf16's share (C)
    ("l40s", "bf16"): 0.743,  # D6: 269.2 of 362
    ("l40s", "fp8"): 0.743,  # no fp8 sweep: bf16's share (C)
    ("v100", "bf16"): 0.759,  # D9: fp16 94.8 of 125 (the rate a 16-bit job runs at on Volta)
    # AMD Instinct (microbenchmarks-added.md X1: best-shape bf16 matmul, torch with TunableOp; no sustained figure is
    # published, so these are bursts): MI300X 668.4 of 1307.4, MI325X 784.9 of 1307.4, MI355X 1565 of 2500. No fp8
    # matmul is measured on any of them: bf16's share (C).
    ("mi300x", "bf16"): 0.511,
    ("mi300x", "fp8"): 0.511,
    ("mi325x", "bf16"): 0.600,
    ("mi325x", "fp8"): 0.600,
    ("mi355x", "bf16"): 0.626,
    ("mi355x", "fp8"): 0.626,
}
GEMM_CEILING_TPU = 0.923  # G26: v5e jnp.matmul bf16 8192^3
GEMM_CEILING_TPU6E = 0.793  # T8: v6e jit bf16 8192^3, profiler device time, 727.7 of 918 TF/s
GEMM_CEILING_TPU_OTHER = 0.923  # no v2-v4/v5p figure is published: v5e's carried over (grade B)
GEMM_CEILING_TPU7X = 0.829  # T4: TPU7x bf16 32768^3 at 956.4 TF per JAX device, one TensorCore's half of 2307
# a chip family with no measurement: a GPU takes Hopper's sustained bf16 rate (MSMF), not a burst's
GEMM_CEILING_OTHER = {"gpu": 0.76, "cpu": 1.0}
TILE = {"gpu": 128.0, "tpu": 128.0, "cpu": 1.0}

# Fused attention, forward and backward together, as a fraction of the bf16 peak (microbenchmarks.md §2).
ATTENTION: dict[tuple[str, str], float] = {
    ("a100", "fa2"): 0.58,  # A13: FA2 at seq 8192, 179.5 of 312 (FA3 does not run on A100)
    ("a100", "fa3"): 0.58,
    ("h100", "fa2"): 0.33,  # A2, A13: FA2 on Hopper, 328-335 of 989
    ("h100", "fa3"): 0.45,  # A16: FA3 inside an 8k-token training step on H200 (model-FLOP accounting)
    ("h200", "fa2"): 0.33,  # A13: 329.3 of 989
    ("h200", "fa3"): 0.45,  # A16
    ("b200", "fa2"): 0.37,  # A16: FA4 in the same step (no FA2 figure; B200 runs the newest kernel)
    ("b200", "fa3"): 0.37,
}

# STREAM copy rate as a fraction of HBM bandwidth (microbenchmarks.md §3).
HBM_FRACTION = {"a100": 0.79, "h100": 0.87, "h200": 0.84, "b200": 0.92}  # H1, H2, H3, H4 (GB200)
# inference cards' copies (D10: a.copy_(b), host-timed; grade C): A10 469 of 600 GB/s, V100 766 of 900
HBM_FRACTION |= {"a10": 0.78, "a10g": 0.78, "v100": 0.85}
# AMD Instinct: MI300X's HBM3 at 4.2 of 5.3 TB/s (X2, ROCm's roofline tool), carried to MI325X's and MI355X's HBM3e
HBM_FRACTION |= {"mi300x": 0.79, "mi325x": 0.79, "mi355x": 0.79}
# an unmeasured GPU (assumed); TPUs: TPU7x's copy at 87% of HBM (microbenchmarks-added.md T3), carried to v3-v6e
HBM_FRACTION_OTHER = {"gpu": 0.85, "tpu": 0.87, "cpu": 1.0}
DECODE_WEIGHT_FRACTION = 0.68  # G16: DeepGEMM M=64 rows on H800 reach 50/73/80% of HBM (mean); Hopper's HBM3
# A skinny decode GEMM streams its weights at a fixed share of what a STREAM copy reaches on the same memory: G16's
# 68% was measured on H800, whose HBM3 is the H100's (3.35 TB/s), where the copy reaches 87% (H2), so the skinny GEMM
# runs at 0.68 / 0.87 = 0.78 of the copy rate. A GPU family whose own copy rate is measured takes that share of it
# (A100: 0.78 x 79% (H1) = 62%; H200: 0.78 x 84% (H3) = 66%; B200: 0.78 x 92% (H4) = 72%; H100: 68%, G16 itself),
# rather than the Hopper HBM3 figure; a derived figure (grade B): no skinny-GEMM bandwidth is published for A100.
SKINNY_GEMM_VS_COPY = DECODE_WEIGHT_FRACTION / HBM_FRACTION["h100"]  # G16 / H2
# TPUs: XLA streams a skinny matmul's weights from HBM by DMA at the copy rate; the one measured TPU copy rate is
# TPU7x's 87% of HBM at 128 MiB and more (microbenchmarks-added.md T3), carried to v3-v6e (grade B). (It was G16's H800
# GEMM figure, 0.68, before: a Hopper kernel's share, not a TPU's.)
DECODE_WEIGHT_FRACTION_TPU = 0.87

# Fraction of the link a ring collective reaches (microbenchmarks.md §4).
NVLINK_RING = {"a100": 0.775, "h100": 0.81, "h200": 0.81, "b200": 0.75}  # C1/C2, C6, C6, C8
# AMD's Infinity Fabric mesh (the scale-up fabric's share, read by the same rule): MI300X's 8-GPU all-reduce at 312.9 of
# 7 x 64 GB/s (X3; 2 GPUs: 74.5% of one link), carried to MI325X (the same links) and MI355X (faster links)
NVLINK_RING |= {"mi300x": 0.70, "mi325x": 0.70, "mi355x": 0.70}
NVLS_ALL_REDUCE = {"h100": 1.07, "h200": 1.07, "b200": 0.93}  # C3/C5, C6, C8: busbw at 6-8 GPUs (NVLS)
NIC_FRACTION = 0.72  # C14 (74%), C17 (71%): per-GPU NIC rate of inter-node all-reduce at >= 1 GiB
ICI_FRACTION = 0.95  # C20: v5e AllGather at 95% of the link rate
ICI_FRACTION_OTHER = 0.95  # v5e's; v5p and v6e ppermute at 96% of a link (T1-T2), v3/v4 unmeasured (grade B)
COLLECTIVE_FRACTION = {"gpu": 0.8, "cpu": 1.0}  # a GPU family with no measurement; the host (calibrated)


# Host <-> device bandwidth per chip, one direction, for activations offloaded to host memory. GPUs: H8, nvbandwidth
# copy-engine H2D / D2H (H200 55.4 / 55.1 GB/s, H100 51 / 52 GB/s, A100 26.3 GB/s H2D; its 6.3 GB/s D2H is the
# source's anomaly, so the H2D figure is taken both ways). TPUs: the scaling book's PCIe per chip (tpus.md: about
# 1.6e10 B/s, 3.2e10 on v6e). B200: the PCIe Gen5 x16 spec at H200's measured 88%.
HOST_LINK = {"a100": 26.3e9, "h100": 51e9, "h200": 55e9, "b200": 55e9, "tpu-v6e": 3.2e10}
HOST_LINK_OTHER = {"gpu": 26.3e9, "tpu": 1.6e10, "cpu": 1e10}


def host_link_bandwidth(chip: Chip) -> float:
    """Bytes/s one chip moves to or from host memory, one direction (activation offload)."""
    if chip.name in HOST_LINK:
        return HOST_LINK[chip.name]
    return HOST_LINK.get(family(chip), HOST_LINK_OTHER.get(chip.kind, 1e10))


# The measured families, by the start of a catalog name (a100 before a10: "a100-80gb" is an A100)
FAMILIES = ("a100", "a10g", "a10", "h100", "h200", "b200", "l40s", "l4", "v100", "mi300x", "mi325x", "mi355x")
# Parts built on a measured family's die and memory under another name: H800 and A800 are the H100 and A100 with their
# NVLink cut (microbenchmarks.md §1: "H800 SXM5 has the H100 SXM tensor-core and HBM specs"; the A800 likewise), and
# GB200's GPU is B200's Blackwell die on HBM3e at a higher power limit. Their links are the catalog's own; every
# figure measured on the die (GEMM, attention, HBM, NVLink ring share) is the family's.
SAME_DIE = {"h800": "h100", "a800": "a100", "gb200": "b200"}
# Blackwell Ultra (B300, GB300): no sustained figure is published; its best-shape bf16 matmul keeps 78.6% of the peak
# (X4), B200's 77.6% (G6), so B200's figures are carried (grade B, as for any part of another die).
SAME_DIE |= {"b300": "b200", "gb300": "b200"}
_FAMILIES: dict[tuple[str, str], str] = {}  # (name, kind) -> family: every priced op and collective asks


def family(chip: Chip) -> str:
    """The measured family a catalog chip belongs to (``a100-80gb`` -> ``a100``); its kind otherwise. The figures
    were measured on SXM parts (their power, HBM and NVSwitch): a PCIe card (``h100-pcie``) is not of the family."""
    key = (chip.name, chip.kind)
    fam = _FAMILIES.get(key)
    if fam is None:
        fam = chip.kind
        if "pcie" not in chip.name:
            fam = next((n for n in FAMILIES if chip.name.startswith(n)), chip.kind)
            fam = next((f for n, f in SAME_DIE.items() if chip.name.startswith(n)), fam)
        if len(_FAMILIES) > 256:
            _FAMILIES.clear()
        _FAMILIES[key] = fam
    return fam


# A calibrated host's factors per kind of op (matmul, attention, elementwise, collective): what the lab's own
# Transformer step took on this host's emulated devices over what the estimator priced its ops at, measured by
# `shardlab calibrate` on a reference program (lab/run/calibrate_step.py). Emulated devices share the host's cores, so
# an op in a sharded step runs slower than its microbenchmark alone, and XLA:CPU's batched small matmuls (attention
# scores) and reductions (norms) far slower than its square matmuls and copies: the microbenchmarks see neither.
HOST_OP_KINDS = ("matmul", "attention", "elementwise", "collective")


def host_factor(chip: Chip, kind: str) -> float:
    """The calibrated host's factor for ops of ``kind`` (HOST_OP_KINDS); 1 off a calibrated host."""
    if chip.kind != "cpu":
        return 1.0
    factors = chip.calibration.get("op_factor") if chip.calibration else None
    return float(factors.get(kind, 1.0)) if factors else 1.0


def tile(chip: Chip) -> float:
    # v6e's MXU is 256x256 (tpus.md); TPU7x's taken as v6e's, its predecessor's (no published size was found: an
    # assumption); the other TPUs' are 128x128.
    return 256.0 if chip.name in ("tpu-v6e", "tpu-v7x") else TILE[chip.kind]


def gemm_ceiling(chip: Chip, dtype: str = "bf16") -> float:
    """The best fraction of ``dtype``'s peak a large GEMM reaches on this chip (module docstring)."""
    if chip.kind == "tpu":
        measured = {"tpu-v5e": GEMM_CEILING_TPU, "tpu-v6e": GEMM_CEILING_TPU6E, "tpu-v7x": GEMM_CEILING_TPU7X}
        return measured.get(chip.name, GEMM_CEILING_TPU_OTHER)
    # a 4-bit float GEMM takes its family's fp8 share where no fp4 figure is measured (an assumption)
    dt = {"fp16": "bf16", "fp32": "bf16", "fp4": "fp8"}.get(canonical_dtype(dtype), canonical_dtype(dtype))
    return GEMM_CEILING.get((family(chip), dt), GEMM_CEILING_OTHER[chip.kind])


def matmul_efficiency(chip: Chip, m: float, k: float, n: float, dtype: str = "bf16") -> float:
    """Fraction of peak FLOP/s a GEMM of this shape reaches when compute-bound."""
    t = tile(chip)
    return gemm_ceiling(chip, dtype) * (m / (m + t)) * (k / (k + t)) * (n / (n + t))


def matmul_time(chip: Chip, m: float, k: float, n: float, dtype: str = "bf16", batch: float = 1.0) -> float:
    """Achievable time of ``batch`` independent ``[m, k] @ [k, n]`` products."""
    flops = 2.0 * batch * m * k * n
    nbytes = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
    return max(flops / (matmul_efficiency(chip, m, k, n, dtype) * chip.flops(dtype)), memory_time(chip, nbytes))


# A fused attention kernel's rate grows with the sequence it sees (fewer, fuller tiles; the causal mask's wasted half
# tile a smaller share): FlashAttention-3 causal forward on H100, hd128, 292 TFLOP/s at 512 tokens and 616 at 16k
# (microbenchmarks.md A4); FlashAttention-2 191 -> 335 over the same range (A4). Log-linear between the two ends, held
# beyond them. ATTENTION's rates were measured at 8k tokens (A13, A16), so a kernel at s tokens runs at
# ATTENTION x curve(s) / curve(8192): 0.53x at 512, 0.77x at 2k, 1.12x from 16k (FA3). The forward's shape is taken for
# forward and backward together (A8: the backward rises alike, 316 -> 561 from 512 to 16k), and FA3's for every kernel
# but FA2 (B200's FA4: A15 rises 4% from 8k to 32k, within FA3's curve).
ATTENTION_LENGTH = {"fa2": ((512, 191.0), (16384, 335.0)), "fa3": ((512, 292.0), (16384, 616.0))}
ATTENTION_REFERENCE_TOKENS = 8192  # where ATTENTION's rates were measured


def _length_curve(kernel: str, tokens: float) -> float:
    (x0, y0), (x1, y1) = ATTENTION_LENGTH.get(kernel, ATTENTION_LENGTH["fa3"])
    x = min(max(tokens, x0), x1)
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def attention_efficiency(chip: Chip, kernel: str, tokens: float = ATTENTION_REFERENCE_TOKENS) -> float | None:
    """A fused attention kernel's measured rate on this chip (fraction of the bf16 peak) over a sequence of ``tokens``
    (ATTENTION at 8k, along ATTENTION_LENGTH), or None where nothing is published (TPUs, CPUs): the caller then prices
    attention as matmuls."""
    rate = ATTENTION.get((family(chip), kernel))
    if rate is None:
        return None
    return rate * _length_curve(kernel, tokens) / _length_curve(kernel, ATTENTION_REFERENCE_TOKENS)


def hbm_fraction(chip: Chip) -> float:
    """The fraction of HBM bandwidth a streaming kernel reaches on this chip (module docstring)."""
    return HBM_FRACTION.get(family(chip), HBM_FRACTION_OTHER[chip.kind])


def memory_time(chip: Chip, nbytes: float) -> float:
    """Achievable time of a memory-bound op moving ``nbytes`` through HBM."""
    return nbytes / (hbm_fraction(chip) * chip.hbm_bandwidth)


def decode_weight_fraction(chip: Chip) -> float:
    """The fraction of HBM bandwidth the skinny GEMMs of a decode step stream weights at: G16's 68% on Hopper (H100);
    on another GPU family with a measured copy rate, G16's share of that rate (SKINNY_GEMM_VS_COPY); G16's 68% on other
    GPUs and on TPUs (no TPU figure is published; a skinny GEMM does not reach a copy's rate on either); the copy rate
    on a host CPU."""
    if chip.kind == "tpu":
        return DECODE_WEIGHT_FRACTION_TPU
    if chip.kind != "gpu":
        return hbm_fraction(chip)
    fam = family(chip)
    if fam != "h100" and fam in HBM_FRACTION:
        return SKINNY_GEMM_VS_COPY * HBM_FRACTION[fam]
    return DECODE_WEIGHT_FRACTION


# Weight-only int8 and int4 decode GEMMs on a GPU (the weights dequantised to bf16 inside the kernel: Marlin W8A16 and
# W4A16, the kernels vLLM runs) stream their weights at a smaller share of HBM than a bf16 GEMM: on H100 at N = K = 8192
# and M = 1, bf16 2.30 TB/s, W8A16 1.73, W4A16 1.25 (microbenchmarks-added.md Q6), so int8 weights take 0.752 / 0.543
# of bf16's streaming rate. Grade C (a community benchmark), carried to every GPU (A10's Marlin reaches the 4-bit ideal:
# Q1). Their tiles are 16 rows (Marlin's; Q1 holds the ideal to batch 16-32), not a bf16 GEMM's 128: the compute floor
# of a skinny quantised GEMM is that of 16-row tiles.
QUANT_STREAM = {"int8": 1.73 / 2.30, "int4": 1.25 / 2.30}
QUANT_ROW_TILE = 16.0
# A 4-bit float weight-only kernel (MXFP4/NVFP4 weights dequantised to bf16, Marlin's FP4 path) is priced as the
# 4-bit integer one: no measurement of its own (an assumption).
WEIGHT_ONLY_AS = {"fp4": "int4"}


def _weight_only(weights: str, compute: str) -> str | None:
    """The QUANT_STREAM key of a weight-only quantised GEMM (its weights narrower than the bf16 it computes in)."""
    w = canonical_dtype(weights)
    w = WEIGHT_ONLY_AS.get(w, w)
    return w if w in QUANT_STREAM and canonical_dtype(compute) == "bf16" else None


def decode_row_tile(chip: Chip, cfg) -> float:
    """The row tile a decode step's GEMMs pad its batch to (the compute floor): a quantised weight-only kernel's 16 on
    a GPU (QUANT_ROW_TILE), the chip's tile otherwise."""
    if chip.kind == "gpu" and _weight_only(cfg.weights, cfg.compute):
        return QUANT_ROW_TILE
    return tile(chip)


# fp8 decode GEMMs on a GPU, where the activations are quantised to fp8 as the step runs (per-token dynamic scales:
# what vLLM, SGLang and TorchAO's float8 run by default): a separate quantisation kernel before each GEMM, and the fp8
# GEMM itself streams its half-size weights at a lower rate than a bf16 one at these shapes, so a skinny fp8 GEMM takes
# 0.62 of the bf16 GEMM's time, not 0.5. Mean of the bf16 / fp8 TFLOP/s ratios at M = 1, 16, 64, 128 rows on H100:
# vLLM PR #49363 (2026, benchmark_fp8_gemm.py, N x K = 12288 x 5376, 'fp8-tensor-w-token-a' against torch bf16:
# 0.61 / 0.65 / 0.66 / 0.70) and PR #17126 (2025, bench_fp8_gemm.py, Llama-3.1-8B's 6144 x 4096, 'fp8-channel-w-
# token-a': 0.62 / 0.59 / 0.56 / 0.61; its GPU is unstated, and its bf16 rate at M = 256, 544 TFLOP/s, is beyond an
# A100). With static activation scales (the 'noquant' columns of the same tables) the ratio is 0.51: the byte ratio,
# so ``static`` keeps fp8's clean halving. Grade C (benchmark output in pull requests); no TPU figure is published.
FP8_DECODE_TIME_VS_BF16 = 0.62
FP8_SCALINGS = ("dynamic", "static")


def decode_weights_time(
    chip: Chip, nbytes: float, weights: str = "bf16", compute: str = "bf16", fp8_scaling: str = "dynamic"
) -> float:
    """Streaming weights through the skinny GEMMs of a decode step (decode_weight_fraction); fp8 weights that
    multiply fp8 activations quantised as the step runs take FP8_DECODE_TIME_VS_BF16 of bf16's time on a GPU."""
    fraction = decode_weight_fraction(chip)
    quant = _weight_only(weights, compute)
    if chip.kind == "gpu" and quant:
        fraction *= QUANT_STREAM[quant]
    fp8_gemm = canonical_dtype(weights) == "fp8" and canonical_dtype(compute) == "fp8"
    if chip.kind == "gpu" and fp8_gemm and fp8_scaling == "dynamic":
        fraction *= dtype_bytes("fp8") / dtype_bytes("bf16") / FP8_DECODE_TIME_VS_BF16
    return nbytes / (fraction * chip.hbm_bandwidth)


# Across nodes a collective's rate depends on its size: C14, 32 B200 over EFA (4 nodes), per-GPU NIC rate as a
# fraction of line rate, derived by the source as busbw (k-1)/(n-1): 12.5% at 16 MiB, 44% at 256 MiB (229.1 GB/s
# busbw), 70% at 1 GiB, 74% at 16 GiB; C17 (71% on 4 H100 nodes) agrees at the top. Interpolated in log size,
# held at the ends; point-to-point sends are not collectives (raw NIC rate, C15/C16: NIC_FRACTION).
NIC_CURVE = ((16 * 2**20, 0.125), (256 * 2**20, 0.44), (2**30, 0.70), (16 * 2**30, 0.74))
# Compute that runs while a collective is in flight on a GPU is slower: the collective's kernels take SMs and
# memory bandwidth. Mean slowdown of the overlapped computation, 18.9% (max 40%), GPT and LLaMA layers on 4x
# A100 and 4x H100 (Li et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning", arXiv:2507.03114, 2025). TPUs move collectives with dedicated DMA engines: none assumed.
OVERLAP_SLOWDOWN = {"gpu": 0.189, "tpu": 0.0, "cpu": 0.0}


def nic_fraction(nbytes: float) -> float:
    """Fraction of the NIC line rate a cross-node collective of ``nbytes`` (V) reaches (NIC_CURVE)."""
    pts = NIC_CURVE
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if nbytes <= x1:
            w = math.log(nbytes / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return pts[-1][1]


# Inside a node a GPU collective reaches its plateau rate only for large messages: nccl-tests all-reduce on 8 GPUs
# (in place), bus bandwidth in GB/s at 1 KiB, 2 KiB, ... 8 GiB (24 doubling sizes), Azure AI-benchmarking-guide
# (microbenchmarks.md C1, C3, C4: ND A100 v4, NCCL 2.18.5; ND H100 v5, NCCL 2.18.5; ND H200 v5, NCCL 2.20.5). At
# 16 MiB the A100 reaches 47% of its plateau, H100 49%, H200 50%; at 1 MiB 9-16%. B200 has no nccl-tests sweep (C9
# is torch.distributed's, with its per-call overhead and a step between 4 and 8 GiB): it keeps the plateau rate
# (a chip family with no sweep is priced as before). The bandwidth term of a collective
# of V bytes is divided by its size's share of the plateau (log-log interpolation; below the smallest size the time
# stays that size's, above the largest the plateau), so a mid-size collective costs what the sweep measured rather
# than the larger of a latency and the plateau rate. The share is the all-reduce's, taken for every NCCL collective
# (no size sweep of the others is published); point-to-point sends keep the plateau (C13: a copy engine's rate).
_DOUBLINGS = tuple(2**k for k in range(10, 34))
_BUSBW_GBPS = {  # at each of _DOUBLINGS
    "a100": "0.04 0.08 0.17 0.33 0.67 1.37 2.70 5.15 10.11 19.24 36.22 53.54 71.43 89.99 109.22 132.77 166.63 174.18 "
    "213.87 221.58 228.10 230.22 230.48 231.58",
    "h100": "0.07 0.14 0.27 0.53 0.95 1.71 2.72 5.40 10.86 21.35 43.70 81.93 128.73 172.13 234.45 295.53 361.78 400.61 "
    "423.38 438.46 466.35 472.36 475.54 478.87",
    "h200": "0.06 0.12 0.23 0.47 0.93 1.84 3.72 7.39 14.75 29.38 52.96 88.78 138.44 181.94 240.41 300.91 368.11 412.45 "
    "432.24 442.72 467.58 472.57 477.41 479.98",
}
NVLINK_SWEEP: dict[str, tuple[tuple[float, float], ...]] = {
    fam: tuple(zip(_DOUBLINGS, map(float, text.split()), strict=True)) for fam, text in _BUSBW_GBPS.items()
}
RAMPED_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _sweep_times(pts: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    """``(bytes, seconds)`` of a sweep (each size over its bus bandwidth: the time up to the 2(n-1)/n factor), made
    non-decreasing in size (a larger message never takes less time: at 256 KiB-1 MiB the H100 sweep's dips 1%)."""
    out, worst = [], 0.0
    for size, busbw in pts:
        worst = max(worst, size / (busbw * 1e9))
        out.append((size, worst))
    return tuple(out)


_SWEEP_TIMES = {fam: _sweep_times(pts) for fam, pts in NVLINK_SWEEP.items()}


SWEEP_GPUS = 8  # the sweeps' group: a collective of V over n GPUs moves the pieces one of V * 8 / n over 8 does


def nvlink_ramp(chip: Chip, kind: str, nbytes: float, group: int = SWEEP_GPUS) -> float:
    """The share of its plateau bus bandwidth an intra-node GPU collective of ``nbytes`` over ``group`` GPUs reaches
    (NVLINK_SWEEP, log-log between the sizes measured, at the size whose per-GPU pieces are as large on the sweep's
    8 GPUs): 1 for a family with no sweep, for point-to-point sends, and off GPUs."""
    fam = family(chip)
    pts = _SWEEP_TIMES.get(fam) if chip.kind == "gpu" and kind in RAMPED_KINDS else None
    if not pts:
        return 1.0
    nbytes = nbytes * SWEEP_GPUS / max(group, 1)
    top = pts[-1][0] / pts[-1][1]  # the plateau's bytes per second
    if nbytes <= pts[0][0]:  # below the smallest size: that size's time
        return nbytes / pts[0][1] / top
    for (x0, t0), (x1, t1) in itertools.pairwise(pts):
        if nbytes <= x1:
            w = math.log(nbytes / x0) / math.log(x1 / x0)
            return nbytes / math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))) / top
    return 1.0


def overlap_cost(chip: Chip, comm_s: float, compute_s: float) -> float:
    """What a collective hidden behind ``compute_s`` of computation still costs: the overlapped part of the
    computation runs OVERLAP_SLOWDOWN slower (GPUs), and whatever the computation does not cover is exposed."""
    return overlapped(overlap_slowdown(chip), comm_s, compute_s)


def overlap_slowdown(chip: Chip) -> float:
    """How much slower computation runs while a collective overlaps it (OVERLAP_SLOWDOWN; 0 off GPUs)."""
    return OVERLAP_SLOWDOWN.get(chip.kind, 0.0)


def overlapped(slowdown: float, comm_s: float, compute_s: float) -> float:
    """:func:`overlap_cost` at a chip's :func:`overlap_slowdown` (a step formula looks it up once, not per term):
    the uncovered communication, plus the slowdown of the computation it overlaps."""
    if comm_s > compute_s:
        return comm_s - compute_s + slowdown * compute_s
    return slowdown * comm_s


def collective_fraction(chip: Chip, kind: str, group: int, scope: str, nbytes: float | None = None) -> float:
    """The fraction of the modelled link rate a collective reaches (module docstring)."""
    if chip.kind == "tpu":
        return ICI_FRACTION if chip.name == "tpu-v5e" else ICI_FRACTION_OTHER
    if chip.kind != "gpu":
        return COLLECTIVE_FRACTION[chip.kind]
    if scope == "cross-node":
        if nbytes is None or kind == "permute":
            return NIC_FRACTION
        return nic_fraction(nbytes)
    fam = family(chip)
    if kind == "all-reduce" and group >= 6 and fam in NVLS_ALL_REDUCE:
        return NVLS_ALL_REDUCE[fam]
    return NVLINK_RING.get(fam, COLLECTIVE_FRACTION["gpu"])


def collective_on(
    chip: Chip,
    kind: str,
    nbytes: float,
    group: int,
    *,
    scope: str = "node",
    members_per_node: int | None = None,
    axes: tuple[int, ...] | None = None,
):
    """The collective model's cost of a group of ``group`` chips where it physically sits: on a torus, the
    slice it occupies (its axes and their wraparound by the chip's rule); None for a group of one."""
    if group <= 1 or nbytes <= 0:
        return None
    sizes, wrap = _sits(chip, group, scope, axes)
    return collective_time(kind, nbytes, sizes, chip, scope=scope, members_per_node=members_per_node, wraparound=wrap)


def _sits(chip: Chip, group: int, scope: str, axes: tuple[int, ...] | None) -> tuple[tuple, tuple[bool, ...]]:
    """The axes a group of ``group`` chips spans and their wraparound: on a torus inside a slice, the slice it
    occupies by the chip's rule; else the ``axes`` given (one axis of the group by default), every torus axis a
    closed ring and none off a torus (collective_time's default)."""
    torus = chip.topology == "torus"
    if axes is None and torus and scope == "node":
        axes = chip.slice_shape(group)
        return tuple(axes), chip.wraparound(axes)
    axes = tuple(axes) if axes is not None else (group,)
    return axes, tuple(torus for _ in axes)


def comm_time(
    chip: Chip,
    kind: str,
    nbytes: float,
    group: int,
    *,
    scope: str = "node",
    members_per_node: int | None = None,
    axes: tuple[int, ...] | None = None,
) -> float:
    """Achievable time of one collective (the collective model at the fabric's measured efficiency): what
    :func:`achievable_time` gives :func:`collective_on`'s cost, priced without building it (the estimators call
    this for every collective of every layout they price; ``kind`` is canonical, as theirs are)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    plain = type(group) is int and kind in COLLECTIVE_KINDS and scope in COLLECTIVE_SCOPES and math.isfinite(nbytes)
    if not plain or not (axes is None or all(type(a) is int and a >= 1 for a in axes)):
        # a caller's spelling or a bad value: the collective model checks it and names what is valid
        c = collective_on(chip, kind, nbytes, group, scope=scope, members_per_node=members_per_node, axes=axes)
        return achievable_time(chip, c, group, scope)
    sizes, wrap = _sits(chip, group, scope, axes)
    fields = price_fields(kind, float(nbytes), sizes, wrap, chip, scope, members_per_node)
    return _achievable(chip, kind, float(nbytes), fields["time_s"], fields["bandwidth_s"], group, scope)


def achievable_time(chip: Chip, c, group: int, scope: str = "node") -> float:
    """:func:`comm_time` of a collective the model already priced (``c``: its CollectiveCost over ``group`` chips)."""
    return _achievable(chip, c.kind, c.bytes, c.time_s, c.bandwidth_s, group, scope)


def _achievable(
    chip: Chip, kind: str, nbytes: float, time_s: float, bandwidth_s: float, group: int, scope: str
) -> float:
    """The modelled time and bandwidth term of a collective at the fabric's measured efficiency."""
    frac = collective_fraction(chip, kind, group, scope, nbytes) / host_factor(chip, "collective")
    if scope == "node":  # the bandwidth term at its size's share of the plateau (NVLINK_SWEEP)
        return max(time_s, bandwidth_s / nvlink_ramp(chip, kind, nbytes, group)) / frac
    if chip.kind == "gpu":  # across nodes the NIC's measured share (NIC_CURVE) is of its line rate: the bandwidth
        return max(time_s, bandwidth_s / frac)  # term's, not the fixed latency's (0.125 of it would be 8x)
    return time_s / frac
