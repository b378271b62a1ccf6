"""Generations study: one Transformer trained on A100, H100, H200 and B200 systems of the same size.

Only the hardware changes. Every generation runs the same Megatron-style layout (tensor parallelism
of 8 inside the NVLink node, 8 interleaved pipeline stages, sequence parallelism, selective
recomputation, ZeRO-1 data parallelism over the rest, flash attention, microbatch 1), priced by
:func:`lab.predict.training.estimate.estimate`. Each chip is estimated in bf16 and, where its catalog entry has an
fp8 peak, in fp8.

The attribution walks from the baseline chip (the first of ``hardware``, the A100 by default) to
each target one spec group at a time, re-estimating after every swap:

1. ``compute``: ``peak_flops`` (still bf16);
2. ``HBM``: ``hbm_bandwidth``;
3. ``interconnect``: NVLink and scale-out bandwidths and latencies, NCCL's base latency and the
   switch-domain size (and the fabric's shape, which is the same for every GPU);
4. ``memory capacity``: ``hbm_bytes``, which changes only whether the job fits, never its time;
5. ``precision``: bf16 to fp8, where the target has an fp8 peak.

Each step's factor is the days before it divided by the days after it, so the factors multiply to
the target's speed-up over the baseline. The order matters (a later step's factor is measured with
the earlier swaps in place); this order is the one the issue asked for.

Nothing here is fitted to the published speed-ups the readings compare with.
"""
# Over 500 lines on purpose: one study: its layouts, per-generation systems, cost table and report are read together and
# imported nowhere else.

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip, get_chip
from lab.core.models import ModelConfig, get_model
from lab.core.paths import chart_metadata
from lab.core.table import render
from lab.predict.training.estimate import Layout, TrainConfig, TrainEstimate, check_config, estimate
from lab.predict.training.from_plan import job_plan, train_config

TP, PP, INTERLEAVE = 8, 8, 2
MICROBATCH = 1
REMAT = "selective"

# Spec groups of the attribution walk, in order. Fields not named here (name, sources, price...)
# do not enter the estimate.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compute", ("peak_flops", "kind")),
    ("HBM", ("hbm_bandwidth",)),
    (
        "interconnect",
        (
            "link_bandwidth",
            "scaleout_bandwidth",
            "hop_latency_s",
            "scaleout_latency_s",
            "launch_latency_s",
            "node_size",
            "topology",
            "torus_dims",
            "pod_shape",
            "wraparound_rule",
            "wraparound_size",
        ),
    ),
    ("memory capacity", ("hbm_bytes",)),
)
PRECISION_STEP = "precision"
# The kernels' measured efficiency (lab/predict/efficiency.py: GEMM, attention, copy and NCCL rates) belongs to
# the chip generation, not to a spec field: the walk's last field step hands it over.
KERNEL_STEP = "kernel efficiency"

# The two published readings the issue quotes; shown next to the model, never used by it.
PAPER_SYSTEM_SPEEDUP = 35.0
MEASURED_PER_GPU_SPEEDUP = (11.0, 17.0)
WHAT_IF_NODE_SIZE = 72  # a GB200 NVL72-sized NVLink domain


@dataclass(frozen=True)
class GenerationRow:
    """One chip at one precision, trained with the study's fixed layout."""

    hardware: str
    precision: str  # "bf16" or "fp8"
    layout: str
    step_time_s: float
    days: float
    mfu: float  # against the peak of this row's precision
    tokens_per_s: float
    speedup_vs_a100: float  # baseline (first chip, bf16) days / these days
    fits: bool


@dataclass(frozen=True)
class Attribution:
    """The walk from the baseline system to ``target``, one spec group at a time.

    ``steps`` holds ``(what changed, days after the change, factor this step contributed)``.
    """

    target: str
    steps: tuple[tuple[str, float, float], ...]
    total_factor: float


@dataclass(frozen=True)
class GenerationsStudy:
    """One model trained on each hardware generation, and what each spec group contributes to the speed-up."""

    model: str
    chips: int
    tokens: float
    seq_len: int
    global_batch: int
    rows: tuple[GenerationRow, ...]
    attributions: tuple[Attribution, ...]
    readings: dict[str, str]

    @property
    def baseline(self) -> GenerationRow:
        return self.rows[0]

    @property
    def layout(self) -> str:
        return self.rows[0].layout

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "chips": self.chips,
            "tokens": self.tokens,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "layout": self.layout,
            "baseline": {"hardware": self.baseline.hardware, "precision": self.baseline.precision},
            "rows": [
                {
                    "hardware": r.hardware,
                    "precision": r.precision,
                    "layout": r.layout,
                    "step_time_s": r.step_time_s,
                    "days": r.days,
                    "mfu": r.mfu,
                    "tokens_per_s": r.tokens_per_s,
                    "tokens_per_s_per_chip": r.tokens_per_s / self.chips,
                    "speedup_vs_a100": r.speedup_vs_a100,
                    "fits": r.fits,
                }
                for r in self.rows
            ],
            "attributions": [
                {
                    "target": a.target,
                    "start_days": self.baseline.days,
                    "steps": [{"changed": what, "days": days, "factor": factor} for what, days, factor in a.steps],
                    "total_factor": a.total_factor,
                }
                for a in self.attributions
            ],
            "readings": dict(self.readings),
        }

    def table(self) -> str:
        rows = [
            [
                r.hardware,
                r.precision,
                f"{r.step_time_s:.3f}",
                f"{r.days:.2f}",
                f"{r.speedup_vs_a100:.2f}",
                f"{100 * r.mfu:.1f}",
                f"{r.tokens_per_s / self.chips:,.0f}",
                "yes" if r.fits else "NO",
            ]
            for r in self.rows
        ]
        title = (
            f"{self.model} on {self.chips} chips, {self.tokens / 1e9:g}B tokens, seq {self.seq_len}, "
            f"batch {self.global_batch} sequences; layout {self.layout}, microbatch {MICROBATCH}, remat {REMAT}"
        )
        first = render(
            ["hardware", "precision", "step s", "days", "speed-up", "MFU %", "tokens/s/chip", "fits"], rows, title
        )
        base = self.baseline
        walk = []
        for a in self.attributions:
            cum = 1.0
            walk.append([a.target, f"start: {base.hardware} {base.precision}", f"{base.days:.2f}", "-", "-"])
            for what, days, factor in a.steps:
                cum *= factor
                walk.append(["", what, f"{days:.2f}", f"{factor:.3f}", f"{cum:.2f}"])
        second = render(
            ["target", "changed", "days", "factor", "cumulative"],
            walk,
            f"Attribution: {base.hardware} -> target, one spec group at a time (factor = days before / days after)",
        )
        notes = "\n".join(f"- {k}: {v}" for k, v in self.readings.items())
        return f"{first}\n\n{second}\n\nReadings\n{notes}"

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: training days per generation (left), attribution factors on a log scale (right)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        hardware = list(dict.fromkeys(r.hardware for r in self.rows))
        by_key = {(r.hardware, r.precision): r for r in self.rows}
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14.5, 5.5), gridspec_kw={"width_ratios": [1, 1.15]})

        width = 0.38
        colours = {"bf16": "#4C72B0", "fp8": "#DD8452"}
        for j, prec in enumerate(("bf16", "fp8")):
            xs, ys = [], []
            for i, hw in enumerate(hardware):
                if (hw, prec) in by_key:
                    xs.append(i + (j - 0.5) * width)
                    ys.append(by_key[(hw, prec)].days)
            bars = ax1.bar(xs, ys, width, label=prec, color=colours[prec])
            ax1.bar_label(bars, labels=[f"{y:.2f}" for y in ys], padding=2, fontsize=9)
        for i, hw in enumerate(hardware):
            if (hw, "fp8") not in by_key:
                ax1.text(i + 0.5 * width, 0.3, "no fp8", ha="center", va="bottom", fontsize=8, rotation=90)
        ax1.set_xticks(range(len(hardware)), hardware)
        ax1.set_xlabel("hardware")
        ax1.set_ylabel("training days (lower is better)")
        ax1.set_title("Training time per generation")
        ax1.legend(title="precision")
        ax1.margins(y=0.12)

        steps = [name for name, _ in GROUPS] + [KERNEL_STEP, PRECISION_STEP]
        colours = ("#55A868", "#8172B2", "#C44E52", "#937860", "#64B5CD", "#DD8452")
        step_colours = dict(zip(steps, colours, strict=True))
        targets = [a.target for a in self.attributions]
        for i, a in enumerate(self.attributions):
            cum = 1.0
            for what, _days, factor in a.steps:
                y0, y1 = sorted((cum, cum * factor))
                ax2.bar(i, y1 - y0, 0.6, bottom=y0, color=step_colours[what], edgecolor="white", linewidth=0.5)
                if factor >= 1.12:
                    ax2.text(i, math.sqrt(y0 * y1), f"x{factor:.2f}", ha="center", va="center", fontsize=8)
                elif factor <= 0.97:  # a step that slows: hidden under the next bar, so said beside it
                    ax2.text(i + 0.31, y1, f"{what.split()[0]}\nx{factor:.2f}", ha="left", va="center", fontsize=6)
                cum *= factor
            ax2.text(i, cum * 1.04, f"x{a.total_factor:.2f}", ha="center", va="bottom", fontsize=9, weight="bold")
        for name in steps:
            ax2.bar(0, 0, color=step_colours[name], label=name)  # legend entries, including zero-height steps
        lo, hi = MEASURED_PER_GPU_SPEEDUP
        ax2.axhspan(lo, hi, color="grey", alpha=0.15, label=f"published per-GPU, {lo:g}-{hi:g}x")
        ax2.axhline(
            PAPER_SYSTEM_SPEEDUP, color="black", ls="--", lw=1, label=f"paper, systems, ~{PAPER_SYSTEM_SPEEDUP:g}x"
        )
        ax2.set_yscale("log")
        top = max([a.total_factor for a in self.attributions] + [PAPER_SYSTEM_SPEEDUP])
        ax2.set_ylim(0.9, top * 1.5)
        ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100) if t <= top * 1.5]
        ax2.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax2.minorticks_off()
        ax2.set_xticks(range(len(targets)), targets)
        ax2.set_xlim(-0.5, len(targets) - 0.2)  # room right of the last bar for a slowing step's label
        ax2.set_xlabel("target (walked from the baseline one spec group at a time)")
        ax2.set_ylabel(f"speed-up over {self.baseline.hardware} {self.baseline.precision} (x, log scale)")
        ax2.set_title("Where the speed-up comes from")
        ax2.legend(title="spec group swapped; reference", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))

        fig.suptitle(
            f"{self.model}: {self.chips} GPUs, {self.tokens / 1e9:g}B tokens "
            f"(seq {self.seq_len}, batch {self.global_batch}; {self.layout})"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120, metadata=chart_metadata(path))
        plt.close(fig)
        return path


# ----- the study ----------------------------------------------------------------------------


def _config(model: ModelConfig, chip: Chip, layout: Layout, seq_len: int, global_batch: int, dtype: str) -> TrainConfig:
    """The study's job on one chip, priced as its Plan (``training.from_plan``), as any job the lab prices is."""
    job = TrainConfig(
        model=model,
        chip=chip,
        layout=layout,
        seq_len=seq_len,
        global_batch=global_batch,
        microbatch=MICROBATCH,
        remat=REMAT,
        dtype=dtype,
        flash_attention=True,
    )
    return train_config(job_plan(job), chip)


def study_layout(model: ModelConfig, chip: Chip, chips: int, seq_len: int, global_batch: int) -> Layout:
    """The fixed Megatron-style layout; interleaved x2 when valid, else 1F1B. UserError if it cannot apply."""
    group = TP * PP
    if not isinstance(chips, int) or chips < 1 or chips % group:
        near = max(group, round(chips / group) * group) if isinstance(chips, int | float) else group
        raise UserError(
            f"--chips {chips!r} does not divide into the study's tp={TP} x pp={PP} = {group}; "
            f"use a multiple of {group}, e.g. {near}"
        )
    common = dict(dp=chips // (TP * PP), tp=TP, pp=PP, zero=1, sequence_parallel=True)
    interleaved = Layout(**common, pp_schedule="interleaved", interleave=INTERLEAVE)
    try:
        check_config(_config(model, chip, interleaved, seq_len, global_batch, "bf16"))
        return interleaved
    except UserError:
        pass
    plain = Layout(**common, pp_schedule="1f1b")
    check_config(_config(model, chip, plain, seq_len, global_batch, "bf16"))  # raises UserError if invalid
    return plain


def _fp8_gain(chip: str) -> float:
    """How much faster a large fp8 GEMM runs than a bf16 one on ``chip``, at the rates both sustain."""
    from lab.predict.efficiency import gemm_ceiling

    c = get_chip(chip)
    return gemm_ceiling(c, "fp8") * c.flops("fp8") / (gemm_ceiling(c, "bf16") * c.flops("bf16"))


def _days(tokens: float, est: TrainEstimate) -> float:
    return tokens / est.tokens_per_s / 86400.0


def _precisions(chip: Chip) -> tuple[str, ...]:
    return ("bf16", "fp8") if "fp8" in chip.peak_flops else ("bf16",)


def _variant(chip: Chip, name: str, **changes: Any) -> Chip:
    fields = chip.fields()
    fields.update(changes)
    fields["name"] = name
    fields["aliases"] = ()
    return Chip(**fields)


def _attribute(base: Chip, target: Chip, run_days: Callable[[Chip, str], float], base_days: float) -> Attribution:
    """Swap ``target``'s fields into ``base`` group by group; ``run_days(chip, dtype)`` gives training days."""
    fields = base.fields()
    target_fields = target.fields()
    fields["aliases"] = ()
    steps: list[tuple[str, float, float]] = []
    before = base_days
    swapped: list[str] = []
    chip = base
    for group, names in GROUPS:
        for n in names:
            fields[n] = target_fields[n]
        swapped.append(group.replace(" ", "-").lower())
        fields["name"] = f"{base.name}+{'+'.join(swapped)}({target.name})"  # e.g. a100-80gb+compute+hbm(h100)
        chip = Chip(**fields)
        after = run_days(chip, "bf16")
        steps.append((group, after, before / after))
        before = after
    fields["name"] = target.name  # the target's own generation: its measured kernel rates
    chip = Chip(**fields)
    after = run_days(chip, "bf16")
    steps.append((KERNEL_STEP, after, before / after))
    before = after
    if "fp8" in target.peak_flops:
        after = run_days(chip, "fp8")
        steps.append((PRECISION_STEP, after, before / after))
    return Attribution(target=target.name, steps=tuple(steps), total_factor=math.prod(s[2] for s in steps))


def _readings(
    rows: list[GenerationRow],
    attributions: list[Attribution],
    chips: int,
    what_if: dict[str, float],
) -> dict[str, str]:
    base = rows[0]
    last_hw = rows[-1].hardware
    best = next(r for r in reversed(rows) if r.hardware == last_hw)  # fp8 when the newest chip has it
    per_gpu = (best.tokens_per_s / chips) / (base.tokens_per_s / chips)
    walk = next((a for a in attributions if a.target == last_hw), None)
    parts = ""
    if walk is not None:
        parts = ", ".join(f"{what} x{factor:.2f}" for what, _d, factor in walk.steps)
    lo, hi = MEASURED_PER_GPU_SPEEDUP
    gap = PAPER_SYSTEM_SPEEDUP / per_gpu
    readings = {
        "per GPU": (
            f"{base.hardware} {base.precision} -> {best.hardware} {best.precision}: "
            f"{base.tokens_per_s / chips:,.0f} -> {best.tokens_per_s / chips:,.0f} tokens/s per GPU, "
            f"x{per_gpu:.1f} in this model (published per-GPU measurements: about {lo:g}-{hi:g}x)."
        ),
        "system": (
            f"At the same {chips} GPUs and layout the system ratio equals the per-GPU one, x{per_gpu:.1f} "
            f"({base.days:.2f} -> {best.days:.2f} days); a performance-modelling paper reports about "
            f"{PAPER_SYSTEM_SPEEDUP:g}x for A100 -> B200 systems."
        ),
        "attribution": f"{best.hardware} walk: {parts}." if parts else "no attribution for the newest chip.",
        "gap": (
            f"The chips explain x{per_gpu:.1f}; a {PAPER_SYSTEM_SPEEDUP:g}x system figure needs another "
            f"x{gap:.1f} from outside this comparison. "
            + (
                f"What-ifs in the same model for {best.hardware}, over {base.hardware} bf16: "
                + ", ".join(f"{k} x{v:.1f}" for k, v in what_if.items())
                + ". "
                if what_if
                else ""
            )
            + "The rest would have to come from what is held fixed here: software (kernels, overlapping the "
            "tensor-parallel collectives this comparison leaves exposed), a layout retuned per generation, larger or "
            f"differently sized systems, and faster parts (GB200). The {lo:g}-{hi:g}x per-GPU measurements are "
            f"also above this model's x{per_gpu:.1f}; with software held fixed here, that difference too is left "
            "to software and per-generation tuning."
        ),
        "precision": (
            f"fp8 rows run the linear layers at the fp8 rate a large GEMM sustains ({_fp8_gain('h100'):.1f}x bf16 on "
            f"H100/H200, {_fp8_gain('b200'):.1f}x on B200; lab/predict/efficiency.py) with 1-byte operands, and pay "
            "Transformer Engine's casts around them; attention and "
            "the logits stay in bf16, as fp8 recipes keep them; activation memory, weights, gradients, optimizer "
            "state, collectives and memory-bound ops keep their bf16/fp32 bytes. MFU is against the row's own peak."
        ),
        "kernel efficiency": (
            "the last field step hands over the target generation's measured kernel rates (GEMM, fused attention, "
            "copy and NCCL fractions), which the spec fields do not carry; below 1 where the newer chip reaches a "
            "smaller share of its larger peak."
        ),
        "memory capacity": (
            "hbm_bytes changes only whether the job fits, never the time, so its factor is 1; "
            + ("every row fits." if all(r.fits for r in rows) else "rows marked NO do not fit.")
        ),
        "fitting": (
            f"the {PAPER_SYSTEM_SPEEDUP:g}x and {lo:g}-{hi:g}x figures are published comparisons, in neither the "
            "development set nor the test split; the estimator's efficiency fractions, fitted to neither, are the "
            "ones it uses everywhere."
        ),
    }
    return readings


def generations(
    model: str = "gpt3-175b",
    chips: int = 1024,
    tokens: float = 300e9,
    seq_len: int = 2048,
    global_batch: int = 1536,
    hardware: tuple[str, ...] = ("a100-80gb", "h100", "h200", "b200"),
) -> GenerationsStudy:
    """Train ``model`` on ``tokens`` tokens on ``chips`` of each ``hardware`` (the first is the baseline)."""
    if not hardware:
        raise UserError("--hardware needs at least one chip, e.g. a100-80gb,h100,h200,b200")
    if not (isinstance(tokens, int | float) and math.isfinite(tokens) and tokens > 0):
        raise UserError(f"--tokens must be a positive, finite number, got {tokens!r}")
    if tokens < global_batch * seq_len:  # less than one step: no training run (and a chart of zero-height bars)
        raise UserError(
            f"--tokens {tokens:g} is less than one step of {global_batch} sequences x {seq_len} tokens = "
            f"{global_batch * seq_len}; train on at least that many tokens, e.g. 3e11"
        )
    m = get_model(model)
    chip_list = [get_chip(h) for h in hardware]
    base = chip_list[0]
    layout = study_layout(m, base, chips, seq_len, global_batch)

    def run(chip: Chip, dtype: str) -> TrainEstimate:
        return estimate(_config(m, chip, layout, seq_len, global_batch, dtype))

    def run_days(chip: Chip, dtype: str) -> float:
        return _days(tokens, run(chip, dtype))

    rows: list[GenerationRow] = []
    base_days = run_days(base, "bf16")
    for chip in chip_list:
        for dtype in _precisions(chip):
            est = run(chip, dtype)
            days = _days(tokens, est)
            rows.append(
                GenerationRow(
                    hardware=chip.name,
                    precision=dtype,
                    layout=layout.describe(),
                    step_time_s=est.step_time_s,
                    days=days,
                    mfu=est.mfu,
                    tokens_per_s=est.tokens_per_s,
                    speedup_vs_a100=base_days / days,
                    fits=est.memory.fits,
                )
            )
    attributions = [_attribute(base, chip, run_days, base_days) for chip in chip_list[1:] if chip.name != base.name]
    return GenerationsStudy(
        model=m.name,
        chips=chips,
        tokens=float(tokens),
        seq_len=seq_len,
        global_batch=global_batch,
        rows=tuple(rows),
        attributions=tuple(attributions),
        readings=_readings(rows, attributions, chips, _what_ifs(chip_list[-1], run_days, base_days)),
    )


def _what_ifs(newest: Chip, run_days: Callable[[Chip, str], float], base_days: float) -> dict[str, float]:
    """Speed-ups over the baseline for two things a same-size, same-chip comparison holds fixed."""
    out: dict[str, float] = {}
    dtype = _precisions(newest)[-1]
    nvl = None
    if newest.topology == "switch" and (newest.node_size or 0) < WHAT_IF_NODE_SIZE:
        nvl = _variant(newest, f"{newest.name}+nvl{WHAT_IF_NODE_SIZE}", node_size=WHAT_IF_NODE_SIZE)
        out[f"{WHAT_IF_NODE_SIZE}-GPU NVLink domain ({dtype})"] = base_days / run_days(nvl, dtype)
    if "fp4" in newest.peak_flops:
        out["every matmul at the fp4 peak"] = base_days / run_days(newest, "fp4")
        if nvl is not None:
            out["both"] = base_days / run_days(nvl, "fp4")
    return out
