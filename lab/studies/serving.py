"""Serving studies on :mod:`lab.predict.inference.estimate`: the latency/throughput sweep, minimum topologies,
disaggregation.

Three questions the scaling book's applied-inference chapter works by hand for LLaMA-3 70B on TPU v5e:

* :func:`sweep` evaluates every (topology, batch) that fits and keeps the Pareto frontier of per-token
  latency (one decode step) against per-chip throughput, the trade-off the chapter plots. A topology is
  pure tensor parallelism over its chips (the chapter's "model parallelism"; data parallelism only
  replicates the weights), skipped when ``tp`` does not divide the attention heads.
* :func:`topology` is the chapter's smallest-slice table: for each weight precision (the KV cache in the
  same precision) the fewest chips whose HBM holds the parameters, rounded up to a slice the hardware
  actually offers, and how many ``context``-token caches the rest of that slice holds.
* :func:`disaggregate` is the prefill:decode server ratio that keeps both pools saturated.

Everything is analytic (no JAX); the numbers come from :func:`lab.predict.inference.estimate.estimate_inference`.
"""
# Over 500 lines on purpose: the three serving studies of the book's inference chapter share one sweep and one table.

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip, default_catalog, scale_chip
from lab.core.models import ModelConfig, resolve_model
from lab.core.paths import chart_metadata
from lab.core.schema import Field, check_value
from lab.core.table import render
from lab.core.units import canonical_dtype, dtype_bytes, fmt_bytes
from lab.predict.inference.estimate import (
    WEIGHT_DTYPES,
    estimate_inference,
    max_replica_batch,
)
from lab.predict.inference.from_plan import infer_config, serving_plan
from lab.predict.inference.holdings import kv_bytes_per_sequence, weight_bytes_per_chip

# Default topologies: the chip counts a slice or a set of NVLink nodes is commonly rented in.
GPU_CHIPS = (1, 2, 4, 8, 16, 32, 64)
TPU_CHIPS = (1, 4, 8, 16, 32, 64, 128, 256)
# Default batches: powers of two, plus each topology's largest batch that fits.
BATCHES = tuple(2**i for i in range(11))  # 1 .. 1024
TOPOLOGY_DTYPES = ("bf16", "fp8", "int8", "int4")
MAX_SLICE_CHIPS = 2**20  # the largest slice `topology` looks for: beyond any deployment


# ----- shared input handling -------------------------------------------------------------------


def _chip(hardware: str | Chip, hardware_file: str | os.PathLike | None, scale: str | None) -> Chip:
    chip = hardware if isinstance(hardware, Chip) else default_catalog(hardware_file).get(hardware)
    return scale_chip(chip, scale) if scale else chip


def _model(model: str | ModelConfig) -> ModelConfig:
    return model if isinstance(model, ModelConfig) else resolve_model(model)


def _positive_int(name: str, value: Any) -> int:
    """``value`` when it is a positive integer below 2**63 (the schema's ``int+``), else a UserError naming it."""
    try:
        return check_value(value, Field("int+"))
    except ValueError as exc:
        raise UserError(f"--{name} must be {exc}, got {value!r}") from None


def _storage_dtype(name: str, value: str) -> str:
    dt = canonical_dtype(value)
    if dt not in WEIGHT_DTYPES:
        raise UserError(f"--{name} {dt} is not one of {', '.join(WEIGHT_DTYPES)}")
    return dt


def _positive_ints(name: str, values: Any) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise UserError(f"--{name} must be a list of positive integers, got {values!r}") from None
    if not out:
        raise UserError(f"--{name} needs at least one value, e.g. 1,2,4,8")
    return tuple(sorted({_positive_int(name, v) for v in out}))


# ----- the latency / throughput sweep ------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """One (topology, batch) of a sweep; latency is one decode step, i.e. the time per generated token."""

    chips: int
    tp: int
    dp: int
    batch: int
    decode_step_s: float
    tokens_per_s: float
    tokens_per_s_per_chip: float
    cost_per_million_tokens_usd: float | None
    bound: str
    fits: bool
    pareto: bool


# Throughputs per chip within this fraction of each other are a tie: the model's figures are not finer, and a
# point 7% slower for 0.03% more tokens/s/chip (a larger batch on saturated KV reads) is not a choice to offer.
TIE = 0.005


def _dominates(a: SweepPoint, b: SweepPoint) -> bool:
    """``a`` is at least as fast and (within :data:`TIE`) as productive per chip as ``b``, and strictly better
    in one."""
    no_worse = a.decode_step_s <= b.decode_step_s and a.tokens_per_s_per_chip >= b.tokens_per_s_per_chip * (1 - TIE)
    better = a.decode_step_s < b.decode_step_s or a.tokens_per_s_per_chip > b.tokens_per_s_per_chip
    return no_worse and better


def pareto_front(points: tuple[SweepPoint, ...] | list[SweepPoint]) -> list[bool]:
    """For each point, whether no other point dominates it (lower latency and higher tokens/s/chip)."""
    return [not any(_dominates(q, p) for q in points if q is not p) for p in points]


@dataclass(frozen=True)
class Sweep:
    """Every fitting (topology, batch) of one model on one chip, with the latency/throughput frontier."""

    model: str
    hardware: str
    context: int
    weights: str
    kv: str
    points: tuple[SweepPoint, ...]
    achievable: bool = False
    skipped: tuple[str, ...] = ()  # topologies left out, with the reason

    def pareto(self) -> tuple[SweepPoint, ...]:
        """The frontier, fastest first: no other point is both faster and more productive per chip."""
        return tuple(sorted((p for p in self.points if p.pareto), key=lambda p: (p.decode_step_s, p.chips)))

    @property
    def topologies(self) -> tuple[tuple[int, int, int], ...]:
        """(chips, tp, dp) of every topology with at least one fitting point, in sweep order."""
        return tuple(dict.fromkeys((p.chips, p.tp, p.dp) for p in self.points))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "context": self.context,
            "weights": self.weights,
            "kv": self.kv,
            "ideal": not self.achievable,
            "latency": "decode_step_s: one decode step, i.e. the time between two tokens of a sequence",
            "points": [dataclasses.asdict(p) for p in self.points],
            "pareto": [dataclasses.asdict(p) for p in self.pareto()],
            "skipped": list(self.skipped),
            "summary": self.summary(),
        }

    def summary(self) -> str:
        front = self.pareto()
        if not front:
            return f"no topology of {self.hardware} holds {self.model} at {self.context} tokens of context"
        fast, best = front[0], front[-1]
        return (
            f"{len(self.points)} fitting points over {len(self.topologies)} topologies; the frontier runs from "
            f"{fast.decode_step_s * 1e3:.2f} ms/token at {fast.tokens_per_s_per_chip:,.0f} tokens/s/chip "
            f"(tp={fast.tp}, batch {fast.batch}) to {best.decode_step_s * 1e3:.2f} ms/token at "
            f"{best.tokens_per_s_per_chip:,.0f} tokens/s/chip (tp={best.tp}, batch {best.batch}): "
            f"x{best.tokens_per_s_per_chip / fast.tokens_per_s_per_chip:.1f} throughput per chip for "
            f"x{best.decode_step_s / fast.decode_step_s:.1f} latency."
        )

    def table(self) -> str:
        rows = [
            [
                p.chips,
                p.tp,
                p.dp,
                p.batch,
                f"{p.decode_step_s * 1e3:.2f}",
                f"{p.tokens_per_s:,.0f}",
                f"{p.tokens_per_s_per_chip:,.1f}",
                "-" if p.cost_per_million_tokens_usd is None else f"{p.cost_per_million_tokens_usd:.3f}",
                p.bound,
            ]
            for p in self.pareto()
        ]
        title = (
            f"Pareto frontier: {self.model} on {self.hardware}, context {self.context}, weights {self.weights}, "
            f"KV {self.kv}, {'achievable efficiency' if self.achievable else 'ideal roofline'}"
        )
        out = render(
            ["chips", "tp", "dp", "batch", "ms/token", "tokens/s", "tokens/s/chip", "$/M tokens", "bound"], rows, title
        )
        out += "\n" + self.summary()
        if self.skipped:
            out += "\nskipped: " + "; ".join(self.skipped)
        return out

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: per-token latency against per-chip throughput, one series per topology, the frontier."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(10, 6.5))
        topologies = self.topologies
        cmap = plt.get_cmap("viridis")
        markers = "osD^vP*Xh<>p"
        for i, (chips, tp, dp) in enumerate(topologies):
            pts = [p for p in self.points if (p.chips, p.tp, p.dp) == (chips, tp, dp)]
            colour = cmap(i / max(1, len(topologies) - 1) * 0.9)
            ax.plot(
                [p.tokens_per_s_per_chip for p in pts],
                [p.decode_step_s * 1e3 for p in pts],
                marker=markers[i % len(markers)],
                ls=":",
                lw=0.8,
                ms=6,
                color=colour,
                label=f"{chips} chips (tp={tp}" + (f", dp={dp})" if dp > 1 else ")"),
            )
        front = self.pareto()
        if front:
            ax.plot(
                [p.tokens_per_s_per_chip for p in front],
                [p.decode_step_s * 1e3 for p in front],
                color="#C44E52",
                lw=2,
                zorder=1,
                label="Pareto frontier",
            )
            for p in front:
                ax.annotate(
                    f"B={p.batch}",
                    (p.tokens_per_s_per_chip, p.decode_step_s * 1e3),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=7,
                    color="#C44E52",
                )
        if self.points:
            xs = [p.tokens_per_s_per_chip for p in self.points]
            ys = [p.decode_step_s for p in self.points]
            ax.set_xscale("log")
            if max(ys) / min(ys) > 10:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no topology fits", transform=ax.transAxes, ha="center")
            xs = []
        ax.set_xlabel("throughput per chip (tokens/s/chip, log scale; higher is cheaper)")
        ax.set_ylabel("per-token latency: one decode step (ms; lower is better)")
        mode = "achievable" if self.achievable else "ideal roofline"
        ax.set_title(
            f"{self.model} on {self.hardware}: latency vs throughput\n"
            f"context {self.context}, weights {self.weights}, KV {self.kv}, pure tensor parallelism, {mode}"
        )
        ax.grid(True, which="both", alpha=0.3)
        if xs:
            ax.legend(fontsize=8, title="topology", loc="upper left")
            ax.set_xlim(min(xs) / 1.5, max(xs) * 1.5)
        fig.tight_layout()
        fig.savefig(path, dpi=120, metadata=chart_metadata(path))
        plt.close(fig)
        return path


def _default_chips(chip: Chip) -> tuple[int, ...]:
    return TPU_CHIPS if chip.kind == "tpu" else GPU_CHIPS


def sweep(
    model: str | ModelConfig,
    hardware: str | Chip,
    *,
    context: int = 8192,
    weights: str = "bf16",
    kv: str = "bf16",
    chips: tuple[int, ...] | None = None,
    batches: tuple[int, ...] | None = None,
    achievable: bool = False,
    hardware_file: str | os.PathLike | None = None,
    scale: str | None = None,
) -> Sweep:
    """Decode latency and per-chip throughput of every fitting (topology, batch), and their Pareto frontier.

    Each topology in ``chips`` is pure tensor parallelism (``tp = chips``, ``dp = 1``); one whose ``tp``
    does not divide the model's heads, or whose HBM cannot hold the weights plus one sequence, is skipped.
    The batches are ``batches`` (default: powers of two to 1024) plus the topology's largest batch that fits.
    """
    context = _positive_int("context", context)
    weights = _storage_dtype("weights", weights)
    kv = _storage_dtype("kv", kv)
    m = _model(model)
    chip = _chip(hardware, hardware_file, scale)
    chip_counts = _default_chips(chip) if chips is None else _positive_ints("chips", chips)
    batch_list = BATCHES if batches is None else _positive_ints("batches", batches)

    points: list[SweepPoint] = []
    skipped: list[str] = []
    for n in chip_counts:
        tp = n
        if m.heads % tp:
            skipped.append(f"{n} chip{'s' if n > 1 else ''}: tp={tp} does not divide {m.heads} heads")
            continue
        max_batch = max_replica_batch(m, chip, tp, 1, context, weights, kv)
        if max_batch < 1:
            per_chip = weight_bytes_per_chip(m, tp, 1, weights)
            why = (
                f"weights need {fmt_bytes(per_chip)} per chip of {fmt_bytes(chip.hbm_bytes)}"
                if per_chip > chip.hbm_bytes
                else f"the weights leave no room for one {context}-token sequence"
            )
            skipped.append(f"{n} chip{'s' if n > 1 else ''}: {why}")
            continue
        for b in sorted({*batch_list, max_batch}):
            if b > max_batch:
                continue
            plan = serving_plan(m, batch=b, tp=tp)
            cfg = infer_config(plan, chip, context=context, weights=weights, kv=kv, achievable=achievable)
            e = estimate_inference(cfg)
            if not e.fits:
                continue
            points.append(
                SweepPoint(
                    chips=cfg.chips,
                    tp=tp,
                    dp=1,
                    batch=b,
                    decode_step_s=e.decode_step_s,
                    tokens_per_s=e.tokens_per_s,
                    tokens_per_s_per_chip=e.tokens_per_s_per_chip,
                    cost_per_million_tokens_usd=e.cost_per_million_tokens_usd,
                    bound=e.bound,
                    fits=e.fits,
                    pareto=False,
                )
            )
    flags = pareto_front(points)
    points = [dataclasses.replace(p, pareto=f) for p, f in zip(points, flags, strict=True)]
    return Sweep(
        model=m.name,
        hardware=chip.name,
        context=context,
        weights=weights,
        kv=kv,
        points=tuple(points),
        achievable=achievable,
        skipped=tuple(skipped),
    )


# ----- smallest topology per precision ----------------------------------------------------------


@dataclass(frozen=True)
class TopologyRow:
    """The smallest slice that serves the model at one weight (and KV) precision."""

    weights: str
    param_bytes: float
    min_chips: int  # ceil(param bytes / HBM per chip)
    slice_chips: int  # the smallest slice the hardware offers with at least that many chips
    slice_name: str
    kv_room_bytes: float  # the slice's HBM left after the weights
    max_batch: int  # sequences of ``context`` tokens that room holds


def _torus_slices(chip: Chip) -> Iterator[tuple[int, str]]:
    """Slices of a TPU torus, smallest first: each doubles the last of its smallest axes.

    2D (v5e, v6e): 1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16. 3D (v4, v5p): 2x2x1, 2x2x2, 2x2x4, 2x4x4,
    4x4x4, 4x4x8, ... (Cloud TPU slice shapes). Past the pod, whole pods joined over DCN.
    """
    dims = 3 if chip.torus_dims == 3 else 2
    pod = tuple(sorted(chip.pod_shape)) if chip.pod_shape and len(chip.pod_shape) == dims else None
    if dims == 2:
        yield 1, "1x1"
        shape = [2, 2]
    else:
        shape = [2, 2, 1]
    while True:
        if pod is not None and any(s > p for s, p in zip(sorted(shape), pod, strict=True)):
            break
        yield math.prod(shape), "x".join(map(str, shape))
        if pod is None and math.prod(shape) >= 2**20:
            return
        smallest = min(shape)
        i = max(j for j, s in enumerate(shape) if s == smallest)
        shape[i] *= 2
    pod_chips = math.prod(pod)
    pod_name = "x".join(map(str, chip.pod_shape))
    k = 2
    while True:
        yield k * pod_chips, f"{k} pods x {pod_name}"
        k += 1


def _switch_slices(chip: Chip) -> Iterator[tuple[int, str]]:
    """GPUs: 1, 2, 4, ... up to one switch domain (node), then whole nodes."""
    node = chip.node_size or 1
    unit = "GPU" if chip.kind == "gpu" else "chip"
    n = 1
    while n < node:
        yield n, f"{n} {unit}" + ("s" if n > 1 else "")
        n *= 2
    yield node, f"{node} {unit}s" if node > 1 else f"1 {unit}"
    k = 2
    while True:
        yield k * node, f"{k} nodes x {node}"
        k += 1


def slices(chip: Chip) -> Iterator[tuple[int, str]]:
    """(chips, name) of the slices or node groups ``chip`` is rented in, smallest first (unbounded)."""
    return _torus_slices(chip) if chip.topology == "torus" else _switch_slices(chip)


def _batch_in(m: ModelConfig, chip: Chip, n: int, context: int, dtype: str) -> int:
    """Sequences of ``context`` tokens ``n`` chips hold next to the weights (tensor-parallel over ``n``)."""
    if m.heads % n == 0:
        return max_replica_batch(m, chip, n, 1, context, dtype, dtype)
    room = n * chip.hbm_bytes - m.params * dtype_bytes(dtype)
    return max(0, math.floor(room / kv_bytes_per_sequence(m, context, dtype)))


def topology(
    model: str | ModelConfig,
    hardware: str | Chip,
    *,
    context: int = 8192,
    hardware_file: str | os.PathLike | None = None,
    scale: str | None = None,
) -> tuple[TopologyRow, ...]:
    """The smallest slice per weight precision (KV in the same precision), as applied-inference.md tabulates.

    ``min_chips = ceil(param bytes / HBM)``; the slice is the smallest one the hardware is rented in with
    at least that many chips and room for at least one ``context``-token sequence next to the weights.
    """
    context = _positive_int("context", context)
    m = _model(model)
    chip = _chip(hardware, hardware_file, scale)
    rows = []
    for dtype in TOPOLOGY_DTYPES:
        param_bytes = m.params * dtype_bytes(dtype)
        min_chips = max(1, math.ceil(param_bytes / chip.hbm_bytes))
        if min_chips > MAX_SLICE_CHIPS:  # refused before walking the slices one node at a time
            raise UserError(
                f"{m.name} in {dtype} needs {min_chips:.3g} chips of {chip.name} for its weights alone; no slice "
                f"up to {MAX_SLICE_CHIPS} chips holds it (check the model's dims)"
            )
        for size, size_name in slices(chip):
            if size < min_chips:
                continue
            batch = _batch_in(m, chip, size, context, dtype)
            if batch >= 1:
                n, name = size, size_name
                break
            if size > MAX_SLICE_CHIPS:
                raise UserError(f"no slice of {chip.name} up to {size} chips holds {m.name} in {dtype}")
        rows.append(
            TopologyRow(
                weights=dtype,
                param_bytes=param_bytes,
                min_chips=min_chips,
                slice_chips=n,
                slice_name=name,
                kv_room_bytes=n * chip.hbm_bytes - param_bytes,
                max_batch=batch,
            )
        )
    return tuple(rows)


def topology_table(rows: tuple[TopologyRow, ...], model: str, hardware: str, context: int) -> str:
    """The :func:`topology` rows as text."""
    return render(
        ["weights+KV", "params", "min chips", "slice", "chips", "KV room", f"caches @ {context}"],
        [
            [
                r.weights,
                fmt_bytes(r.param_bytes),
                r.min_chips,
                r.slice_name,
                r.slice_chips,
                fmt_bytes(r.kv_room_bytes),
                r.max_batch,
            ]
            for r in rows
        ],
        f"Smallest slice for {model} on {hardware} (weights and KV cache in the same precision)",
    )


# ----- prefill / decode disaggregation ----------------------------------------------------------


def disaggregate(prefill_s: float, decode_step_s: float, batch: int, generate: int) -> float:
    """Prefill servers per decode server that keep both pools saturated.

    With ``P`` prefill servers each finishing one prompt every ``prefill_s``, sequences enter at
    ``P / prefill_s``. A decode server holds ``batch`` sequences for ``generate`` steps of ``decode_step_s``,
    so ``G`` decode servers release ``G * batch / (decode_step_s * generate)`` sequences per second.
    Equal rates give ``P / G = prefill_s * batch / (decode_step_s * generate)``. The book's example
    (0.91 s prefill, 0.019 s/step, batch 32, 512 tokens out) gives about 3.
    """
    for name, v in (("prefill_s", prefill_s), ("decode_step_s", decode_step_s)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
            raise UserError(f"{name} must be a positive number of seconds, got {v!r}")
    batch = _positive_int("batch", batch)
    generate = _positive_int("generate", generate)
    return prefill_s * batch / (decode_step_s * generate)


__all__ = [
    "Sweep",
    "SweepPoint",
    "TopologyRow",
    "disaggregate",
    "pareto_front",
    "slices",
    "sweep",
    "topology",
    "topology_table",
]
