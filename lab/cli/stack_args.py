"""The flags that state a serving stack's own choices and costs, shared by ``infer estimate`` and ``infer serve``,
and the one that asks for the book's ideal roofline instead of the lab's prediction."""

from __future__ import annotations

from lab.cli.args import nonneg_float


def add_step_overhead(parser) -> None:
    """``--step-overhead SECONDS``: what ``infer estimate`` and ``infer serve`` add to each step for the serving
    stack's host work."""
    parser.add_argument(
        "--step-overhead",
        type=nonneg_float("--step-overhead"),
        default=0.0,
        metavar="SECONDS",
        help="the serving stack's host work per decode step that the device does not hide (default 0: the device "
        "alone). Measured: about 0.004 a step in vLLM V0 and 0.002 in SGLang without its overlap scheduler; "
        "0.00015-0.0006 where the engine schedules a step ahead (vLLM V1's asynchronous scheduling, TensorRT-LLM's "
        "PyTorch executor) (docs/reference/microbenchmarks-added.md S1-S17)",
    )


def add_tp_allreduce(parser) -> None:
    """``--tp-allreduce custom|nccl``: the all-reduce ``infer estimate`` and ``infer serve`` price a GPU stack with."""
    parser.add_argument(
        "--tp-allreduce",
        choices=("custom", "nccl"),
        help="on GPUs, under the efficiency model: the tensor-parallel all-reduces as the serving stack runs them: "
        "custom, its own one-shot/two-shot kernel inside an NVLink or xGMI node (vLLM, SGLang, TensorRT-LLM, "
        "LMDeploy; the default where it runs: A100, H100, H200, B200, MI300X), or nccl (PyTorch, DeepSpeed-Inference, "
        "TGI, JAX/XLA) "
        "(docs/reference/microbenchmarks-added.md AR1-AR8)",
    )


def add_attention_dp(parser) -> None:
    """``--attention-dp``: attention data-parallel over the tensor-parallel group (SGLang's --enable-dp-attention)."""
    parser.add_argument(
        "--attention-dp",
        action="store_true",
        help="attention data-parallel over the --tp group, as SGLang's --enable-dp-attention runs it: each GPU holds "
        "the whole attention and only its own requests' KV cache, the MLP or MoE stays tensor-parallel (for MLA models "
        "such as DeepSeek, whose latent cache tensor parallelism keeps whole on every GPU)",
    )


def add_ideal(parser) -> None:
    """``--ideal`` (``args.ideal``): the scaling book's roofline at peak rates instead of the efficiency model, the
    default of every serving estimate; ``--achievable`` names that default (scripts that give it keep working)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--ideal",
        action="store_true",
        help="the scaling book's roofline: peak FLOP/s and bandwidth, no efficiency model; a bound the step does not "
        "beat, printed with the interval of the lab's prediction (the default prices the efficiency model)",
    )
    group.add_argument(
        "--achievable",
        dest="ideal",
        action="store_false",
        help="the efficiency model (measured fractions of peak): the default, named for scripts that give it",
    )
