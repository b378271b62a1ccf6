"""``shardlab plan ... --validate K``: the planner checked by execution.

The planner ranks layouts by their estimated step time; this takes its K best that the lab's Transformer runs as
they are priced (data, FSDP, tensor, context, pipeline and expert parallelism as :meth:`Plan.validate` admits them;
one microbatch a step without a pipeline; no FSDP inside pipeline stages), builds each as a Plan
(:func:`lab.core.plan_degrees.plan_from_degrees`), prices it as built, compiles it (XLA's memory per device against the
estimate's fits verdict), runs and profiles it where it can (this host's devices), and ranks the layouts twice: by
the estimate and by the measured step. A pipeline runs the schedule the lab has (GPipe for the planner's 1F1B, the
circular schedule for its interleaved one), the planner's figure beside it. Spearman's and Kendall's rank
correlations say how well the estimates order what runs; a layout ranked wrongly is named with the op whose
measured time departs most from its estimate. With ``--target`` (a TPU topology, cross-compiled) nothing runs: the
memory verdicts are checked, and the ranking is the estimate's only.
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.plan import Options, Plan
from lab.core.plan_degrees import plan_from_degrees
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_seconds


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 2 points or a constant list."""
    ra, rb = _ranks(a), _ranks(b)
    if len(a) < 2 or statistics.pstdev(ra) == 0 or statistics.pstdev(rb) == 0:
        return None
    return statistics.correlation(ra, rb)


def kendall(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-b over every pair; None for fewer than 2 points."""
    if len(a) < 2:
        return None
    conc = disc = ta = tb = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ta += 1
        elif db == 0:
            tb += 1
        elif (da > 0) == (db > 0):
            conc += 1
        else:
            disc += 1
    denom = math.sqrt((conc + disc + ta) * (conc + disc + tb))
    return (conc - disc) / denom if denom else None


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


# The pipeline schedule the lab's Transformer runs for each one the planner prices: GPipe for Megatron's 1F1B (the
# same bubble, every microbatch's activations held), its circular schedule for the interleaved one.
RUN_SCHEDULE = {"1f1b": "gpipe", "gpipe": "gpipe", "interleaved": "interleaved"}
# Calls of each layout's train step run on this host: untraced, then profiled (plan --warmup, --repeats).
CALLS = {"warmup": 3, "repeats": 5}


def executable(est) -> bool:
    """Whether a planner layout is one the lab's train step runs as the planner prices it: no ZeRO-1 or -2, no
    uneven stages, without a pipeline one microbatch a step, and no FSDP inside pipeline stages (the lab's pipeline
    takes each stage's weights whole into its ``shard_map``: they are gathered once a step and their gradients
    all-reduced, not gathered layer by layer as the planner prices them; the audit and the estimate of the Plan
    price what the lab does on this host, not yet what the TPU compiler does, which casts first). Whether the lab's
    Transformer takes the rest of its parallelism (pipeline, context, experts, and their combinations) is
    :meth:`Plan.validate`'s to say (:func:`candidates`)."""
    lay, c = est.config.layout, est.config
    plain = not lay.stage_split and not lay.pp_embedding_slots
    staged_fsdp = lay.pp > 1 and lay.fsdp > 1
    return lay.zero in (0, 3) and plain and (lay.pp > 1 or c.microbatches == 1) and not staged_fsdp


def as_run(plan: Plan, chip, target=None):
    """The training estimate of the program the lab runs for a planner layout: its Plan priced as built (the lab's
    plain softmax attention, whose scores are stored where the planner assumes a flash-style kernel; fp32 weights;
    a pipeline with the schedule the lab runs, :data:`RUN_SCHEDULE`, as its SPMD pipeline runs it), and for a TPU
    ``target`` as the TPU compiler builds it."""
    return _as_built(plan, chip, target).detail["train"]


def _as_built(plan: Plan, chip, target=None):
    """The Plan's :class:`~lab.predict.program.estimate.ProgramEstimate` as it compiles here, or for the TPU
    ``target``."""
    from lab.compile.target import for_target
    from lab.predict.program.estimate import estimate_program

    return estimate_program(for_target(plan) if target is not None else plan, chip)


def layout_label(est) -> str:
    lay, c = est.config.layout, est.config
    degrees = (("dp", lay.dp), ("fsdp", lay.fsdp), ("ep", lay.ep), ("cp", lay.cp), ("tp", lay.tp), ("pp", lay.pp))
    parts = [f"{k}={v}" for k, v in degrees if v > 1] or ["1 chip"]
    if lay.pp > 1:
        run = {"gpipe": "gpipe", "interleaved": "circular"}[RUN_SCHEDULE[lay.pp_schedule]]
        parts.append(f"{run}x{lay.v}" if lay.v > 1 else run)
        parts.append(f"M={c.microbatches}")
    return " ".join(parts) + (" sp" if lay.sequence_parallel else "") + f", remat {c.remat}"


def candidates(result, k: int, model, dtype: str, hardware: str) -> list[tuple[Any, Plan]]:
    """The planner's K best layouts that the lab runs, best first, each with its Plan; a UserError when it found
    none. A layout whose Plan the lab's Transformer refuses (:meth:`Plan.validate`) is passed over."""
    from lab.core.arrays import unsupported_features

    missing = unsupported_features(model)
    if missing:
        raise UserError(
            f"--validate runs the lab's Transformer, which does not build what {model.name} has "
            f"({', '.join(missing)}); drop --validate (the planner prices it), or give a LLaMA-style model"
        )
    chosen = []
    for est in result.top:
        if len(chosen) == k:
            break
        if not executable(est):
            continue
        plan = to_plan(est, model, dtype, hardware)
        try:
            plan.validate()
        except UserError:
            continue
        chosen.append((est, plan))
    if not chosen:
        raise UserError(
            "none of the planner's layouts is one the lab's train step executes (no ZeRO-1 or -2, no uneven "
            "stages, no FSDP inside pipeline stages, one microbatch a step without a pipeline); give more "
            "--batch-tokens per chip or fewer chips"
        )
    return chosen


def to_plan(est, model, dtype: str, hardware: str) -> Plan:
    lay, c = est.config.layout, est.config
    options = None  # the lab's Transformer as it compiles (Options' defaults); a pipeline's microbatches and schedule
    if lay.pp > 1:
        options = Options(microbatch=c.microbatch, pp_schedule=RUN_SCHEDULE[lay.pp_schedule], interleave=lay.v)
    return plan_from_degrees(
        model,
        hardware=hardware,
        batch=c.global_batch,
        seq_len=c.seq_len,
        **lay.degrees(),
        dtype=dtype,
        param_dtype="fp32",  # the lab's Transformer keeps fp32 weights
        remat=c.remat,
        options=options,
        name=layout_label(est).replace(" ", "_").replace(",", "").replace("=", ""),
    )


def _worst_op(report: dict[str, Any]) -> str:
    """The named op whose measured time departs most from its estimate (the op that explains a misranking)."""
    rows = [o for o in report.get("estimated_ops") or [] if o.get("measured_s") and o.get("estimated_s")]
    if not rows:
        return "-"
    o = max(rows, key=lambda r: abs(r["measured_s"] - r["estimated_s"]))
    return f"{o['name']} ({fmt_seconds(o['estimated_s'])} est., {fmt_seconds(o['measured_s'])} meas.)"


def _indented(say):
    """One layout's own phases (building, compiling, profiling, and a line every 5 s while one runs), indented
    under the layout's line."""
    return lambda text: say(f"  {text}")


def validate_plan(
    result,
    model,
    chip,
    k: int,
    out: str,
    *,
    target: str | None = None,
    dtype: str = "float32",
    warmup: int = CALLS["warmup"],
    repeats: int = CALLS["repeats"],
):
    """Compile (and where possible run) the planner's K best executable layouts; the comparison's data. A layout run
    on this host's devices is profiled over ``repeats`` calls of its train step after ``warmup`` untraced ones."""
    from lab.compile.audit import _analyses, compile_plan
    from lab.compile.target import DoesNotFit, parse_target
    from lab.core.heartbeat import still
    from lab.run.environment import Progress, environment
    from lab.run.experiment import Experiment
    from lab.run.point import fit_problem, host_bytes_per_device, run_point

    topology = parse_target(target) if target else None
    chosen = candidates(result, k, model, dtype, chip.name)
    programs = [_as_built(plan, chip, topology) for _, plan in chosen]
    if topology is None:  # every layout that is to run must fit this host's devices, checked before any compiles
        host = host_bytes_per_device()
        for (_, plan), program in zip(chosen, programs, strict=True):
            problem = fit_problem(plan, program, chip, host)
            if problem:
                raise UserError(f"{problem}; or a smaller --model, or --target to compile for a TPU without running")
    say = Progress()
    env = environment()
    rows = []
    for i, (est, plan) in enumerate(chosen):
        say(f"layout {i + 1} of {len(chosen)}: {layout_label(est)}")
        priced = programs[i].detail["train"]
        if topology is not None:
            try:
                with still(say, f"compiling layout {i + 1} for {topology.name}"):
                    _, compiled = compile_plan(plan, topology)
                mem = _analyses(compiled)[1]
            except DoesNotFit as exc:  # the compiler's verdict, with what it said the temporaries need
                mem = {"temp_size_in_bytes": exc.need_bytes}
            measured, report = None, {}
        else:
            out_dir = Path(out) / f"validate-{i + 1}"
            out_dir.mkdir(parents=True, exist_ok=True)
            report = run_point(
                Experiment(plan=plan, warmup=warmup, repeats=repeats), plan, out_dir, chip, _indented(say), env
            )
            mem, measured = report["audit"].get("memory_analysis", {}), report["step_time_measured_s"]
        held = sum(mem.get(f"{k}_size_in_bytes", 0.0) for k in ("argument", "output", "temp"))
        held -= mem.get("alias_size_in_bytes", 0.0)
        rows.append(
            {
                "layout": layout_label(est),
                "planner_step_s": est.step_time_s,
                "planner_schedule": est.config.layout.pp_schedule if est.config.layout.pp > 1 else None,
                "estimated_step_s": priced.step_time_s,
                "planner_fits": priced.memory.fits,
                "planner_memory_bytes": priced.memory.total,
                "compiled_memory_bytes": held,
                "compiled_fits": held <= chip.hbm_bytes,
                "measured_step_s": measured,
                "measured_spread": report["summary"].get("spread_large") if measured is not None else None,
                "worst_op": _worst_op(report),
            }
        )
    return _summary(rows, chip, topology)


def _summary(rows: list[dict[str, Any]], chip, topology) -> dict[str, Any]:
    pred = [r["estimated_step_s"] for r in rows]
    meas = [r["measured_step_s"] for r in rows]
    ran = all(m is not None for m in meas)
    pr = _ranks(pred)  # a pipeline priced as the lab runs it may move from the planner's place
    for r, a in zip(rows, pr, strict=True):
        r["predicted_rank"] = int(a)
    if ran:
        for r, a, b in zip(rows, pr, _ranks(meas), strict=True):
            r["measured_rank"], r["misranked"] = int(b), a != b
    return {
        "hardware": chip.name,
        "compiled_for": topology.name if topology else None,
        "layouts": rows,
        "memory_agrees": all(r["planner_fits"] == r["compiled_fits"] for r in rows),
        "spearman": spearman(pred, meas) if ran else None,
        "kendall": kendall(pred, meas) if ran else None,
    }


# One-tailed 5% critical values of Spearman's rank correlation for n ranked pairs (J. H. Zar, 'Significance testing
# of the Spearman rank correlation coefficient', J. Am. Stat. Assoc. 67 (1972), Table 1): below it, a positive
# correlation of so few layouts is within what chance orderings give.
SPEARMAN_CRITICAL = {4: 1.0, 5: 0.900, 6: 0.829, 7: 0.714, 8: 0.643, 9: 0.600, 10: 0.564}
BYTES_BAND = (0.8, 1.25)  # XLA's bytes over the planner's, inside which the two memory figures agree


def memory_words(data: dict[str, Any]) -> str:
    """The fits verdicts and how far the bytes agree: verdicts can agree while the bytes differ 2x, when every
    layout sits far below the chip's memory."""
    ratios = [
        r["compiled_memory_bytes"] / r["planner_memory_bytes"] for r in data["layouts"] if r["planner_memory_bytes"]
    ]
    verdict = "agree" if data["memory_agrees"] else "DISAGREE"
    text = f"memory (planner against XLA's memory analysis): fits verdicts {verdict}"
    if not ratios:
        return text
    lo, hi = min(ratios), max(ratios)
    text += f"; XLA holds {lo:.2f}-{hi:.2f}x the planner's bytes"
    if lo < BYTES_BAND[0] or hi > BYTES_BAND[1]:
        text += f", outside [{BYTES_BAND[0]}, {BYTES_BAND[1]}]: the bytes do not agree" + (
            ", only the verdicts (every layout is far from the chip's memory)" if data["memory_agrees"] else ""
        )
    return text


def rank_words(data: dict[str, Any]) -> str | None:
    """Spearman's and Kendall's correlations with what they can say for this many layouts and this spread."""
    s, k = data["spearman"], data["kendall"]
    if s is None:
        return None
    meas = [r["measured_step_s"] for r in data["layouts"]]
    n, spread = len(meas), max(meas) / min(meas)
    noise = sorted(r["measured_spread"] for r in data["layouts"] if r.get("measured_spread"))
    crit = SPEARMAN_CRITICAL.get(n)
    text = f"rank correlation, estimated against measured: Spearman {s:.2f}, Kendall {k:.2f}: "
    if crit is not None and s >= crit:
        text += f"the estimate orders the layouts as measured (at or above {crit:.2f}, the 5% critical value for {n})"
    elif s > 0:
        text += f"no evidence of order: below {crit:.2f}, the 5% critical value for {n} layouts" if crit else "weak"
    else:
        text += "the estimate does not order the layouts as measured"
    if noise and spread < noise[len(noise) // 2]:  # the layouts differ less than one layout's repeats do
        text += (
            f"; the layouts' measured steps lie within {spread:.2f}x of each other, less than a layout's own repeats "
            f"differ (median {noise[len(noise) // 2]:.2f}x), so their order is mostly noise"
        )
    return text


def table(data: dict[str, Any]) -> str:
    rows = [
        [
            r.get("predicted_rank", i + 1),
            r.get("measured_rank", "-"),
            r["layout"],
            fmt_seconds(r["estimated_step_s"]),
            fmt_seconds(r["measured_step_s"]) if r["measured_step_s"] is not None else "-",
            f"{fmt_bytes(r['planner_memory_bytes'])} / {fmt_bytes(r['compiled_memory_bytes'])}",
            ("fits" if r["planner_fits"] else "NO") + " / " + ("fits" if r["compiled_fits"] else "NO"),
            r["worst_op"] if r.get("misranked") else "",
        ]
        for i, r in enumerate(data["layouts"])
    ]
    where = f"compiled for TPU {data['compiled_for']} (nothing ran)" if data["compiled_for"] else "run on this host"
    text = render(
        ["est. rank", "meas. rank", "layout", "estimated", "measured", "memory planner / XLA", "fits", "misranked by"],
        rows,
        title=f"the planner's best executable layouts, {where}, priced on {data['hardware']}",
    )
    for r in data["layouts"]:
        if r["planner_schedule"] is not None:
            text += (
                f"\n{r['layout'].split(',')[0]}: priced as the lab runs it; the planner's {r['planner_schedule']} "
                f"estimate is {fmt_seconds(r['planner_step_s'])}"
            )
    text += "\n" + memory_words(data)
    words = rank_words(data)
    return text + (f"\n{words}" if words else "")


__all__ = [
    "CALLS",
    "RUN_SCHEDULE",
    "as_run",
    "candidates",
    "executable",
    "kendall",
    "spearman",
    "table",
    "to_plan",
    "validate_plan",
]
