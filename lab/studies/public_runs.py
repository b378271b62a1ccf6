"""The development set: public measured runs looked at while the efficiency model changed (training here, serving in
:mod:`lab.studies.public_serving`).

Every row is an end-to-end measurement published with its configuration (MLPerf logs and the submitters' config
files, framework blogs, papers), chosen outside the sources reserved for the project's independent check
(``shared/reference/held-out-sources.md``) and outside the calibration set (:mod:`lab.studies.published_runs`).
No constant was chosen per run, but the model was changed while this set's mean was watched (its mean went from
18.8% to 10.3% over eleven commits), so its error is in-sample: a development figure, not how well the estimators
predict. That figure is the test split's (:mod:`lab.studies.run_files`), whose runs are committed before the
estimators see them. Configuration details a source leaves out are filled with a stated assumption, the same
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
_FA_TRAIN = (
    "Dao-AILab/flash-attention, training/README.md, 'Training speed' table (8 x A100 80GB SXM4), with the "
    "experiment configs of training/configs (gpt3s-flash, gpt3xl-flash, gpt3-2.7B-flash-hdim128)"
)
_OLMO_CORE = (
    "allenai/OLMo-core README.md throughput table (the version before commit 9eb8f2f, March 2025; 'tokens per "
    "second per device', H100), with src/scripts/train/Llama3-8B.py"
)

# The development set's sources by the start of their citation (public_serving's are added there).
SOURCE_KEYS = {
    _MLPERF_T31: "mlperf-training-v3.1",
    _MLPERF_T41: "mlperf-training-v4.1",
    _MLPERF_T50: "mlperf-training-v5.0",
    _FSDP_BLOG: "pytorch-fsdp-blog-2024",
    _XLA_TRAIN: "pytorch-xla-llama2-2023",
    _FA_TRAIN: "flash-attention-training",
    _OLMO_CORE: "olmo-core-readme",
}

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
    flash_attention: bool = True  # False: attention scores stored and softmaxed apart (before FlashAttention)
    # serving a mixture of experts: the stack streams every expert's weights each step ("all") or the routed ones
    # ("routed": vLLM's and SGLang's fused MoE kernels, microbenchmarks-added.md M1); None: the estimator's default
    moe_weights: str | None = None
    # serving on GPUs: the stack's tensor-parallel all-reduce, "custom" (its own peer-to-peer kernel: vLLM, SGLang,
    # TensorRT-LLM, LMDeploy) or "nccl" (PyTorch, DeepSpeed-Inference, TGI); None: the estimator's default for the chip
    tp_allreduce: str | None = None
    attention_dp: bool = False  # serving: attention data-parallel over the TP group (SGLang's --enable-dp-attention)
    # eager: PyTorch eager execution. Training: unfused norms, rotary embedding and activation (TrainConfig); serving:
    # Hugging Face generate, its ops issued from Python each step (InferConfig.eager)
    elementwise: str = "fused"
    tp_comm_overlap: bool = False  # the run's config sets TP communication overlap (TrainConfig.tp_comm_overlap)
    # serving: the source's per-token figure is a whole generate call (tokenize, prefill and every decode step) over
    # the tokens it generated, as its benchmark script states, not the time of one decode step
    per_token_includes_prefill: bool = False
    # serving: the cache length the figure was taken at: ``mean`` (prompt plus half the generated tokens: a median
    # token, or a whole call's average step) or ``end`` (prompt plus every generated token: a figure logged as the
    # last generated tokens were made)
    context_at: str = "mean"
    kv_dtype: str | None = None  # serving: the KV cache's dtype where it is not ``dtype`` (fp8 weights, bf16 cache)
    # serving under load: which statistic over the requests the figure is (``mean`` or ``median``)
    statistic: str = "mean"
    quote: str = ""  # the figure as the source prints it, and where (table, row, column)
    split: str = "development"  # ``development`` (looked at while the model changed) or ``test`` (never tuned on)
    source_key: str = ""  # one short name a source: the per-source means group by it

    @property
    def group(self) -> str:
        family = "TPU" if self.chip.startswith("tpu") else "GPU"
        return f"{family} {self.kind}"

    @property
    def label(self) -> str:
        """The network's name as the run states it (a catalog model, or the name its overrides give)."""
        return str(self.overrides.get("name", self.model))

    @property
    def source_name(self) -> str:
        """One short name a source (its ``source_key``; the development set's by the citation it starts with)."""
        if self.source_key:
            return self.source_key
        return next((key for prefix, key in SOURCE_KEYS.items() if self.source.startswith(prefix)), self.source[:40])


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
        tp_comm_overlap=True,  # every config file of these submissions: export TP_COMM_OVERLAP=True
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
            tp_comm_overlap=True,  # the config files: export TP_COMM_OVERLAP=True
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

__all__ = ["FSDP_STACK", "MEGATRON_FP8", "SOURCE_KEYS", "TRAINING", "PublicRun"]
