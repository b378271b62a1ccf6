"""Every efficiency constant with its grade, its source and a stated alternative: what `validate --sensitivity` and the
estimates' intervals swap.

Grades (issue 35):

* **A**: measured on this chip family (a microbenchmark of the piece on the same silicon);
* **B**: carried over from another family, or derived from measurements (a ratio, a proxy part);
* **C**: assumed (a count or a figure nobody measured for this use).

A constant lives where it is used (:mod:`lab.predict.efficiency`, :mod:`lab.predict.training.estimate`); this
table names it by module, attribute and key, so :func:`swapped` can put its alternative in place for the length of
a ``with`` block and the estimators, which read the module's tables at call time, price with it. The alternative
is a value a reader could defend as well (another measurement, the figure of the neighbouring family, the other end
of a stated range), not a bound: the spread it makes in an answer says how much that answer leans on the constant.
"""
# Over 500 lines on purpose: every efficiency constant with its grade, source and alternative is one table by design
# (one table per fact).

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

from lab.core.errors import UserError

GRADES = ("A", "B", "C")
# constants that enter one estimator only (the rest, GEMM, HBM, collective and fabric figures, enter both)
SERVING_ONLY = ("decode.",)
TRAINING_ONLY = ("attention.", "overlap.", "host.", "eager.")


@dataclass(frozen=True)
class Constant:
    """One graded constant.

    Attributes:
        name: dotted name (``gemm.h100.bf16``), what the tables print.
        module, attr, key: where it lives: ``module.attr`` or ``module.attr[key]``.
        grade: ``A``, ``B`` or ``C`` (module docstring).
        source: the microbenchmark rows or the reasoning behind the value.
        alternative: the value :func:`swapped` puts in its place (a number, or a table like the constant's).
        why: what the alternative stands for.
        chips: which chips it touches: a family (``h100``), a kind (``gpu``, ``tpu``) or ``*``; an estimate on another
            chip does not depend on it (so its interval skips it).
    """

    name: str
    module: str
    attr: str
    key: object
    grade: str
    source: str
    alternative: object
    why: str
    chips: tuple[str, ...] = ("*",)

    @property
    def value(self) -> float:
        table = getattr(importlib.import_module(self.module), self.attr)
        return table if self.key is None else table[self.key]

    def touches(self, family: str, kind: str) -> bool:
        return "*" in self.chips or family in self.chips or kind in self.chips

    @property
    def prices(self) -> tuple[str, ...]:
        """What the constant enters: ``training`` and/or ``serving`` estimates (by its name's family: a decode step's
        figures price serving only; attention kernels, compute overlap, host offload and eager ops training only)."""
        if self.name.startswith(SERVING_ONLY):
            return ("serving",)
        if self.name.startswith(TRAINING_ONLY):
            return ("training",)
        return ("training", "serving")


_E = "lab.predict.efficiency"
_T = "lab.predict.training.estimate"
_AR = "lab.predict.inference.allreduce"


def _c(name, attr, key, grade, source, alternative, why, chips=("*",), module=_E) -> Constant:
    return Constant(name, module, attr, key, grade, source, alternative, why, tuple(chips))


CONSTANTS: tuple[Constant, ...] = (
    # ----- GEMM ceilings (microbenchmarks.md §1) -----
    _c("gemm.a100.bf16", "GEMM_CEILING", ("a100", "bf16"), "A", "G9 (16384^3, sustained)", 0.869, "G1 burst", ["a100"]),
    _c(
        "gemm.a100.int8",
        "GEMM_CEILING",
        ("a100", "int8"),
        "C",
        "assumed as bf16 (G25: int8 no faster)",
        0.80,
        "G25: int8 at 40% of its own peak, 0.80 of the bf16 peak the table is against",
        ["a100"],
    ),
    _c("gemm.h100.bf16", "GEMM_CEILING", ("h100", "bf16"), "A", "MSMF of the GH100 die", 0.803, "G2 burst", ["h100"]),
    _c("gemm.h100.fp8", "GEMM_CEILING", ("h100", "fp8"), "A", "G11 (16384^3)", 0.709, "G3 best shape", ["h100"]),
    _c("gemm.h200.bf16", "GEMM_CEILING", ("h200", "bf16"), "A", "MSMF", 0.803, "G2 burst", ["h200"]),
    _c("gemm.h200.fp8", "GEMM_CEILING", ("h200", "fp8"), "A", "G13 (16384^3)", 0.734, "G4 best shape", ["h200"]),
    _c("gemm.b200.bf16", "GEMM_CEILING", ("b200", "bf16"), "A", "MSMF at ~980 W", 0.776, "G6 burst", ["b200"]),
    _c("gemm.b200.fp8", "GEMM_CEILING", ("b200", "fp8"), "A", "MSMF", 0.763, "G7 burst", ["b200"]),
    _c(
        "gemm.a10g.bf16",
        "GEMM_CEILING",
        ("a10g", "bf16"),
        "C",
        "D8: torch.mm sweep on g5",
        0.70,
        "70% of peak",
        ["a10g"],
    ),
    _c(
        "gemm.a10.bf16",
        "GEMM_CEILING",
        ("a10", "bf16"),
        "C",
        "D8 (A10G, the same die)",
        0.45,
        "D10: host-timed 56 TF",
        ["a10"],
    ),
    _c("gemm.l4.bf16", "GEMM_CEILING", ("l4", "bf16"), "C", "D7: torch.mm sweep", 0.70, "70% of peak", ["l4"]),
    _c("gemm.l4.fp8", "GEMM_CEILING", ("l4", "fp8"), "C", "bf16's share (no fp8 sweep)", 0.45, "lower", ["l4"]),
    _c("gemm.l40s.bf16", "GEMM_CEILING", ("l40s", "bf16"), "C", "D6: torch.mm sweep", 0.65, "lower", ["l40s"]),
    _c("gemm.l40s.fp8", "GEMM_CEILING", ("l40s", "fp8"), "C", "bf16's share (no fp8 sweep)", 0.60, "lower", ["l40s"]),
    _c("gemm.v100.fp16", "GEMM_CEILING", ("v100", "bf16"), "C", "D9: fp16 sweep", 0.67, "D10: host-timed", ["v100"]),
    # AMD Instinct (X1: bursts, TunableOp); the alternative is B200's sustained-over-burst ratio (0.825) applied
    _c("gemm.mi300x.bf16", "GEMM_CEILING", ("mi300x", "bf16"), "A", "X1 (burst)", 0.42, "x 0.825", ["mi300x"]),
    _c("gemm.mi300x.fp8", "GEMM_CEILING", ("mi300x", "fp8"), "C", "bf16's share", 0.42, "x 0.825", ["mi300x"]),
    _c("gemm.mi325x.bf16", "GEMM_CEILING", ("mi325x", "bf16"), "A", "X1 (burst)", 0.495, "x 0.825", ["mi325x"]),
    _c("gemm.mi325x.fp8", "GEMM_CEILING", ("mi325x", "fp8"), "C", "bf16's share", 0.495, "x 0.825", ["mi325x"]),
    _c("gemm.mi355x.bf16", "GEMM_CEILING", ("mi355x", "bf16"), "A", "X1 (burst)", 0.516, "x 0.825", ["mi355x"]),
    _c("gemm.mi355x.fp8", "GEMM_CEILING", ("mi355x", "fp8"), "C", "bf16's share", 0.516, "x 0.825", ["mi355x"]),
    _c("gemm.tpu-v5e", "GEMM_CEILING_TPU", None, "A", "G26 (8192^3)", 0.843, "G26 at 4096^3", ["tpu-v5e"]),
    _c("gemm.tpu-v6e", "GEMM_CEILING_TPU6E", None, "A", "T8 (8192^3, profiler)", 0.923, "v5e's (T9)", ["tpu-v6e"]),
    _c("gemm.tpu-v7x", "GEMM_CEILING_TPU7X", None, "B", "T4 (32768^3, per core)", 0.774, "T4 at 4096^3", ["tpu"]),
    _c(
        "gemm.tpu.other",
        "GEMM_CEILING_TPU_OTHER",
        None,
        "B",
        "G26: v5e's rate carried to v2, v3, v4, v5p",
        0.763,
        "a GPU's sustained bf16 share (MSMF)",
        ["tpu"],
    ),
    _c(
        "gemm.gpu.other",
        "GEMM_CEILING_OTHER",
        "gpu",
        "B",
        "Hopper's sustained bf16 share carried to unmeasured GPUs",
        0.65,
        "the power-limited B200's share",
        ["gpu"],
    ),
    _c("gemm.cpu", "GEMM_CEILING_OTHER", "cpu", "C", "a host's calibration replaces it", 0.5, "half", ["cpu"]),
    _c("tile.gpu", "TILE", "gpu", "C", "tile quantisation as m/(m+128), assumed", 64.0, "a 64-wide tile", ["gpu"]),
    _c("tile.tpu", "TILE", "tpu", "C", "the MXU's 128 in the assumed form m/(m+tile)", 256.0, "256 wide", ["tpu"]),
    _c("tile.cpu", "TILE", "cpu", "C", "none assumed on a host", 8.0, "an 8-wide vector", ["cpu"]),
    # ----- fused attention (§2) -----
    _c("attention.a100.fa2", "ATTENTION", ("a100", "fa2"), "A", "A13 (FA2, seq 8192)", 0.737, "A1 best case", ["a100"]),
    _c(
        "attention.a100.fa3",
        "ATTENTION",
        ("a100", "fa3"),
        "A",
        "A13: FA3 does not run on A100, FA2 does",
        0.737,
        "A1 best case",
        ["a100"],
    ),
    _c("attention.h100.fa2", "ATTENTION", ("h100", "fa2"), "A", "A13, A2", 0.37, "A4: FA2 causal at 16k", ["h100"]),
    _c(
        "attention.h100.fa3",
        "ATTENTION",
        ("h100", "fa3"),
        "B",
        "A16: FA3 inside an 8k training step on H200",
        0.57,
        "A3/A8: FA3 forward and backward at 16k, outside a step",
        ["h100"],
    ),
    _c("attention.h200.fa2", "ATTENTION", ("h200", "fa2"), "A", "A13", 0.37, "A4: FA2 at 16k", ["h200"]),
    _c(
        "attention.h200.fa3",
        "ATTENTION",
        ("h200", "fa3"),
        "B",
        "A16 (a blog's in-step figure)",
        0.57,
        "A3/A8",
        ["h200"],
    ),
    _c(
        "attention.b200.fa2",
        "ATTENTION",
        ("b200", "fa2"),
        "B",
        "A16: FA4 in an 8k step (no FA2 figure)",
        0.50,
        "A14's 71% best case, discounted as in a step",
        ["b200"],
    ),
    _c(
        "attention.b200.fa3",
        "ATTENTION",
        ("b200", "fa3"),
        "B",
        "A16: FA4 in an 8k step",
        0.50,
        "A14, discounted",
        ["b200"],
    ),
    _c(
        "attention.length.fa3",
        "ATTENTION_LENGTH",
        "fa3",
        "B",
        "A4: FA3 causal forward on H100 by sequence length, taken for forward and backward and every family",
        ((512, 1.0), (16384, 1.0)),
        "no length dependence (every length at the 8k rate)",
        ["gpu"],
    ),
    _c(
        "attention.length.fa2",
        "ATTENTION_LENGTH",
        "fa2",
        "B",
        "A4: FA2 causal forward on H100 by sequence length, carried to A100",
        ((512, 1.0), (16384, 1.0)),
        "no length dependence",
        ["gpu"],
    ),
    # ----- memory-bound ops (§3) -----
    _c("hbm.a100", "HBM_FRACTION", "a100", "A", "H1 copy", 0.83, "H1 add/triad", ["a100"]),
    _c("hbm.h100", "HBM_FRACTION", "h100", "A", "H2 copy", 0.89, "H2 add/triad", ["h100"]),
    _c("hbm.h200", "HBM_FRACTION", "h200", "A", "H3 copy", 0.86, "H3 add/triad", ["h200"]),
    _c("hbm.b200", "HBM_FRACTION", "b200", "B", "H4 (GB200, a proxy part)", 0.85, "Hopper's copy share", ["b200"]),
    _c("hbm.a10", "HBM_FRACTION", "a10", "C", "D10: host-timed copy", 0.87, "D11: ECC's 85-90% ceiling", ["a10"]),
    _c("hbm.a10g", "HBM_FRACTION", "a10g", "C", "D10 (A10), carried", 0.87, "D11", ["a10g"]),
    _c("hbm.v100", "HBM_FRACTION", "v100", "C", "D10: host-timed copy", 0.75, "lower", ["v100"]),
    _c("hbm.mi300x", "HBM_FRACTION", "mi300x", "B", "X2 (a user's roofline run)", 0.85, "the GPU default", ["mi300x"]),
    _c("hbm.mi325x", "HBM_FRACTION", "mi325x", "B", "X2 (MI300X), carried", 0.85, "the GPU default", ["mi325x"]),
    _c("hbm.mi355x", "HBM_FRACTION", "mi355x", "B", "X2 (MI300X), carried", 0.85, "the GPU default", ["mi355x"]),
    _c("hbm.gpu.other", "HBM_FRACTION_OTHER", "gpu", "C", "assumed for an unmeasured GPU", 0.75, "lower", ["gpu"]),
    _c(
        "hbm.tpu",
        "HBM_FRACTION_OTHER",
        "tpu",
        "B",
        "T3: TPU7x's HBM copy at 87% (the one TPU measurement), carried to v3-v6e",
        0.90,
        "the figure assumed before T3 (C)",
        ["tpu"],
    ),
    _c("hbm.cpu", "HBM_FRACTION_OTHER", "cpu", "C", "a host's calibration replaces it", 0.8, "lower", ["cpu"]),
    _c(
        "decode.weights.hopper",
        "DECODE_WEIGHT_FRACTION",
        None,
        "A",
        "G16: DeepGEMM M=64 on H800 (Hopper HBM3)",
        0.80,
        "G16's best row",
        ["h100", "gpu"],
    ),
    _c(
        "decode.weights.tpu",
        "DECODE_WEIGHT_FRACTION_TPU",
        None,
        "B",
        "T3: TPU7x's copy rate (a skinny matmul's weights stream by DMA), carried to v3-v6e",
        0.68,
        "G16: Hopper's skinny-GEMM share (DeepGEMM on H800)",
        ["tpu"],
    ),
    _c(
        "decode.quant.int8",
        "QUANT_STREAM",
        "int8",
        "C",
        "Q6: W8A16 Marlin on H100 at 1.73 of bf16's 2.30 TB/s, carried to every GPU",
        1.0,
        "Q1: Marlin at the ideal on A10 (int8 as fast per byte as bf16)",
        ["gpu"],
    ),
    _c(
        "decode.quant.int4",
        "QUANT_STREAM",
        "int4",
        "C",
        "Q6: W4A16 Marlin on H100 at 1.25 of 2.30 TB/s, carried to every GPU",
        1.0,
        "Q1: the 4-bit ideal on A10",
        ["gpu"],
    ),
    _c(
        "decode.quant.row_tile",
        "QUANT_ROW_TILE",
        None,
        "C",
        "Marlin's 16-row tiles (Q1: ideal to batch 16-32)",
        32.0,
        "32 rows (Q1: the ideal holds to batch 32)",
        ["gpu"],
    ),
    _c(
        "decode.skinny_vs_copy",
        "SKINNY_GEMM_VS_COPY",
        None,
        "B",
        "G16 / H2, carried to A100/H200/B200",
        1.0,
        "skinny GEMMs at the copy rate",
        ["a100", "h200", "b200"],
    ),
    # ----- collectives (§4) -----
    _c("nvlink.a100", "NVLINK_RING", "a100", "A", "C1/C2", 0.70, "C1 at 1 GiB", ["a100"]),
    _c("nvlink.h100", "NVLINK_RING", "h100", "A", "C6 (the same NVLink 4 on H200)", 0.69, "C12", ["h100"]),
    _c("nvlink.h200", "NVLINK_RING", "h200", "A", "C6", 0.69, "C12", ["h200"]),
    _c("xgmi.mi300x", "NVLINK_RING", "mi300x", "A", "X3 (8 GPUs)", 0.745, "X3 at 2 GPUs", ["mi300x"]),
    _c("xgmi.mi325x", "NVLINK_RING", "mi325x", "B", "X3 (MI300X's links)", 0.745, "X3 at 2 GPUs", ["mi325x"]),
    _c("xgmi.mi355x", "NVLINK_RING", "mi355x", "B", "X3 (MI300X), carried", 0.60, "lower", ["mi355x"]),
    _c("nvlink.b200", "NVLINK_RING", "b200", "A", "C8", 0.82, "C9 at 4 GiB", ["b200"]),
    _c("nvls.h100", "NVLS_ALL_REDUCE", "h100", "A", "C3", 0.81, "NVLS off (ring, C7)", ["h100"]),
    _c("nvls.h200", "NVLS_ALL_REDUCE", "h200", "A", "C5, C6", 0.81, "NVLS off", ["h200"]),
    _c("nvls.b200", "NVLS_ALL_REDUCE", "b200", "A", "C8", 0.75, "NVLS off", ["b200"]),
    _c(
        "nic.fraction",
        "NIC_FRACTION",
        None,
        "B",
        "C14 (B200, EFA), C17 (H100, IB) carried to every GPU",
        0.67,
        "C18 (A100, HDR)",
        ["gpu"],
    ),
    _c(
        "nic.curve",
        "NIC_CURVE",
        None,
        "B",
        "C14 (32 B200 over EFA), carried to every GPU cluster",
        ((16 * 2**20, 0.25), (256 * 2**20, 0.55), (2**30, 0.70), (16 * 2**30, 0.74)),
        "twice C14's share at 16 MiB (a lower-latency fabric)",
        ["gpu"],
    ),
    _c("ici.fraction.v5e", "ICI_FRACTION", None, "A", "C20: v5e all-gather", 0.82, "C21: no wraparound", ["tpu-v5e"]),
    _c(
        "ici.fraction.other",
        "ICI_FRACTION_OTHER",
        None,
        "B",
        "C20 (v5e) carried; v5p/v6e agree (T1-T2)",
        0.82,
        "C21: v5e over a 4-long axis without wraparound",
        ["tpu"],
    ),
    _c(
        "fabric.infiniband",
        "FABRIC_STEP_LATENCY",
        "infiniband",
        "C",
        "N13: a tiny all-reduce between two HDR-connected A100s, 19-21 us over two steps (derived)",
        2.5e-6,
        "NCCL's own tuning model (hwLat, 2.5 us a network step)",
        ["gpu"],
        module="lab.core.chip",
    ),
    _c(
        "fabric.roce",
        "FABRIC_STEP_LATENCY",
        "roce",
        "C",
        "taken as InfiniBand's (N13)",
        2.5e-6,
        "NCCL's tuning model",
        ["gpu"],
        module="lab.core.chip",
    ),
    _c(
        "fabric.efa",
        "FABRIC_STEP_LATENCY",
        "efa",
        "C",
        "N13: 68-69 us for a tiny all-reduce between two p5 nodes (derived per step)",
        10e-6,
        "InfiniBand's step",
        ["gpu"],
        module="lab.core.chip",
    ),
    _c(
        "fabric.tcpx",
        "FABRIC_STEP_LATENCY",
        "tcpx",
        "C",
        "taken as EFA's (no measurement of GPUDirect-TCPX)",
        10e-6,
        "InfiniBand's step",
        ["gpu"],
        module="lab.core.chip",
    ),
    _c(
        "collective.gpu.other",
        "COLLECTIVE_FRACTION",
        "gpu",
        "C",
        "assumed for an unmeasured GPU",
        0.7,
        "lower",
        ["gpu"],
    ),
    _c("collective.cpu", "COLLECTIVE_FRACTION", "cpu", "C", "a host's calibration replaces it", 0.8, "lower", ["cpu"]),
    _c(
        "overlap.gpu",
        "OVERLAP_SLOWDOWN",
        "gpu",
        "A",
        "Li et al. 2025 (A100, H100): mean 18.9%",
        0.40,
        "the same study's maximum",
        ["gpu"],
    ),
    _c(
        "overlap.tpu",
        "OVERLAP_SLOWDOWN",
        "tpu",
        "C",
        "assumed none: collectives move by DMA engines",
        0.10,
        "a tenth (HBM shared with the DMAs)",
        ["tpu"],
    ),
    _c("overlap.cpu", "OVERLAP_SLOWDOWN", "cpu", "C", "assumed none", 0.10, "a tenth", ["cpu"]),
    # ----- host links, for offloaded activations (§3, H8) -----
    _c("host.a100", "HOST_LINK", "a100", "A", "H8 (A100 H2D)", 6.3e9, "H8's D2H, the anomaly", ["a100"]),
    _c("host.h100", "HOST_LINK", "h100", "A", "H8", 4.1e10, "80% of it", ["h100"]),
    _c("host.h200", "HOST_LINK", "h200", "A", "H8", 4.4e10, "80% of it", ["h200"]),
    _c("host.b200", "HOST_LINK", "b200", "B", "PCIe Gen5 spec at H200's measured share", 4.4e10, "80%", ["b200"]),
    _c("host.tpu-v6e", "HOST_LINK", "tpu-v6e", "B", "the scaling book's PCIe per chip", 1.6e10, "v5e's", ["tpu-v6e"]),
    _c("host.gpu.other", "HOST_LINK_OTHER", "gpu", "B", "A100's measured rate", 1.6e10, "lower", ["gpu"]),
    _c("host.tpu", "HOST_LINK_OTHER", "tpu", "B", "the scaling book's PCIe per chip", 8e9, "half", ["tpu"]),
    _c("host.cpu", "HOST_LINK_OTHER", "cpu", "C", "a memory copy on the host", 5e9, "half", ["cpu"]),
    # ----- fixed costs of a decode step (§5) -----
    _c("decode.graph_node_s", "GRAPH_NODE_S", None, "C", "O2 (GPU not named)", 3.3e-6, "O2 without graphs", ["gpu"]),
    _c(
        "decode.small_kernel_s",
        "SMALL_KERNEL_S",
        None,
        "B",
        "O3 (H100), carried to every GPU",
        3.0e-6,
        "twice O3",
        ["gpu"],
    ),
    _c("decode.kernels_per_layer", "DECODE_KERNELS_PER_LAYER", None, "C", "a count", 20, "unfused ops", ["gpu"]),
    _c(
        "decode.small_kernels_per_layer", "DECODE_SMALL_KERNELS_PER_LAYER", None, "C", "a count", 12, "unfused", ["gpu"]
    ),
    # the serving stacks' own tensor-parallel all-reduce, a call's fixed cost (microbenchmarks-added.md §8c)
    *(
        _c(f"decode.allreduce.{f}", "CUSTOM_ALLREDUCE_S", f, grade, source, alt, why, [f], module=_AR)
        for f, grade, source, alt, why in (
            ("a100", "A", "AR1", 10.4e-6, "x2.1, as AR2's kernel timed without a graph"),
            ("h100", "A", "AR1", 10.0e-6, "AR2, no graph"),
            ("h200", "A", "AR1", 10.0e-6, "AR2 (H100), no graph"),
            ("b200", "B", "H100's AR1", 5.2e-6, "A100's"),
            ("mi300x", "B", "H100's AR1", 3e-6, "AR6 (MI325X, claimed)"),
        )
    ),
    _c("decode.allreduce_wait_s", "ARRIVAL_WAIT_S", None, "C", "none priced", 31.6e-6, "AR10", ["gpu"], module=_AR),
    _c("decode.fused_moe.a100", "FUSED_MOE_FIXED_S", "a100", "C", "M3 fitted", 0.0, "none", ["a100"]),
    _c("decode.fused_moe.gpu", "FUSED_MOE_FIXED_S", "gpu", "C", "M4-M5 fitted", 50e-6, "A100's (M3)", ["gpu"]),
    # PyTorch eager generate's host (microbenchmarks-added.md §3b)
    _c("decode.eager_host_per_layer", "EAGER_HOST_S_PER_LAYER", None, "B", "E1", 0.76e-3, "1.5x slower", ["gpu"]),
    _c("decode.eager_host_per_step", "EAGER_HOST_S_PER_STEP", None, "B", "E1", 1.64e-3, "1.5x slower", ["gpu"]),
    _c("decode.eager_kernels_per_layer", "EAGER_KERNELS_PER_LAYER", None, "A", "E2 (counted)", 48, "+20%", ["gpu"]),
    _c("decode.eager_kernels_per_step", "EAGER_KERNELS_PER_STEP", None, "A", "E2 (counted)", 76, "+20%", ["gpu"]),
    _c(
        "decode.eager_kv_passes", "EAGER_KV_PASSES", None, "A", "DynamicCache's torch.cat", 1.0, "static cache", ["gpu"]
    ),
    _c("decode.cuda_launch_s", "CUDA_LAUNCH_S", None, "C", "O1 (a consumer GPU)", 6.4e-6, "O1 with a sync", ["gpu"]),
    _c(
        "decode.tpu_dispatch_s", "TPU_STEP_DISPATCH_S", None, "C", "O4 (a timed v5e call)", 30e-6, "O5: jitted", ["tpu"]
    ),
    _c(
        "decode.fp8_vs_bf16",
        "FP8_DECODE_TIME_VS_BF16",
        None,
        "C",
        "vLLM PR benchmarks (M = 1..128)",
        0.51,
        "the static-scale ratio",
        ["gpu"],
    ),
    # ----- the training step's memory-bound ops as eager PyTorch runs them (lab.predict.training.estimate) -----
    _c(
        "eager.norm_bytes",
        "NORM_BYTES",
        "eager",
        "C",
        "counted from the reference LLaMA code",
        20.0,
        "partly fused",
        module=_T,
    ),
    _c(
        "eager.rope_bytes",
        "ROPE_BYTES",
        "eager",
        "C",
        "counted from the reference LLaMA code",
        12.0,
        "partly fused",
        module=_T,
    ),
    _c(
        "eager.swiglu_bytes",
        "SWIGLU_BYTES",
        "eager",
        "C",
        "counted from the reference LLaMA code",
        6.0,
        "fused",
        module=_T,
    ),
)

# Tables of efficiency.py that are measurements kept whole, not constants a swap could question: the nccl-tests size
# sweeps (C1, C3, C4; grade A) and what derives from them, and names of kinds and modes.
NOT_CONSTANTS = (
    "ATTENTION_REFERENCE_TOKENS",
    "_BUSBW_GBPS",
    "NVLINK_SWEEP",
    "_SWEEP_TIMES",
    "_DOUBLINGS",
    "SWEEP_GPUS",
    "RAMPED_KINDS",
    "FP8_SCALINGS",
    "_FAMILIES",
)

BY_NAME = {c.name: c for c in CONSTANTS}


def get(name: str) -> Constant:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown constant {name!r}; valid: {', '.join(BY_NAME)}") from None


def uncertain(family: str | None = None, kind: str | None = None, what: str | None = None) -> list[Constant]:
    """The B and C constants (those touching ``family`` / ``kind``, and entering ``what``: ``training`` or
    ``serving``, when given)."""
    out = [c for c in CONSTANTS if c.grade != "A" and (what is None or what in c.prices)]
    if family is None:
        return out
    return [c for c in out if c.touches(family, kind or "")]


def _set(c: Constant, value: object) -> None:
    mod = importlib.import_module(c.module)
    if c.key is None:
        setattr(mod, c.attr, value)
    else:
        getattr(mod, c.attr)[c.key] = value


def _forget() -> None:
    from lab.predict.training import step as training_step

    training_step.forget_prices()  # collectives priced with the old constant


@contextlib.contextmanager
def swapped(*names: str, values: dict[str, float] | None = None):
    """Put each named constant's alternative (or ``values[name]``) in place for the block, then restore it."""
    held = [(get(n), get(n).value) for n in names]
    try:
        for c, _ in held:
            _set(c, (values or {}).get(c.name, c.alternative))
        _forget()
        yield
    finally:
        for c, old in reversed(held):
            _set(c, old)
        _forget()


__all__ = ["BY_NAME", "CONSTANTS", "GRADES", "NOT_CONSTANTS", "Constant", "get", "swapped", "uncertain"]
