"""Public measured runs the estimators were never fitted to: the second validation group.

Every row is an end-to-end measurement published with its configuration (MLPerf logs and the submitters' config
files, framework blogs, papers), chosen outside the sources reserved for the project's independent check
(``shared/reference/held-out-sources.md``) and outside the calibration set (:mod:`lab.studies.published_runs`).
Nothing here was used to choose a constant: the group exists to say how far off the estimators are on runs
they have not seen. Configuration details a source leaves out are filled with a stated assumption, the same
for every run of its kind (``assumed``), never chosen per run.

A run the estimators cannot express (an uneven pipeline split, LoRA, ...) is listed with ``expressible`` set to
the reason, so that the table counts it instead of dropping it quietly.

Units: seconds per step, tokens per second per chip, seconds per generated token; ``mfu`` as a fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MLPERF_T31 = "MLCommons, MLPerf Training v3.1 results (Nov 2023), github.com/mlcommons/training_results_v3.1"
_MLPERF_T41 = "MLCommons, MLPerf Training v4.1 results (Nov 2024), github.com/mlcommons/training_results_v4.1"
_MLPERF_T50 = "MLCommons, MLPerf Training v5.0 results (Jun 2025), github.com/mlcommons/training_results_v5.0"
_FSDP_BLOG = (
    "Team PyTorch at IBM and Meta, 'Maximizing training throughput using PyTorch FSDP', PyTorch blog (Mar 2024), "
    "Table 1"
)
_XLA_TRAIN = (
    "Tan et al. (Google), 'High-Performance Llama 2 Training and Inference with PyTorch/XLA on Cloud TPUs', "
    "PyTorch blog (Nov 2023), Table 3 and text"
)
_COMPILE_INFER = "IBM Research and Meta, 'PyTorch compile to speed up inference on Llama 2', PyTorch blog (2023)"
_FA_TRAIN = (
    "Dao-AILab/flash-attention, training/README.md, 'Training speed' table (8 x A100 80GB SXM4), with the "
    "experiment configs of training/configs (gpt3s-flash, gpt3xl-flash, gpt3-2.7B-flash-hdim128)"
)
_OLMO_CORE = (
    "allenai/OLMo-core README.md throughput table (the version before commit 9eb8f2f, March 2025; 'tokens per "
    "second per device', H100), with src/scripts/train/Llama3-8B.py"
)
_BLOOM_INFER = (
    "S. Bekman and S. Gugger, 'Incredibly Fast BLOOM Inference with DeepSpeed and Accelerate', Hugging Face blog "
    "(Sep 2022), Benchmarks, 'ds-inference fp16' row (8 x A100 80GB)"
)
# GPT-3-style models with learned positions, biases, LayerNorm and a 4D GeLU MLP, on top of gpt3-175b's options
_GPT_SMALL = {"learned_positions": True, "biases": True, "norm": "layernorm", "gated_mlp": False}
_XLA_INFER = (
    "Mohammadi et al. (Google), 'The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B on PyTorch/XLA', "
    "PyTorch blog (2023), Results"
)

# Assumptions applied to every run of a kind, where its source is silent (never per run).
MEGATRON_FP8 = (
    "Megatron/NeMo with Transformer Engine: fp8 matmuls (attention and logits in bf16), cuDNN fused attention, "
    "sequence parallelism, the distributed optimizer (ZeRO-1 over data parallelism), selective recomputation"
)
FSDP_STACK = "PyTorch FSDP full sharding over every GPU, bf16 with fp32 AdamW state, SDPA flash attention"


@dataclass(frozen=True)
class PublicRun:
    """One measured run and the configuration that produced it.

    Attributes:
        case_id: this project's id (``PT`` training, ``PS`` serving).
        kind: ``training`` or ``serving``.
        chip: the catalog chip; ``chips`` how many.
        model: the catalog model; ``overrides`` replace fields of it (a run's own vocabulary, for one).
        layout: the parallel degrees and options the training estimator takes (``dp fsdp tp pp cp zero
            sequence_parallel pp_schedule interleave``); serving: ``tp`` and the batch.
        measured: what the source measured, in ``unit`` (``s/step``, ``tokens/s/chip``, ``mfu``, ``s/token``).
        expressible: ``None``, or why the estimators cannot express this run (counted, not predicted).
    """

    case_id: str
    kind: str
    chip: str
    chips: int
    model: str
    layout: dict[str, object]
    seq_len: int
    global_batch: int
    microbatch: int
    dtype: str
    remat: str
    measured: float
    unit: str
    source: str
    grade: str
    stack: str
    overrides: dict[str, object] = field(default_factory=dict)
    optimizer: str = "adam"
    assumed: str = ""
    expressible: str | None = None
    note: str = ""
    node_network_gbps: float | None = None  # the cluster's stated inter-node rate per node, if not the catalog's
    attention_kernel: str = "fa2"  # fa3: FlashAttention-3 / cuDNN (Transformer Engine)
    elementwise: str = "fused"  # eager: PyTorch eager norms, rotary embedding and activation (TrainConfig)
    # serving: the source's per-token figure is a whole generate call (tokenize, prefill and every decode step) over
    # the tokens it generated, as its benchmark script states, not the time of one decode step
    per_token_includes_prefill: bool = False

    @property
    def group(self) -> str:
        family = "TPU" if self.chip.startswith("tpu") else "GPU"
        return f"{family} {self.kind}"


_V31_VP = (
    "interleaved, 12 model chunks per stage: the submission's conf/custom.yaml default (its config file sets none)"
)


def _mlperf_gpt3(case, chips, chip, tp, pp, v, mb, gbs, step, source, log, grade="A", note=""):
    dp = chips // (tp * pp)
    layout = {"dp": dp, "tp": tp, "pp": pp, "zero": 1, "sequence_parallel": True}
    if v > 1:
        layout |= {"pp_schedule": "interleaved", "interleave": v}
    return PublicRun(
        case_id=case,
        kind="training",
        chip=chip,
        chips=chips,
        model="gpt3-175b",
        layout=layout,
        seq_len=2048,
        global_batch=gbs,
        microbatch=mb,
        dtype="fp8",
        remat="selective",
        measured=step,
        unit="s/step",
        source=f"{source}, {log} (train_step_timing, median over three runs)",
        grade=grade,
        stack="NVIDIA NeMo/Megatron, Transformer Engine fp8",
        assumed=MEGATRON_FP8,
        note=note,
        attention_kernel="fa3",
    )


TRAINING: tuple[PublicRun, ...] = (
    # v3.1: the config files (config_DGXH100_*x8x*x4x8_mbs1.sh) set TP 4, PP 8 and micro-batch 1 and leave the
    # virtual pipeline to conf/custom.yaml's default, virtual_pipeline_model_parallel_size 12 (96 layers: one a chunk)
    *(
        _mlperf_gpt3(case, chips, "h100", 4, 8, 12, 1, gbs, step, _MLPERF_T31, log, note=_V31_VP)
        for case, chips, gbs, step, log in (
            ("PT01", 512, 2048, 11.052, "NVIDIA/results/eos_n64_ngc23.09_nemo/gpt3"),
            ("PT02", 10752, 2688, 0.930, "NVIDIA/results/eos-dfw_n1344_ngc23.09_nemo/gpt3"),
        )
    ),
    _mlperf_gpt3(
        "PT03", 256, "h100", 4, 8, 6, 2, 2048, 18.378, _MLPERF_T41, "NVIDIA/results/eos_n32_ngc24.09_nemo/gpt3"
    ),
    _mlperf_gpt3("PT04", 512, "h100", 4, 8, 6, 2, 2048, 9.50, _MLPERF_T41, "NVIDIA/results/eos_n64_ngc24.09_nemo/gpt3"),
    _mlperf_gpt3(
        "PT05",
        64,
        "b200",
        4,
        8,
        6,
        2,
        2048,
        36.233,
        _MLPERF_T41,
        "NVIDIA/results/b200_n8_preview_nemo/gpt3",
        note="preview category: pre-release hardware and software",
    ),
    *(
        PublicRun(
            case_id=case,
            kind="training",
            chip=chip,
            chips=chips,
            model="llama3-405b",
            overrides={"vocab": 32768},  # MLPerf swaps in the Mixtral 8x22B tokenizer (the submission's README)
            layout={
                "dp": dp,
                "tp": tp,
                "pp": 8,
                "cp": 2,
                "zero": 1,
                "sequence_parallel": True,
                "pp_schedule": "interleaved",
                "interleave": 8,
                "pp_embedding_slots": True,  # "asymmetric PP for embedding/loss" (the submission's config)
            },
            seq_len=8192,
            global_batch=gbs,
            microbatch=1,
            dtype="fp8",
            remat="selective",
            measured=step,
            unit="s/step",
            source=f"{_MLPERF_T50}, {log} (train_step_time, median)",
            grade="A",
            stack="NVIDIA NeMo/Megatron, Transformer Engine fp8",
            assumed=MEGATRON_FP8,
            attention_kernel="fa3",
        )
        for case, chips, chip, dp, tp, gbs, step, log in (
            ("PT06", 512, "h100", 4, 8, 1152, 55.13, "NVIDIA/results/eos-dfw_n64_ngc25.01_nemo/llama31_405b"),
            ("PT07", 8192, "h100", 64, 8, 1536, 5.18, "NVIDIA/results/eos-dfw_n1024_ngc25.01_nemo/llama31_405b"),
            ("PT08", 512, "h200", 8, 4, 1152, 50.02, "Nebius/results/nebius_soperator_8xH200_n64_ngc25.01_nemo"),
        )
    ),
    *(
        PublicRun(
            case_id=case,
            kind="training",
            chip=chip,
            chips=chips,
            model=model,
            layout={"fsdp": chips},
            seq_len=4096,
            global_batch=2 * chips,
            microbatch=2,
            dtype="bf16",
            remat=remat,
            measured=tokens,
            unit="tokens/s/chip",
            source=_FSDP_BLOG,
            grade="B",
            stack="PyTorch FSDP (IBM fms-fsdp), SDPA FlashAttention-2, eager (torch.compile came later)",
            assumed=FSDP_STACK,
            node_network_gbps=network,  # the blog states 400 Gb/s (A100) and 800 Gb/s (H100) between nodes
            # eager PyTorch: the same team's next post ('Maximizing training throughput using torch.compile and
            # FSDP', PyTorch blog, 2024) adds torch.compile to this code for its next MFU gain
            elementwise="eager",
        )
        for case, chip, chips, model, remat, tokens, network in (
            ("PT09", "a100-80gb", 128, "llama2-7b", "none", 3700.0, 400.0),
            ("PT10", "a100-80gb", 128, "llama2-70b", "full", 370.0, 400.0),
            ("PT11", "h100", 96, "llama2-7b", "none", 7500.0, 800.0),
            ("PT12", "h100", 96, "llama2-70b", "full", 800.0, 800.0),
        )
    ),
    PublicRun(
        case_id="PT13",
        kind="training",
        chip="tpu-v4",
        chips=128,
        model="llama2-70b",
        layout={"fsdp": 32, "tp": 4},
        seq_len=1024,
        global_batch=512,
        microbatch=16,
        dtype="bf16",
        remat="full",
        optimizer="adafactor",
        measured=0.53,
        unit="mfu",
        source=_XLA_TRAIN,
        grade="B",
        stack="PyTorch/XLA SPMD (GSPMD), 2D sharding (32, 4)",
        assumed="sequence length 1024 (the blog's MFU figure is stated at 1024); full rematerialisation; MFU as "
        "6 x parameters per token",
    ),
)

TRAINING += (
    *(
        PublicRun(
            case_id=case,
            kind="training",
            chip="a100-80gb",
            chips=8,
            model="gpt3-175b",
            overrides=dims | {"vocab": 50264, "max_seq_len": 2048},  # GPT-2's 50257 padded to a multiple of 8
            layout={"dp": 8, "zero": 1},
            seq_len=2048,
            global_batch=512,
            microbatch=mb,
            dtype="bf16",
            remat="none",
            measured=tokens / 8,
            unit="tokens/s/chip",
            source=_FA_TRAIN,
            grade="A",
            stack="PyTorch Lightning, FlashAttention, fused dense+GeLU and dropout+add+LayerNorm, apex AdamW (ZeRO-1)",
            assumed="micro-batch from the config's formula for an 80 GB card; the table is not tied to a commit",
            note=f"{tokens:,.0f} tokens/s for the node",
        )
        for case, dims, mb, tokens in (
            (
                "PT14",
                {
                    "name": "gpt3-1.3b",
                    "layers": 24,
                    "d_model": 2048,
                    "heads": 16,
                    "kv_heads": 16,
                    "head_dim": 128,
                    "d_ff": 8192,
                },
                8,
                169e3,
            ),
            (
                "PT15",
                {
                    "name": "gpt3-2.7b",
                    "layers": 32,
                    "d_model": 2560,
                    "heads": 20,
                    "kv_heads": 20,
                    "head_dim": 128,
                    "d_ff": 10240,
                },
                4,
                85e3,
            ),
        )
    ),
    *(
        PublicRun(
            case_id=case,
            kind="training",
            chip="h100",
            chips=64,
            model="llama3-8b",
            overrides={
                "name": "llama3-8b-dolma2",
                "vocab": 100352,
            },  # the dolma2 tokenizer, padded to a multiple of 128
            layout={"dp": 8, "fsdp": 8},  # HSDP: sharded inside a node, replicated across nodes
            seq_len=4096,
            global_batch=1024,
            microbatch=2,
            dtype=dtype,
            remat="none",
            measured=tokens,
            unit="tokens/s/chip",
            source=_OLMO_CORE,
            grade="B",
            stack="PyTorch HSDP (bf16 parameters, fp32 gradient reduction), torch.compile, fused AdamW"
            + (", torchao float8 matmuls" if dtype == "fp8" else ""),
            assumed="8 nodes of 8 H100 SXM (the node count is not stated; HSDP shards inside a node, so the "
            "per-device rate barely depends on it)",
        )
        for case, dtype, tokens in (("PT16", "bf16", 9500.0), ("PT17", "fp8", 12500.0))
    ),
)

SERVING: tuple[PublicRun, ...] = (
    PublicRun(
        case_id="PS01",
        kind="serving",
        chip="a100-80gb",
        chips=8,
        model="llama2-70b",
        layout={"tp": 8, "batch": 1, "prompt": 512, "generated": 50},
        seq_len=562,
        global_batch=1,
        microbatch=1,
        dtype="bf16",
        remat="none",
        measured=0.029,
        unit="s/token",
        source=_COMPILE_INFER,
        grade="B",
        stack="PyTorch torch.compile (CUDA graphs), tensor parallel 8",
        assumed="half precision taken as bf16 weights and KV cache",
    ),
    PublicRun(
        case_id="PS02",
        kind="serving",
        chip="tpu-v4",
        chips=4,
        model="llama2-7b",
        overrides={"kv_heads": 32},
        layout={"tp": 4, "batch": 1, "prompt": 256, "generated": 0},
        seq_len=256,
        global_batch=1,
        microbatch=1,
        dtype="bf16",
        remat="none",
        measured=0.0047,
        unit="s/token",
        source=_XLA_INFER,
        grade="C",
        stack="PyTorch/XLA with TorchDynamo, tensor parallel over the 4 chips",
        assumed="batch 1 (the blog's sizing example; the figure does not state it); a 256-token context",
        note="LLaMA 7B (the first LLaMA; the same dims as Llama 2 7B)",
    ),
    PublicRun(
        case_id="PS03",
        kind="serving",
        chip="tpu-v4",
        chips=16,
        model="llama2-70b",
        overrides={"layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 64, "d_ff": 22016},
        layout={"tp": 16, "batch": 1, "prompt": 256, "generated": 0},
        seq_len=256,
        global_batch=1,
        microbatch=1,
        dtype="bf16",
        remat="none",
        measured=0.0145,
        unit="s/token",
        source=_XLA_INFER,
        grade="C",
        stack="PyTorch/XLA with TorchDynamo, tensor parallel over the 16 chips",
        assumed="batch 1 (as PS02); a 256-token context",
        note="LLaMA 65B: 80 layers, d_model 8192, 64 heads (no GQA), FFN 22016 (Touvron et al. 2023, Table 2)",
    ),
)

SERVING += tuple(
    PublicRun(
        case_id=case,
        kind="serving",
        chip="a100-80gb",
        chips=8,
        model="gpt3-175b",
        overrides=_GPT_SMALL
        | {"layers": 70, "d_model": 14336, "heads": 112, "kv_heads": 112, "head_dim": 128, "d_ff": 57344}
        | {"name": "bloom-176b", "vocab": 250880, "learned_positions": False},  # BLOOM-176B (ALiBi: no position table)
        layout={"tp": 8, "batch": batch, "prompt": 8, "generated": 100},
        seq_len=108,
        global_batch=batch,
        microbatch=batch,
        dtype="bf16",
        remat="none",
        measured=step,
        unit="s/token",
        source=_BLOOM_INFER,
        grade="B",
        stack="DeepSpeed-Inference (kernel injection), tensor parallel 8, greedy generation",
        assumed="fp16 taken as bf16 (the same tensor-core peak and bytes); a prompt of 8 tokens ('just a few')",
        note=f"{step * 1e3:.1f} ms per decode step: the blog's ms per token times the batch; the figure is the "
        "benchmark script's 'Throughput per token including tokenize' (bloom-inference-scripts/bloom-ds-inference.py: "
        "five whole generate() calls, tokenizing included, over the new tokens they made), so the prefill is in it",
        per_token_includes_prefill=True,
    )
    # the whole 'ds-inference fp16' row of the blog's table: ms per token 44.02 / 5.70 / 3.01 / 1.68 / 1.00 / 0.69
    # at batch 1 / 8 / 16 / 32 / 64 / 128 (batch 256 ran out of memory), times the batch
    for case, batch, step in (
        ("PS04", 1, 0.04402),
        ("PS05", 128, 0.0883),
        ("PS06", 8, 0.0456),
        ("PS07", 16, 0.04816),
        ("PS08", 32, 0.05376),
        ("PS09", 64, 0.064),
    )
)

RUNS: tuple[PublicRun, ...] = TRAINING + SERVING

__all__ = ["FSDP_STACK", "MEGATRON_FP8", "RUNS", "SERVING", "TRAINING", "PublicRun"]
