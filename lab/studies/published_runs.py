"""Published Megatron-LM training measurements on A100, kept as plain data for calibrating the estimator.

Two papers supply every row. The first is Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198). Its Tables 3-5 and Figures 1 and 7 are here. The second is
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(arXiv 2104.04473). Its Table 1 and two training-time examples are here. The values are transcribed from the
papers as summarised in the project's reference notes (shared/reference/published-training-runs.md). The
case ids are the ids those notes use.

Units: times in seconds (per iteration) or milliseconds (per layer); memory in GiB; parameter and token
counts are absolute numbers; ``mfu``/``hfu`` are fractions; percentages are in percent (0-100); throughput in
TFLOP/s per GPU and aggregate PFLOP/s. Nothing here is computed: formulas that use these numbers live
elsewhere.
"""

from dataclasses import dataclass

# Dense fp16/bf16 tensor-core peak of an NVIDIA A100, in FLOP/s. Both papers use this figure: Korthikanti
# et al. 2022 (arXiv 2205.05198) §6.3 for MFU/HFU, and Narayanan et al. 2021 (arXiv 2104.04473) for "% of
# peak". It is not the 2x "with sparsity" number on NVIDIA's datasheet.
A100_PEAK_FLOPS = 312e12

_KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198)"
_NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473)"
_CALCULON_DIGITISED = "digitised in calculon-ai/calculon, calculon/llm/validation.py"


@dataclass(frozen=True)
class MegatronConfig:
    """One model/parallelism configuration (Korthikanti Table 3 or Narayanan Table 1)."""

    case_id: str
    model: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int  # sequences per iteration
    microbatch: int | None  # None where the paper does not list it
    interleave: int  # virtual pipeline stages per GPU (m); 1 means the non-interleaved schedule
    seq_len: int
    vocab: int
    params_published: float  # the paper's parameter count, absolute
    source: str


@dataclass(frozen=True)
class IterationTime:
    """End-to-end time of one training iteration (Korthikanti Table 5)."""

    case_id: str
    config_id: str
    recompute: str  # "full" | "selective"
    sequence_parallel: bool
    t_iter_s: float
    mfu: float | None  # fraction of A100_PEAK_FLOPS; given only for the SP + selective runs
    hfu: float | None
    source: str


@dataclass(frozen=True)
class LayerTime:
    """Forward/backward time of a single transformer layer (Korthikanti Table 4, 22B model)."""

    case_id: str
    config_id: str
    recompute: str  # "none" | "full" | "selective"
    sequence_parallel: bool
    forward_ms: float
    backward_ms: float
    combined_ms: float
    source: str


@dataclass(frozen=True)
class ActivationMemory:
    """Memory per GPU, read off Korthikanti Figure 1."""

    case_id: str
    config_id: str
    state_gib: float  # weights + gradients + optimizer state
    activations_none_gib: float  # tensor parallelism only, no recompute
    activations_sp_selective_gib: float  # sequence parallelism + selective recompute
    source: str


@dataclass(frozen=True)
class ActivationRatio:
    """Activation memory relative to the TP-only baseline, in percent (Korthikanti Figure 7)."""

    case_id: str
    config_id: str
    sp: float
    selective: float
    sp_selective: float
    full: float
    source: str


@dataclass(frozen=True)
class Throughput:
    """Achieved throughput in the weak-scaling study (Narayanan Table 1)."""

    case_id: str
    config_id: str
    tflops_per_gpu: float  # TFLOP/s per GPU
    percent_peak: float  # percent of A100_PEAK_FLOPS, 0-100
    aggregate_pflops: float  # PFLOP/s over all GPUs
    source: str


@dataclass(frozen=True)
class TrainingDays:
    """A worked end-to-end training-time estimate from Narayanan et al. 2021."""

    case_id: str
    model: str
    params: float
    tokens: float
    gpus: int
    tflops_per_gpu: float  # assumed TFLOP/s per GPU
    days: float
    source: str


# --- Korthikanti et al. 2022 -------------------------------------------------------------------------------

_KT3 = f"{_KORTHIKANTI}, Table 3"

# Narayanan Table 1 lists neither the microbatch nor the number of interleaved chunks, so its rows carry
# microbatch=None and interleave=1. The paper's setup does use the interleaved schedule, so treat interleave=1
# there as "unknown", not as a measured non-interleaved run.
_NT1 = f"{_NARAYANAN}, Table 1"

MEGATRON_CONFIGS: tuple[MegatronConfig, ...] = (
    MegatronConfig("KT3-22B", "megatron-22b", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 2048, 51200, 22.07e9, _KT3),
    MegatronConfig("KT3-175B", "megatron-175b", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 2048, 51200, 174.6e9, _KT3),
    MegatronConfig("KT3-530B", "megatron-530b", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 2048, 51200, 529.6e9, _KT3),
    MegatronConfig("KT3-1T", "megatron-1t", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 2048, 51200, 1008e9, _KT3),
    # --- Narayanan et al. 2021, weak-scaling series ---
    MegatronConfig("NT1-01", "megatron-1.7b", 24, 2304, 24, 1, 1, 32, 512, None, 1, 2048, 51200, 1.7e9, _NT1),
    MegatronConfig("NT1-02", "megatron-3.6b", 32, 3072, 30, 2, 1, 64, 512, None, 1, 2048, 51200, 3.6e9, _NT1),
    MegatronConfig("NT1-03", "megatron-7.5b", 32, 4096, 36, 4, 1, 128, 512, None, 1, 2048, 51200, 7.5e9, _NT1),
    MegatronConfig("NT1-04", "megatron-18.4b", 48, 6144, 40, 8, 1, 256, 1024, None, 1, 2048, 51200, 18.4e9, _NT1),
    MegatronConfig("NT1-05", "megatron-39.1b", 64, 8192, 48, 8, 2, 512, 1536, None, 1, 2048, 51200, 39.1e9, _NT1),
    MegatronConfig("NT1-06", "megatron-76.1b", 80, 10240, 60, 8, 4, 1024, 1792, None, 1, 2048, 51200, 76.1e9, _NT1),
    MegatronConfig("NT1-07", "megatron-145.6b", 96, 12288, 80, 8, 8, 1536, 2304, None, 1, 2048, 51200, 145.6e9, _NT1),
    MegatronConfig("NT1-08", "megatron-310.1b", 128, 16384, 96, 8, 16, 1920, 2160, None, 1, 2048, 51200, 310.1e9, _NT1),
    MegatronConfig("NT1-09", "megatron-530b", 128, 20480, 105, 8, 35, 2520, 2520, None, 1, 2048, 51200, 529.6e9, _NT1),
    MegatronConfig("NT1-10", "megatron-1t", 160, 25600, 128, 8, 64, 3072, 3072, None, 1, 2048, 51200, 1008.0e9, _NT1),
)

_KT5 = f"{_KORTHIKANTI}, Table 5"

# Each KT5 case id covers one model and appears twice: the "full" column (full recompute, no sequence
# parallelism) and the "present" column (sequence parallelism + selective recompute). (case_id, recompute)
# is unique.
ITERATION_TIMES: tuple[IterationTime, ...] = (
    IterationTime("KT5-22B", "KT3-22B", "full", False, 1.42, None, None, _KT5),
    IterationTime("KT5-22B", "KT3-22B", "selective", True, 1.10, 0.415, 0.437, _KT5),
    IterationTime("KT5-175B", "KT3-175B", "full", False, 18.13, None, None, _KT5),
    IterationTime("KT5-175B", "KT3-175B", "selective", True, 13.75, 0.514, 0.528, _KT5),
    IterationTime("KT5-530B", "KT3-530B", "full", False, 49.05, None, None, _KT5),
    IterationTime("KT5-530B", "KT3-530B", "selective", True, 37.83, 0.560, 0.570, _KT5),
    IterationTime("KT5-1T", "KT3-1T", "full", False, 94.42, None, None, _KT5),
    IterationTime("KT5-1T", "KT3-1T", "selective", True, 71.49, 0.563, 0.570, _KT5),
)

_KT4 = f"{_KORTHIKANTI}, Table 4"

LAYER_TIMES: tuple[LayerTime, ...] = (
    LayerTime("KT4-1", "KT3-22B", "none", False, 7.7, 11.9, 19.6, _KT4),
    LayerTime("KT4-2", "KT3-22B", "none", True, 7.2, 11.8, 19.0, _KT4),
    LayerTime("KT4-3", "KT3-22B", "full", False, 7.7, 19.5, 27.2, _KT4),
    LayerTime("KT4-4", "KT3-22B", "selective", False, 7.7, 13.2, 20.9, _KT4),
    LayerTime("KT4-5", "KT3-22B", "selective", True, 7.2, 13.1, 20.3, _KT4),
)

_KF1 = f"{_KORTHIKANTI}, Figure 1 ({_CALCULON_DIGITISED})"

ACTIVATION_MEMORY: tuple[ActivationMemory, ...] = (
    ActivationMemory("KF1-22B", "KT3-22B", 45.56, 59.25, 9.5625, _KF1),
    ActivationMemory("KF1-175B", "KT3-175B", 45.56, 66.84, 12.35, _KF1),
    ActivationMemory("KF1-530B", "KT3-530B", 31.64, 114.02, 23.08, _KF1),
    ActivationMemory("KF1-1T", "KT3-1T", 32.96, 131.25, 26.56, _KF1),
)

_KF7 = f"{_KORTHIKANTI}, Figure 7 ({_CALCULON_DIGITISED})"

# Values read off the figure, not the closed-form ratios.
ACTIVATION_RATIOS: tuple[ActivationRatio, ...] = (
    ActivationRatio("KF7-22B", "KT3-22B", 66.84, 49.42, 16.18, 7.64, _KF7),
    ActivationRatio("KF7-175B", "KT3-175B", 62.04, 56.53, 18.49, 8.71, _KF7),
    ActivationRatio("KF7-530B", "KT3-530B", 58.31, 62.04, 20.27, 9.42, _KF7),
    ActivationRatio("KF7-1T", "KT3-1T", 58.31, 62.04, 20.27, 9.42, _KF7),
)

# --- Narayanan et al. 2021 ---------------------------------------------------------------------------------

THROUGHPUT: tuple[Throughput, ...] = (
    Throughput("NT1-01", "NT1-01", 137.0, 44.0, 4.4, _NT1),
    Throughput("NT1-02", "NT1-02", 138.0, 44.0, 8.8, _NT1),
    Throughput("NT1-03", "NT1-03", 142.0, 46.0, 18.2, _NT1),
    Throughput("NT1-04", "NT1-04", 135.0, 43.0, 34.6, _NT1),
    Throughput("NT1-05", "NT1-05", 138.0, 44.0, 70.8, _NT1),
    Throughput("NT1-06", "NT1-06", 140.0, 45.0, 143.8, _NT1),
    Throughput("NT1-07", "NT1-07", 148.0, 47.0, 227.1, _NT1),
    Throughput("NT1-08", "NT1-08", 155.0, 50.0, 297.4, _NT1),
    Throughput("NT1-09", "NT1-09", 163.0, 52.0, 410.2, _NT1),
    Throughput("NT1-10", "NT1-10", 163.0, 52.0, 502.0, _NT1),
)

_NTT = f"{_NARAYANAN}, end-to-end training-time estimate (Eq. 4)"

TRAINING_DAYS: tuple[TrainingDays, ...] = (
    TrainingDays("NTT-1", "gpt3-175b", 175e9, 300e9, 1024, 140.0, 34.0, _NTT),
    TrainingDays("NTT-2", "megatron-1t", 1e12, 450e9, 3072, 163.0, 84.0, _NTT),
)
