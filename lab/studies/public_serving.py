"""The development set's serving runs: public measured runs looked at while the model changed (in-sample).

The same rules as :mod:`lab.studies.public_runs`: every row is a published end-to-end measurement with its
configuration, outside the sources reserved for the independent check; a detail a source leaves out is a stated
assumption, the same for every run of its source. A source's table is taken whole, or by a rule stated here
before any row was predicted, never row by row:

* **LMDeploy** (TurboMind, A100-80G): the llama2-70b table at TP 4, all 20 rows. The 7B and 13B tables are left
  out: their latencies are printed to 1 ms at 9-20 ms (up to 5% rounding), and their largest batches do not fit
  their (MHA) KV caches, so requests were queued and the stated batch is not what ran. The figure is the median
  per-token latency, a decode step at the median token.
* **SGLang + torch.compile** (PyTorch blog, H100): the bf16 and fp8 columns of the teaser table. The int4 column
  is left out: the table does not say which of the blog's two int4 kernels each of its rows ran.
* **vLLM, DBRX** (PR #3692, H100): the rows of the shipped (tuned) MoE kernel config; the untuned rows measure a
  default the PR replaced.
* **HF transformers generate** (optimum's GPTQ benchmark, A100): the fp16 rows, priced as PyTorch eager generate
  (a host-bound step: InferConfig.eager, measured pieces E1-E2; not expressible before that was built). The GPTQ rows
  are int4 kernels of their own.

Units: seconds per generated token (``s/token``); a throughput figure is turned into a step as batch / tokens/s.
"""

from __future__ import annotations

from lab.studies.public_runs import SOURCE_KEYS, PublicRun

_COMPILE_INFER = "IBM Research and Meta, 'PyTorch compile to speed up inference on Llama 2', PyTorch blog (2023)"
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


def _serving(
    case: str, chip: str, model: str, shape: tuple[int, int, int, int], measured: float, **fields
) -> PublicRun:
    """A serving run of ``shape = (tp, batch, prompt, generated)``: ``tp`` chips (one tensor-parallel replica) serve
    ``batch`` sequences of ``prompt`` tokens and ``generated`` new ones, ``measured`` in seconds per generated token;
    the training fields say one step of that batch."""
    tp, batch, prompt, generated = shape
    return PublicRun(
        case_id=case,
        kind="serving",
        chip=chip,
        chips=tp,
        model=model,
        layout={"tp": tp, "batch": batch, "prompt": prompt, "generated": generated},
        seq_len=prompt + generated,
        global_batch=batch,
        microbatch=batch,
        dtype=fields.pop("dtype", "bf16"),
        remat="none",
        measured=measured,
        unit="s/token",
        **fields,
    )


SERVING: tuple[PublicRun, ...] = (
    _serving(
        "PS01",
        "a100-80gb",
        "llama2-70b",
        (8, 1, 512, 50),
        0.029,
        source=_COMPILE_INFER,
        grade="B",
        stack="PyTorch torch.compile (CUDA graphs), tensor parallel 8",
        assumed="half precision taken as bf16 weights and KV cache",
        tp_allreduce="nccl",  # torch.distributed's all-reduce (microbenchmarks-added.md AR7)
    ),
    _serving(
        "PS02",
        "tpu-v4",
        "llama2-7b",
        (4, 1, 256, 0),
        0.0047,
        overrides={"kv_heads": 32},
        source=_XLA_INFER,
        grade="C",
        stack="PyTorch/XLA with TorchDynamo, tensor parallel over the 4 chips",
        assumed="batch 1 (the blog's sizing example; the figure does not state it); a 256-token context",
        note="LLaMA 7B (the first LLaMA; the same dims as Llama 2 7B)",
    ),
    _serving(
        "PS03",
        "tpu-v4",
        "llama2-70b",
        (16, 1, 256, 0),
        0.0145,
        overrides={"layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 64, "d_ff": 22016},
        source=_XLA_INFER,
        grade="C",
        stack="PyTorch/XLA with TorchDynamo, tensor parallel over the 16 chips",
        assumed="batch 1 (as PS02); a 256-token context",
        note="LLaMA 65B: 80 layers, d_model 8192, 64 heads (no GQA), FFN 22016 (Touvron et al. 2023, Table 2)",
    ),
)

SERVING += tuple(
    _serving(
        case,
        "a100-80gb",
        "gpt3-175b",
        (8, batch, 8, 100),
        step,
        overrides=_GPT_SMALL
        | {"layers": 70, "d_model": 14336, "heads": 112, "kv_heads": 112, "head_dim": 128, "d_ff": 57344}
        | {"name": "bloom-176b", "vocab": 250880, "learned_positions": False},  # BLOOM-176B (ALiBi: no position table)
        source=_BLOOM_INFER,
        grade="B",
        stack="DeepSpeed-Inference (kernel injection), tensor parallel 8, greedy generation",
        tp_allreduce="nccl",  # LinearAllreduce -> torch.distributed (microbenchmarks-added.md AR7)
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

_LMDEPLOY = (
    "InternLM/lmdeploy, docs/en/benchmark/a100_fp16.md (lmdeploy v0.1.0a1, 8 x A100-80G, CUDA 11.8), 'Static "
    "Inference Benchmark', llama2-70b table, column 50%(s); method in docs/en/benchmark/profile_generation.md"
)
# the llama2-70b TP 4 table: (batch, prompt tokens, output tokens, median per-token latency in s)
_LMDEPLOY_70B = (
    (1, 1, 128, 0.029),
    (1, 128, 128, 0.029),
    (1, 128, 2048, 0.031),
    (1, 2048, 128, 0.031),
    (1, 2048, 2048, 0.031),
    (16, 1, 128, 0.030),
    (16, 128, 128, 0.030),
    (16, 128, 2048, 0.033),
    (16, 2048, 128, 0.035),
    (16, 2048, 2048, 0.036),
    (32, 1, 128, 0.032),
    (32, 128, 128, 0.032),
    (32, 128, 2048, 0.036),
    (32, 2048, 128, 0.040),
    (32, 2048, 2048, 0.043),
    (64, 1, 128, 0.037),
    (64, 128, 128, 0.037),
    (64, 128, 2048, 0.043),
    (64, 2048, 128, 0.050),
    (64, 2048, 2048, 0.055),
)
SERVING += tuple(
    _serving(
        f"PS{10 + i:02d}",
        "a100-80gb",
        "llama2-70b",
        (4, batch, prompt, out),
        p50,
        source=_LMDEPLOY,
        grade="B",
        stack="LMDeploy TurboMind (C++ engine), tensor parallel 4, fp16 weights and KV cache",
        assumed="A100-80G taken as the SXM4 part in an NVLink server; fp16 as bf16 (the same peak and bytes); the "
        "median token's latency is one decode step at the prompt plus half the output",
        note=f"batch {batch}, {prompt} in / {out} out: median per-token latency {p50 * 1e3:.0f} ms",
    )
    for i, (batch, prompt, out, p50) in enumerate(_LMDEPLOY_70B)
)

_SGLANG_TORCHAO = (
    "Teams at PyTorch, Mobius Labs and SGLang, 'Accelerating LLM Inference with GemLite, TorchAO and SGLang', "
    "PyTorch blog (Jan 2025), '1. Teaser of Results' and the repro instructions (sglang.bench_offline_throughput, "
    "random 1024 in / 512 out, the last logged decode throughput)"
)
# (case, batch, tp, dtype, decode tokens/s for the whole batch)
_SGLANG_ROWS = (
    ("PS30", 1, 1, "bf16", 131.0),
    ("PS31", 32, 1, "bf16", 2799.0),
    ("PS32", 32, 4, "bf16", 5575.0),
    ("PS33", 1, 1, "fp8", 166.0),
    ("PS34", 32, 1, "fp8", 3586.0),
    ("PS35", 32, 4, "fp8", 6159.0),
)
SERVING += tuple(
    _serving(
        case,
        "h100",
        "llama3-8b",
        (tp, batch, 1024, 512),
        batch / tokens,
        dtype=dtype,
        source=_SGLANG_TORCHAO,
        grade="B",
        stack="SGLang (commit feb2b76) with torch.compile and CUDA graphs, PyTorch 2.5.1, Llama-3.1-8B-Instruct "
        "(TorchNativeLlamaForCausalLM, DTensor tensor parallelism)"
        + (", TorchAO float8 per-row dynamic quantization (fp8 weights and activations)" if dtype == "fp8" else ""),
        assumed="an '8xH100 machine' taken as H100 SXM with NVLink; a 16-bit KV cache (no fp8 KV flag); the last "
        "logged throughput taken at the end of generation (prompt plus every generated token)",
        note=f"{tokens:,.0f} decode tokens/s at batch {batch}, TP {tp}: {batch / tokens * 1e3:.2f} ms a step",
        context_at="end",
        kv_dtype="bf16",
        tp_allreduce="nccl",  # DTensor's tensor parallelism sums with torch.distributed, not SGLang's kernel (AR7)
    )
    for case, batch, tp, dtype, tokens in _SGLANG_ROWS
)

_VLLM_DBRX = (
    "vllm-project/vllm PR #3692, '[Kernel] DBRX Triton MoE kernel H100' (2024-03-28), 'This PR' rows: "
    "benchmarks/benchmark_latency.py --model databricks/dbrx-instruct, average latency of a whole generate call"
)
# DBRX (databricks/dbrx-instruct config.json): 40 layers, d_model 6144, 48 query / 8 KV heads, 16 experts of FFN
# width 10752, 4 per token, vocabulary 100352 (132 B parameters, 36 B active)
_DBRX = {
    "name": "dbrx-132b",
    "layers": 40,
    "d_model": 6144,
    "heads": 48,
    "kv_heads": 8,
    "head_dim": 128,
    "d_ff": 10752,
    "experts": 16,
    "experts_per_token": 4,
    "vocab": 100352,
}
SERVING += tuple(
    _serving(
        case,
        "h100",
        "mixtral-8x7b",
        (tp, batch, 32, 128),
        latency / 128,
        overrides=_DBRX,
        source=_VLLM_DBRX,
        moe_weights="routed",  # vLLM's fused MoE kernel reads the routed experts only (M1)
        grade="C",
        stack="vLLM (about v0.4.0) with CUDA graphs, the Triton fused-MoE kernel at its tuned H100 config, "
        "PagedAttention decode; experts sharded over tensor parallelism",
        assumed="H100 SXM with NVLink; bf16 weights and KV cache; benchmark_latency's defaults of that version "
        "(32 prompt tokens, 128 generated, EOS ignored)",
        note=f"{latency:.3f} s for a whole generate call of batch {batch} at TP {tp}",
        per_token_includes_prefill=True,
    )
    for case, tp, batch, latency in (
        ("PS36", 4, 8, 3.2545747),
        ("PS37", 4, 16, 3.6656158),
        ("PS38", 4, 32, 3.9787695),
        ("PS39", 4, 64, 4.4461446),
        ("PS40", 8, 8, 2.3050595),
        ("PS41", 8, 16, 2.5643419),
        ("PS42", 8, 32, 2.7666698),
        ("PS43", 8, 64, 3.3472836),
    )
)

_OPTIMUM_GPTQ = (
    "huggingface/optimum, tests/benchmark/README.md, 'GPTQ benchmark: Generation benchmark results' (single "
    "A100-SXM4-80GB; benchmark_gptq.py), the fp16 rows (gptq False)"
)
SERVING += tuple(
    _serving(
        case,
        "a100-80gb",
        "llama2-13b",
        (1, batch, 512, 512),
        ms / 1e3,
        source=_OPTIMUM_GPTQ,
        grade="B",
        stack="HF transformers generate in eager PyTorch (no CUDA graphs, no torch.compile), fp16",
        assumed="fp16 as bf16",
        note=f"{ms} ms per token over whole generate calls of 512 new tokens (the prefill included)",
        per_token_includes_prefill=True,
        elementwise="eager",  # Hugging Face generate: each step's host work priced (InferConfig.eager, E1-E2)
    )
    for case, batch, ms in (
        ("PS44", 1, 36.958),
        ("PS45", 2, 37.35),
        ("PS46", 4, 37.89),
        ("PS47", 8, 47.37),
        ("PS48", 16, 69.94),
    )
)

SOURCE_KEYS.update(
    {
        _COMPILE_INFER: "pytorch-compile-llama2-2023",
        _BLOOM_INFER: "hf-bloom-ds-inference-2022",
        _XLA_INFER: "pytorch-xla-llama65b-2023",
        _LMDEPLOY: "lmdeploy-docs",
        _SGLANG_TORCHAO: "pytorch-gemlite-sglang-2025",
        _VLLM_DBRX: "vllm-pr-3692",
        _OPTIMUM_GPTQ: "optimum-gptq-benchmark",
    }
)

__all__ = ["SERVING"]
