"""Serving under load, predicted: the scheduler of :mod:`lab.core.serving` run on the inference estimator's prices.

Each step the scheduler forms (decodes and prefill chunks of every running request, one token budget) is priced as
one forward pass of a replica (``tp x ep`` chips), from the same terms as :func:`lab.predict.inference.estimate.
decode_step`, so a step of ``b`` decodes at context ``c`` costs exactly what ``infer estimate`` says for batch ``b``:

``step = fixed + max(weight reads, matmul and attention FLOPs at the row tile of its tokens) + KV reads + collectives``

* the weights are read once a step, whatever its tokens; the matmuls' rows are all of its tokens (decodes and chunk
  tokens together: Sarathi's piggybacking, microbenchmarks-added.md S7); logits only for the rows that sample;
* attention reads each sequence's cache up to the chunk's end once and computes every chunk token against the
  positions before it (causal inside the chunk);
* the collectives are the tensor-parallel AllReduces (and EP AllToAlls) over the step's tokens;
* ``fixed`` is the decode kernels' launch cost (efficiency.decode_kernel_overhead) plus ``step_overhead_s``, the
  serving stack's host work per step that the device does not hide (S1-S5; 0 by default, the device alone).

The KV pool of a replica is what is left of ``MEMORY_UTILIZATION`` of its HBM after the weights (vLLM's
``gpu_memory_utilization``), in pages of the scheduler's page size. Replicas (``dp``) step together, as the
executed engine's SPMD program does; a step costs its slowest replica's price.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab.core.errors import UserError
from lab.core.serving import Lengths, PoolConfig, Request, Served, Step, drive, poisson_requests, summarize
from lab.predict import efficiency as eff
from lab.predict.inference.allreduce import comm_time
from lab.predict.inference.estimate import InferConfig, check_infer, comms, fused_moe_layers, step_weight_bytes
from lab.predict.inference.holdings import kv_shards, pool_split, weight_bytes_per_chip
from lab.predict.inference.rates import flop_time, matmul_shape_factor, mem_time

# vLLM's default gpu_memory_utilization: weights, activations and the KV pool share 90% of each chip's memory.
MEMORY_UTILIZATION = 0.9
SLO_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
SLO_METRICS = ("ttft", "tpot", "e2e")


class StepPricer:
    """Seconds of one scheduler step on a replica of ``cfg`` (module docstring). Terms that depend only on the step's
    token count are cached: a simulated load prices tens of thousands of steps."""

    def __init__(self, cfg: InferConfig):
        check_infer(cfg)
        self.cfg = cfg = dataclasses.replace(cfg, dp=1, batch=1, achievable=True)
        m, chip = cfg.model, cfg.chip
        par = cfg.tp * cfg.ep
        self.mm_per_token = m.matmul_flops_per_token(include_logits=False) / par
        self.logits_per_row = 2.0 * m.d_model * m.vocab / par
        self.att_per_pair = m.attention_flops_per_token(1, causal=False) / par  # per (query token, cached position)
        self.kv_per_token = m.kv_bytes_per_token(cfg.kv) / cfg.ep
        self.fixed = eff.decode_kernel_overhead(chip, m.layers, fused_moe_layers(cfg)) + cfg.step_overhead_s
        self.row_tile = eff.decode_row_tile(chip, cfg)
        self.shape = matmul_shape_factor(cfg.model, cfg.chip, cfg.tp)
        self._per_tokens: dict[tuple[int, int], tuple[float, float, float, float]] = {}

    def _terms(self, tokens: int, seqs: int) -> tuple[float, float, float, float]:
        """(seconds per FLOP at this row count, weight-read seconds, collective seconds, KV seconds per byte)."""
        key = (tokens, seqs)
        hit = self._per_tokens.get(key)
        if hit is not None:
            return hit
        cfg, m, chip = self.cfg, self.cfg.model, self.cfg.chip
        spf = flop_time(chip, 1.0, cfg.compute, True, tokens, self.row_tile, self.shape)
        wbytes = step_weight_bytes(cfg, tokens)
        weights_s = eff.decode_weights_time(chip, wbytes, cfg.weights, cfg.compute, cfg.fp8_scaling)
        comm_s = sum(calls * comm_time(cfg, k, b, g, True)[0] for k, b, calls, g, _ in comms(cfg, tokens))
        kv_spb = mem_time(chip, 1.0, True) / kv_shards(m, cfg.tp, seqs / cfg.ep, cfg.attention_dp)
        hit = self._per_tokens[key] = (spf, weights_s, comm_s, kv_spb)
        return hit

    def step_s(self, step: Step) -> float:
        tokens = reads = pairs = samples = 0
        m = self.cfg.model
        for _, start, count, sampled in step.work:
            tokens += count
            samples += sampled
            if m.window_layers:  # a windowed layer reads, and attends to, its last sliding_window positions only
                reads += m.attended(start + count) / m.layers
                pairs += m.attended_span(start, count) / m.layers
                continue
            reads += start + count
            pairs += count * start + count * (count + 1) // 2
        if not tokens:
            return 0.0
        spf, weights_s, comm_s, kv_spb = self._terms(tokens, len(step.work))
        flops = tokens * self.mm_per_token + samples * self.logits_per_row + pairs * self.att_per_pair
        return self.fixed + max(weights_s, flops * spf) + reads * self.kv_per_token * kv_spb + comm_s

    def __call__(self, plan: Sequence[Step]) -> tuple[float, None]:
        return max(self.step_s(s) for s in plan), None

    def steady(self, shapes: Sequence[tuple[int, int, tuple[int, ...]]], k: int) -> list[float]:
        """Seconds of each of ``k`` decode-only steps (lab.core.serving.drive): per replica, ``b`` sequences whose
        first step reads ``reads`` positions, each later step ``b`` more; the slowest replica's, step by step.
        The same sum :meth:`step_s` makes of those steps' work."""
        out = [0.0] * k
        for b, reads, each in shapes:
            if not b:
                continue
            spf, weights_s, comm_s, kv_spb = self._terms(b, b)
            rows = b * (self.mm_per_token + self.logits_per_row)
            kv = self.kv_per_token * kv_spb
            m = self.cfg.model
            for j in range(k):
                at = reads + j * b  # positions read, and (query, position) pairs: one query per sequence
                if m.window_layers:  # a windowed layer reads its last sliding_window positions only
                    at = sum(m.attended(p + j) for p in each) / m.layers
                t = self.fixed + max(weights_s, (rows + at * self.att_per_pair) * spf) + at * kv + comm_s
                if t > out[j]:
                    out[j] = t
        return out


def pool_for(cfg: InferConfig, page_size: int = 16, max_seqs: int = 256, token_budget: int = 2048) -> PoolConfig:
    """A replica's KV pool: ``MEMORY_UTILIZATION`` of its chips' memory less the weights, in pages."""
    m, chip = cfg.model, cfg.chip
    free = chip.hbm_bytes * MEMORY_UTILIZATION - weight_bytes_per_chip(m, cfg.tp, cfg.ep, cfg.weights, cfg.attention_dp)
    per_token = m.kv_bytes_per_token(cfg.kv) / (pool_split(m, cfg.tp, cfg.attention_dp) * cfg.ep)
    pages = int(free // (per_token * page_size)) if free > 0 else 0
    if pages < 1:
        raise UserError(
            f"{m.name}'s weights ({cfg.weights}) leave no room for a KV cache on a replica of {cfg.tp * cfg.ep} x "
            f"{chip.name} (tp={cfg.tp} ep={cfg.ep}); give more chips to --tp, or smaller --weights"
        )
    return PoolConfig(pages=pages, page_size=page_size, max_seqs=max_seqs, token_budget=token_budget)


def simulate(cfg: InferConfig, requests: Sequence[Request], pool: PoolConfig, concurrency: int | None = None) -> Served:
    """Serve ``requests`` on ``cfg.dp`` replicas of ``tp x ep`` chips, each step priced by :class:`StepPricer`."""
    return drive(requests, pool, StepPricer(cfg), replicas=cfg.dp, concurrency=concurrency)


def capacity_rps(cfg: InferConfig, prompt: Lengths, output: Lengths, pool: PoolConfig, n: int, seed: int) -> float:
    """Requests per second the deployment completes when every request is already waiting (saturated)."""
    served = simulate(cfg, poisson_requests(n, math.inf, prompt, output, seed), pool)
    return len(served.seqs) / served.makespan_s


@dataclass(frozen=True)
class Slo:
    """Latency targets at one percentile, e.g. ``ttft=0.5s,tpot=50ms`` at p90."""

    targets: tuple[tuple[str, float], ...]
    percentile: int = 90

    @classmethod
    def parse(cls, text: str, percentile: int = 90) -> Slo:
        targets = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            name = name.strip().lower()
            unit = next((u for u in ("ms", "us", "s") if value.strip().endswith(u)), None)
            number = value.strip()[: -len(unit)] if unit else ""
            try:
                seconds = float(number) * SLO_UNITS[unit] if unit else math.nan
            except ValueError:
                seconds = math.nan
            if name not in SLO_METRICS or not seconds > 0 or math.isinf(seconds):
                raise UserError(
                    f"--slo {part!r} is not METRIC=NUMBER with a unit (s, ms, us) for a metric of "
                    f"{', '.join(SLO_METRICS)}; e.g. --slo ttft=0.5s,tpot=50ms"
                )
            targets.append((name, seconds))
        if not targets:
            raise UserError(f"--slo {text!r} names no target; e.g. --slo ttft=0.5s,tpot=50ms")
        return cls(tuple(targets), percentile)

    def missed(self, summary: dict) -> list[str]:
        """The targets a simulated load's summary misses (a latency it has no value for counts as missed)."""
        key = f"p{self.percentile}"
        return [n for n, t in self.targets if summary[f"{n}_s"][key] is None or summary[f"{n}_s"][key] > t]

    def met(self, summary: dict) -> bool:
        return not self.missed(summary)

    def __str__(self) -> str:
        return ", ".join(f"{n} <= {t:g} s" for n, t in self.targets) + f" at p{self.percentile}"


def max_rate(
    cfg: InferConfig,
    slo: Slo,
    prompt: Lengths,
    output: Lengths,
    pool: PoolConfig,
    n: int,
    seed: int,
    capacity: float,
    steps: int = 12,
) -> float | None:
    """The highest Poisson rate (requests/s, below saturation) whose simulated load meets ``slo``, by bisection;
    None when even a trickle misses it."""

    def meets(rate: float) -> bool:
        served = simulate(cfg, poisson_requests(n, rate, prompt, output, seed), pool)
        return slo.met(summarize(served))

    lo, hi = 0.0, capacity
    if not meets(capacity * 1e-3):
        return None
    lo = capacity * 1e-3
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


__all__ = [
    "MEMORY_UTILIZATION",
    "SLO_METRICS",
    "Slo",
    "StepPricer",
    "capacity_rps",
    "max_rate",
    "pool_for",
    "simulate",
]
