"""Measure the host's side of a PyTorch eager decode step (Hugging Face transformers' generate), for the inference
estimator's ``eager`` pricing (lab/predict/efficiency.py, EAGER_*).

An eager generate issues every op of every layer from Python through PyTorch's dispatcher, one step at a time, and
syncs once a step (the stopping criteria read the new token). On a GPU whose kernels are shorter than that host work
the GPU waits: the step costs the host's time. This script measures that host work without a GPU, on a LLaMA-shaped
model so small that its CPU kernels cost next to nothing:

* the time of one decode step, from two generate calls of different lengths (their difference over the extra
  tokens: prefill and set-up cancel), for several layer counts: the slope is the host's seconds a layer, the
  intercept its seconds a step (embedding, final norm, output layer, sampling, logits processors, stopping criteria);
* the ATen ops a decode step dispatches per layer and per step (a TorchDispatchMode counts them), of which those that
  would launch a GPU kernel (not views, reshapes or metadata) are what a GPU adds its launch cost to.

Not part of the lab (it needs torch and transformers, which the lab does not install): ``scripts/measure_eager_decode``
runs it in a scratch environment of its own. The figures of its run of 2026-12-03 are in
docs/reference/microbenchmarks-added.md (E1, E2).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

LAYERS = (2, 8, 16, 32)
SHORT, LONG = 8, 40  # new tokens of the two generate calls whose difference times LONG - SHORT decode steps
PROMPT = 64
REPEATS = 7
# ATen ops that launch no kernel on a GPU: views and metadata, allocations, and reads of one value to the host (a copy
# and a sync, not a kernel)
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "expand",
    "transpose",
    "t",
    "permute",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "detach",
    "as_strided",
    "split",
    "split_with_sizes",
    "unsafe_split",
    "unbind",
    "chunk",
    "narrow",
    "diagonal",
    "size",
    "stride",
    "sym_size",
    "is_same_size",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "item",
    "_local_scalar_dense",
    "is_nonzero",
}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def model(layers: int):
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=PROMPT + LONG + 8,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def generate(m, new: int) -> None:
    ids = torch.ones((1, PROMPT), dtype=torch.long)
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


def step_seconds(m) -> float:
    generate(m, SHORT)  # warm-up
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        generate(m, SHORT)
        t1 = time.perf_counter()
        generate(m, LONG)
        t2 = time.perf_counter()
        times.append(((t2 - t1) - (t1 - t0)) / (LONG - SHORT))
    return statistics.median(times)


def ops_per_step(m) -> dict[str, int]:
    counts = []
    for new in (SHORT, LONG):
        with Count() as c:
            generate(m, new)
        counts.append(c.ops)
    names = set(counts[0]) | set(counts[1])
    return {n: round((counts[1].get(n, 0) - counts[0].get(n, 0)) / (LONG - SHORT)) for n in sorted(names)}


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx if n else 0.0


def main() -> int:
    torch.set_num_threads(1)
    steps = {n: step_seconds(model(n)) for n in LAYERS}
    per_layer_s, per_step_s = fit([float(n) for n in LAYERS], list(steps.values()))
    lo, hi = (ops_per_step(model(n)) for n in (LAYERS[0], LAYERS[-1]))
    layer_ops = {k: (hi.get(k, 0) - lo.get(k, 0)) / (LAYERS[-1] - LAYERS[0]) for k in set(lo) | set(hi)}
    layer_ops = {k: v for k, v in sorted(layer_ops.items()) if v}
    step_ops = {k: v - layer_ops.get(k, 0) * LAYERS[0] for k, v in lo.items()}
    kernels = sum(v for k, v in layer_ops.items() if k not in NO_KERNEL)
    step_kernels = sum(v for k, v in step_ops.items() if k not in NO_KERNEL and v > 0)
    print(
        json.dumps(
            {
                "host": platform.processor() or platform.machine(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "step_s_by_layers": {str(k): v for k, v in steps.items()},
                "host_s_per_layer": per_layer_s,
                "host_s_per_step": per_step_s,
                "aten_ops_per_layer": layer_ops,
                "kernel_ops_per_layer": kernels,
                "kernel_ops_per_step_outside_layers": step_kernels,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
