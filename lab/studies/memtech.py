"""Memory-technology study: how much decode throughput each generation of HBM buys, and where it stops.

Decode reads every weight and the whole KV cache once per step, so in the roofline its time is
bytes / HBM bandwidth and faster memory looks like a linear win. This study swaps the memory of one
chip, leaving compute and interconnect as they are, and measures how far that holds:

* **Generations.** The chip's ``stacks`` HBM stacks are replaced by stacks of HBM2e, HBM3, HBM3e and
  HBM4 (per-stack bandwidth and capacity in :data:`MEMORY_TECH`, each cited). Both bandwidth and
  capacity change. With ``batch=None`` the batch is the largest that fits at ``context``, so a larger
  capacity holds more sequences: that is how capacity turns into throughput.
* **Bandwidth alone.** The chip's own HBM bandwidth times 1, 2, 4, 8 and 16 at its own capacity (a
  what-if for memory far faster than any HBM, e.g. on-package SRAM or a 3D-stacked DRAM).

Each row is one :func:`lab.predict.inference.estimate.estimate_inference` decode step at ``tp`` chips (dp = 1), ideal
roofline. ``speedup_vs_first`` and ``bandwidth_ratio`` are against the first row of the row's series.
The findings are computed from the rows: where the gain stops tracking bandwidth, and what bounds the
step then (compute, collectives, or capacity through the batch).
"""
# Over 500 lines on purpose: one study with its cited memory-technology table and the report that reads it.

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.core.models import ModelConfig
from lab.core.paths import chart_metadata
from lab.core.table import render
from lab.core.units import fmt_bytes
from lab.predict.inference.estimate import InferEstimate, estimate_inference, max_replica_batch
from lab.predict.inference.from_plan import infer_config, serving_plan
from lab.studies.serving import _chip, _model, _positive_int, _storage_dtype


@dataclass(frozen=True)
class MemTech:
    """One HBM generation, per stack: bandwidth in bytes/s, capacity in bytes."""

    name: str
    bandwidth_per_stack: float
    capacity_per_stack: float
    source: str


MEMORY_TECH: tuple[MemTech, ...] = (
    MemTech(
        "HBM2e",
        460e9,
        16e9,
        "SK hynix, HBM2E mass-production announcement (July 2020): 3.6 Gb/s per pin on a 1024-bit interface, "
        "460 GB/s per stack; 16 GB as eight 16 Gb dies",
    ),
    MemTech(
        "HBM3",
        819e9,
        24e9,
        "JEDEC JESD238 HBM3 standard (January 2022): 6.4 Gb/s per pin x 1024 bits = 819 GB/s per stack; "
        "SK hynix HBM3 announcement (October 2021): 24 GB 12-high stack at 819 GB/s",
    ),
    MemTech(
        "HBM3e",
        1.2e12,
        36e9,
        "Micron HBM3E 12-high announcement (September 2024): 36 GB per stack, more than 1.2 TB/s "
        "(9.2 Gb/s per pin x 1024 bits)",
    ),
    MemTech(
        "HBM4",
        2.0e12,
        36e9,
        "JEDEC JESD270-4 HBM4 standard (April 2025): 2048-bit interface, up to 8 Gb/s per pin, i.e. 2 TB/s per "
        "stack; SK hynix 12-high HBM4 samples (March 2025): 36 GB per stack, more than 2 TB/s",
    ),
)

# HBM stacks per chip, with where the number comes from. Chips not listed: inferred from capacity.
STACKS: dict[str, tuple[int, str]] = {
    "a100-40gb": (5, "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): five active HBM2 stacks, 40 GB"),
    "a100-80gb": (5, "NVIDIA A100 80GB: five active HBM2e stacks of 16 GB (80 GB, the 40 GB part's five sites)"),
    "h100": (
        5,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): H100 SXM5 has 80 GB of HBM3 in five "
        "active stacks (six sites on the package)",
    ),
    "h200": (6, "NVIDIA H200: 141 GB of HBM3e, six 24 GB stacks (144 GB raw); inferred from capacity"),
    "b200": (8, "NVIDIA Blackwell (GTC 2024): 192 GB of HBM3e as eight 24 GB stacks, four per die"),
    "tpu-v5e": (
        2,
        "inferred: 16 GB at 819 GB/s is two 8 GB HBM2e stacks at 3.2 Gb/s per pin (2 x 409.6 GB/s); one "
        "HBM2e stack cannot reach 819 GB/s",
    ),
    "tpu-v5p": (6, "inferred: 95 GB at 2,765 GB/s is six 16 GB HBM2e stacks at 3.6 Gb/s per pin (6 x 460 GB/s)"),
    "tpu-v4": (4, "inferred: 32 GiB at 1.2 TB/s is four 8 GiB HBM2 stacks at 2.4 Gb/s per pin (4 x 307 GB/s)"),
}
INFERRED_STACK_BYTES = 16e9  # assumption for chips not in STACKS: one 16 GB stack per 16 GB of HBM

BANDWIDTH_MULTIPLIERS = (1, 2, 4, 8, 16)
GENERATIONS = "generations"
BANDWIDTH = "bandwidth"
# Bounds that are HBM bandwidth (reading bytes) rather than something faster memory cannot fix.
MEMORY_BOUNDS = ("KV reads", "weight reads")
# A step of a series is "near-linear" while its throughput gain is at least this fraction of its bandwidth gain.
NEAR_LINEAR = 0.8


@dataclass(frozen=True)
class MemTechRow:
    """One memory configuration of the chip, decoded at the study's batch (or the largest that fits)."""

    label: str
    hbm_bandwidth: float
    hbm_bytes: float
    decode_step_s: float
    tokens_per_s_per_chip: float
    max_batch: int
    bound: str
    speedup_vs_first: float  # tokens/s/chip over the first row of this row's series
    bandwidth_ratio: float  # HBM bandwidth over the first row of this row's series
    series: str = GENERATIONS  # "generations" or "bandwidth"
    batch: int = 0  # the batch decoded (the study's, or max_batch when the study's is None)
    fits: bool = True
    kv_s: float = 0.0
    weights_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def efficiency(self) -> float:
        """Speed-up over bandwidth ratio: 1 is linear in bandwidth."""
        return self.speedup_vs_first / self.bandwidth_ratio


@dataclass(frozen=True)
class MemTechStudy:
    """Decode on one chip with each memory technology: its rows and what they say."""

    model: str
    hardware: str
    stacks: int
    context: int
    batch: int | None
    rows: tuple[MemTechRow, ...]
    findings: tuple[str, ...]
    tp: int = 8
    weights: str = "bf16"
    kv: str = "bf16"
    stacks_source: str = ""

    def series(self, name: str) -> tuple[MemTechRow, ...]:
        return tuple(r for r in self.rows if r.series == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "stacks": self.stacks,
            "stacks_source": self.stacks_source,
            "tp": self.tp,
            "context": self.context,
            "batch": self.batch,
            "batch_rule": "fixed" if self.batch is not None else "largest that fits at context",
            "weights": self.weights,
            "kv": self.kv,
            "ideal": True,
            "memory_tech": [dataclasses.asdict(t) for t in MEMORY_TECH],
            "rows": [dataclasses.asdict(r) | {"efficiency": r.efficiency} for r in self.rows],
            "findings": list(self.findings),
        }

    def table(self) -> str:
        rows = [
            [
                r.series,
                r.label,
                f"{r.hbm_bandwidth / 1e12:.2f}",
                f"{r.hbm_bytes / 1e9:.0f}",
                r.batch if r.fits else f"{r.batch} (no fit)",
                f"{r.decode_step_s * 1e3:.2f}",
                f"{r.tokens_per_s_per_chip:,.1f}",
                f"{r.bandwidth_ratio:.2f}",
                f"{r.speedup_vs_first:.2f}",
                f"{r.efficiency:.2f}",
                r.bound,
            ]
            for r in self.rows
        ]
        batch = f"batch {self.batch}" if self.batch is not None else "largest batch that fits"
        title = (
            f"Memory technology: {self.model} on {self.hardware} ({self.stacks} HBM stacks), tp={self.tp}, "
            f"context {self.context}, {batch}, weights {self.weights}, KV {self.kv}, ideal roofline"
        )
        headers = [
            "series",
            "memory",
            "HBM TB/s",
            "HBM GB",
            "batch",
            "ms/token",
            "tokens/s/chip",
            "BW ratio",
            "speed-up",
            "speed-up/BW",
            "bound",
        ]
        notes = "\n".join(f"- {f}" for f in self.findings)
        return f"{render(headers, rows, title)}\n\nFindings\n{notes}"

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: decode speed-up against bandwidth ratio, the linear ideal, colour by bound."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(10, 6.5))
        colours = {
            "KV reads": "#4C72B0",
            "weight reads": "#55A868",
            "compute": "#C44E52",
            "collectives": "#8172B2",
            "does not fit": "#999999",
        }
        markers = {GENERATIONS: "o", BANDWIDTH: "s"}
        top = max([r.bandwidth_ratio for r in self.rows] + [1.0])
        ax.plot([1, top], [1, top], ls="--", color="black", lw=1, label="linear in bandwidth (ideal)")
        for name in (GENERATIONS, BANDWIDTH):
            rows = [r for r in self.series(name) if r.speedup_vs_first > 0]  # rows that do not fit have no point
            ax.plot(
                [r.bandwidth_ratio for r in rows],
                [r.speedup_vs_first for r in rows],
                color="#BBBBBB",
                lw=1,
                zorder=1,
                ls="-" if name == GENERATIONS else ":",
            )
            for r in rows:
                ax.scatter(
                    r.bandwidth_ratio,
                    r.speedup_vs_first,
                    s=70,
                    marker=markers[name],
                    color=colours.get(r.bound, "#333333"),
                    edgecolor="black",
                    linewidth=0.5,
                    zorder=3,
                )
                ax.annotate(
                    f"{r.label} ({r.hbm_bandwidth / 1e12:.1f} TB/s)",
                    (r.bandwidth_ratio, r.speedup_vs_first),
                    textcoords="offset points",
                    xytext=(6, -12) if name == BANDWIDTH else (-8, 8),
                    ha="left" if name == BANDWIDTH else "right",
                    fontsize=8,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ticks = [t for t in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if t <= top * 1.1]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(0.9, top * 1.6)
        ax.set_ylim(0.9, top * 1.15)
        ax.set_xlabel("HBM bandwidth ratio (x, over the first row of each series; log scale)")
        ax.set_ylabel("decode speed-up in tokens/s/chip (x; log scale)")
        batch = f"batch {self.batch}" if self.batch is not None else "largest batch that fits"
        ax.set_title(
            f"{self.model} on {self.hardware}, tp={self.tp}: decode speed-up vs memory bandwidth\n"
            f"context {self.context}, {batch}, weights {self.weights}, KV {self.kv}, ideal roofline"
        )
        handles = [Line2D([], [], ls="--", color="black", label="linear in bandwidth (ideal)")]
        handles += [
            Line2D([], [], ls="", marker="o", color="#DDDDDD", markeredgecolor="black", label="HBM generations"),
            Line2D([], [], ls="", marker="s", color="#DDDDDD", markeredgecolor="black", label="bandwidth x1..x16"),
        ]
        present = dict.fromkeys(r.bound for r in self.rows)
        handles += [
            Line2D([], [], ls="", marker="o", color=colours.get(b, "#333333"), label=f"bound: {b}") for b in present
        ]
        ax.legend(handles=handles, fontsize=8, loc="upper left")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120, metadata=chart_metadata(path))
        plt.close(fig)
        return path


# ----- the study ------------------------------------------------------------------------------


def default_stacks(chip: Chip) -> tuple[int, str]:
    """HBM stacks of ``chip`` and the source of that number (inferred from capacity when not catalogued)."""
    base = chip.name.split("[", 1)[0]  # a scaled what-if keeps its catalog name before the bracket
    if base in STACKS:
        return STACKS[base]
    n = max(1, round(chip.hbm_bytes / INFERRED_STACK_BYTES))
    return n, (
        f"inferred from capacity: {fmt_bytes(chip.hbm_bytes)} / {fmt_bytes(INFERRED_STACK_BYTES)} per stack "
        f"= {n} (no published stack count in this lab; pass stacks= to override)"
    )


def _with_memory(chip: Chip, name: str, bandwidth: float, capacity: float) -> Chip:
    fields = chip.fields()
    fields.update(name=name, aliases=(), hbm_bandwidth=bandwidth, hbm_bytes=capacity)
    fields["sources"] = dict(chip.sources) | {
        "hbm_bandwidth": f"memory-technology study: {name}",
        "hbm_bytes": f"memory-technology study: {name}",
    }
    return Chip(**fields)


def _decode(
    m: ModelConfig, chip: Chip, tp: int, context: int, batch: int | None, weights: str, kv: str
) -> tuple[InferEstimate | None, int, int]:
    """(estimate, batch decoded, max batch); no estimate when not even one sequence fits."""
    max_batch = max_replica_batch(m, chip, tp, 1, context, weights, kv)
    b = max_batch if batch is None else batch
    if b < 1:
        return None, 0, max_batch
    plan = serving_plan(m, batch=b, tp=tp)
    cfg = infer_config(plan, chip, context=context, weights=weights, kv=kv, achievable=False)
    return estimate_inference(cfg), b, max_batch


def _rows(series: str, configs: list[tuple[str, Chip]], decode) -> list[MemTechRow]:
    """One row per (label, chip); ratios against the first row where the model fits."""
    results = [(label, chip, *decode(chip)) for label, chip in configs]
    ref = next(((c, e) for _, c, e, _, _ in results if e is not None and e.fits), None)
    ref_bw = ref[0].hbm_bandwidth if ref else configs[0][1].hbm_bandwidth
    ref_tps = ref[1].tokens_per_s_per_chip if ref else math.nan
    out: list[MemTechRow] = []
    for label, chip, e, b, max_batch in results:
        common = dict(
            label=label,
            hbm_bandwidth=chip.hbm_bandwidth,
            hbm_bytes=chip.hbm_bytes,
            max_batch=max_batch,
            bandwidth_ratio=chip.hbm_bandwidth / ref_bw,
            series=series,
            batch=b,
        )
        if e is None:
            out.append(
                MemTechRow(
                    **common,
                    decode_step_s=math.inf,
                    tokens_per_s_per_chip=0.0,
                    bound="does not fit",
                    speedup_vs_first=0.0,
                    fits=False,
                )
            )
            continue
        out.append(
            MemTechRow(
                **common,
                decode_step_s=e.decode_step_s,
                tokens_per_s_per_chip=e.tokens_per_s_per_chip,
                bound=e.bound,
                speedup_vs_first=e.tokens_per_s_per_chip / ref_tps,
                fits=e.fits,
                kv_s=e.kv_s,
                weights_s=e.weights_s,
                compute_s=e.compute_s,
                comm_s=e.comm_s,
            )
        )
    return out


def _shares(r: MemTechRow) -> str:
    mm = max(r.weights_s, r.compute_s)
    mm_name = "weight reads" if r.weights_s >= r.compute_s else "compute"
    total = r.decode_step_s
    return (
        f"KV reads {100 * r.kv_s / total:.0f}%, {mm_name} {100 * mm / total:.0f}%, "
        f"collectives {100 * r.comm_s / total:.0f}%"
    )


def _fixed_share(r: MemTechRow) -> float:
    """Fraction of the step no memory bandwidth removes: collectives and compute (``max(weights / k, compute)``
    never drops below compute)."""
    return (r.comm_s + r.compute_s) / r.decode_step_s


def _generation_steps(fit_gen: list[MemTechRow], batch: int | None) -> list[str]:
    """Each step between HBM generations: its bandwidth, capacity and tokens/s/chip ratios."""
    out: list[str] = []
    for a, b in itertools.pairwise(fit_gen):
        bw_x = b.hbm_bandwidth / a.hbm_bandwidth
        cap_x = b.hbm_bytes / a.hbm_bytes
        tps_x = b.tokens_per_s_per_chip / a.tokens_per_s_per_chip
        text = (
            f"{a.label} -> {b.label}: bandwidth x{bw_x:.2f}, capacity x{cap_x:.2f}"
            + (f" (batch {a.batch} -> {b.batch})" if batch is None else "")
            + f"; tokens/s/chip x{tps_x:.2f} ({tps_x / bw_x:.0%} of the bandwidth gain); bound by {b.bound}."
        )
        if tps_x > bw_x * 1.001:
            text += (
                " Above linear: capacity grew too, and the extra sequences share the same weight reads and collectives."
            )
        out.append(text)
    return out


def _bandwidth_findings(bw: list[MemTechRow], batch: int | None) -> list[str]:
    """Where the bandwidth-only series leaves the linear line, and what bounds the step instead."""
    out: list[str] = []
    if bw and all(r.fits for r in bw):
        knee = next(
            (
                (a, b)
                for a, b in itertools.pairwise(bw)
                if (b.tokens_per_s_per_chip / a.tokens_per_s_per_chip) / (b.hbm_bandwidth / a.hbm_bandwidth)
                < NEAR_LINEAR
            ),
            None,
        )
        if knee is None:
            out.append(
                f"Bandwidth alone: every doubling up to {bw[-1].label} keeps at least {NEAR_LINEAR:.0%} of its "
                f"bandwidth gain (x{bw[-1].speedup_vs_first:.2f} overall for x{bw[-1].bandwidth_ratio:g} bandwidth)."
            )
        else:
            a, b = knee
            step_bw = b.hbm_bandwidth / a.hbm_bandwidth
            step_tps = b.tokens_per_s_per_chip / a.tokens_per_s_per_chip
            fixed = _fixed_share(b)
            out.append(
                f"Bandwidth alone stops being near-linear at {a.label} -> {b.label}: bandwidth x{step_bw:.2f} but "
                f"tokens/s/chip only x{step_tps:.2f}, because at {b.label} {fixed:.0%} of the step is compute and "
                f"collectives, which bandwidth does not shorten ({_shares(b)})."
            )
        turn = next((r for r in bw if r.bound not in MEMORY_BOUNDS), None)
        if turn is not None:
            out.append(
                f"From {turn.label} ({turn.hbm_bandwidth / 1e12:.1f} TB/s) the step is bound by {turn.bound}, "
                "not by HBM reads."
            )
        last = bw[-1]
        # With unlimited bandwidth the byte terms vanish and the step is compute plus collectives.
        floor = last.compute_s + last.comm_s
        limit = bw[0].decode_step_s / floor if floor > 0 else math.inf
        bound_word = "HBM bandwidth" if last.bound in MEMORY_BOUNDS else last.bound
        out.append(
            f"At {last.label} ({last.hbm_bandwidth / 1e12:.1f} TB/s) the speed-up is x{last.speedup_vs_first:.2f} for "
            f"x{last.bandwidth_ratio:g} bandwidth and the step is bound by {bound_word} ({_shares(last)}); "
            f"unlimited bandwidth would reach at most x{limit:.2f} over {bw[0].label}: the compute + collectives floor "
            f"is {floor * 1e3:.2f} ms per step."
        )
    elif bw:
        out.append(
            f"The bandwidth series does not fit: {bw[0].hbm_bytes / 1e9:.0f} GB per chip at this tp cannot hold "
            f"the weights and {'one sequence' if batch is None else f'{batch} sequences'}; use a larger tp."
        )
    return out


def _findings(gen: list[MemTechRow], bw: list[MemTechRow], batch: int | None) -> list[str]:
    """What the two series show, in sentences: each HBM generation's step, where bandwidth alone stops paying,
    and what capacity decides."""
    fit_gen = [r for r in gen if r.fits]
    out = _generation_steps(fit_gen, batch) + _bandwidth_findings(bw, batch)
    # 3. Capacity decides the batch.
    if batch is None and len(fit_gen) >= 2:
        a, b = fit_gen[0], fit_gen[-1]
        text = (
            f"Capacity sets the batch: {a.label} ({a.hbm_bytes / 1e9:.0f} GB) holds {a.batch} sequences, "
            f"{b.label} ({b.hbm_bytes / 1e9:.0f} GB) {b.batch}"
        )
        if bw and bw[0].fits:
            text += f"; with capacity fixed, the bandwidth series decodes {bw[0].batch} at every multiplier"
        out.append(text + ".")
    elif batch is not None:
        no_fit = [r.label for r in gen + bw if not r.fits]
        if no_fit:
            out.append(f"Batch {batch} does not fit in: {', '.join(no_fit)} (times shown as if it did).")
    return out


def memory_tech(
    model: str | ModelConfig = "llama3-70b",
    hardware: str | Chip = "h100",
    *,
    stacks: int | None = None,
    context: int = 8192,
    batch: int | None = None,
    tp: int = 8,
    weights: str = "bf16",
    kv: str = "bf16",
    hardware_file: str | os.PathLike | None = None,
    scale: str | None = None,
) -> MemTechStudy:
    """Decode ``model`` on ``hardware`` with each HBM generation, then with x1..x16 its own bandwidth.

    ``stacks`` defaults to the chip's own stack count (:data:`STACKS`, else inferred from capacity).
    ``batch=None`` decodes the largest batch that fits at ``context`` (capacity decides the batch); a
    fixed ``batch`` isolates bandwidth.
    """
    context = _positive_int("context", context)
    tp = _positive_int("tp", tp)
    if batch is not None:
        batch = _positive_int("batch", batch)
    weights = _storage_dtype("weights", weights)
    kv = _storage_dtype("kv", kv)
    m = _model(model)
    chip = _chip(hardware, hardware_file, scale)
    if m.heads % tp:
        raise UserError(f"--tp {tp} does not divide {m.name}'s {m.heads} attention heads")
    if stacks is None:
        stacks, stacks_source = default_stacks(chip)
    else:
        stacks = _positive_int("stacks", stacks)
        stacks_source = "given"

    def decode(c: Chip):
        return _decode(m, c, tp, context, batch, weights, kv)

    gen_chips = [
        (
            t.name,
            _with_memory(
                chip,
                f"{chip.name}+{t.name.lower()}x{stacks}",
                stacks * t.bandwidth_per_stack,
                stacks * t.capacity_per_stack,
            ),
        )
        for t in MEMORY_TECH
    ]
    bw_chips = [
        (f"bw x{k}", _with_memory(chip, f"{chip.name}+bwx{k}", chip.hbm_bandwidth * k, chip.hbm_bytes))
        for k in BANDWIDTH_MULTIPLIERS
    ]
    gen = _rows(GENERATIONS, gen_chips, decode)
    bw = _rows(BANDWIDTH, bw_chips, decode)
    return MemTechStudy(
        model=m.name,
        hardware=chip.name,
        stacks=stacks,
        context=context,
        batch=batch,
        rows=tuple(gen + bw),
        findings=tuple(_findings(gen, bw, batch)),
        tp=tp,
        weights=weights,
        kv=kv,
        stacks_source=stacks_source,
    )


__all__ = ["MEMORY_TECH", "STACKS", "MemTech", "MemTechRow", "MemTechStudy", "default_stacks", "memory_tech"]
