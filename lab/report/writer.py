"""Run reports: markdown, JSON and CSV of the ledger (estimated | predicted | compiled | measured per op).

Two tables: the **named ops** (the estimator's ops, each joined to the compiled and measured HLO ops of its named
scope or, for collectives, of its audit entry) and the **HLO ops** (every executed op, its roofline and its
measured time). The plots are in :mod:`lab.report.plots`.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from lab.core.collective_kinds import is_collective
from lab.core.paths import runnable
from lab.core.table import dumps, render
from lab.core.units import fmt_bytes, fmt_count, fmt_seconds
from lab.report.plots import BAND
from lab.report.trust import spec_words, verdict, verdict_words

BAND_WIDTH = BAND[1] / BAND[0]
GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "glossary.md"  # the words and marks the reports use

CSV_KEYS = (
    "name",
    "kind",
    "estimate_op",
    "predicted_s",
    "measured_s",
    "ratio",
    "spread",
    "flops",
    "bytes",
    "collective_bytes",
    "scope",
)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """Every op, heaviest measured first as in the ledger (ops never measured last, in HLO order)."""
    ordered = sorted(rows, key=lambda r: -(r.get("measured_s") or 0.0))  # stable: ties keep HLO order
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_KEYS), extrasaction="ignore")
        w.writeheader()
        for r in ordered:
            w.writerow(r)


def _s(x: float | None) -> str:
    return fmt_seconds(x) if x is not None else "-"


_TRACE_WORDS = ("while", "body", "cond", "closed_call", "branch", "checkpoint", "remat", "rematted_computation")


def where_in_program(row: dict[str, Any], width: int = 30) -> str:
    """What an HLO op belongs to, in the program's words: the estimator's named op it was joined to, else the named
    scopes of its source (``attention/rope/pow`` out of ``jit(step)/while/body/closed_call/attention/rope/vmap()/pow``:
    JAX's tracing layers left out), else ``-``."""
    if row.get("estimate_op"):
        text = row["estimate_op"]
    else:
        parts = [p for p in (row.get("scope") or "").split("/") if p and "(" not in p and p not in _TRACE_WORDS]
        text = "/".join(parts[-3:]) or "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def ledger_table(rows: list[dict[str, Any]], limit: int = 25) -> str:
    """The ledger's heaviest HLO rows by measured time (then predicted), each with the named op or scope it is
    part of (an HLO name alone says nothing of where in the program it sits)."""

    def key(r):
        return -(r["measured_s"] or 0.0), -(r["predicted_s"] or 0.0)

    shown = sorted(rows, key=key)[:limit]
    body = [
        [
            r["name"],
            where_in_program(r),
            r["kind"],
            _s(r["predicted_s"]),
            _s(r["measured_s"]),
            f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
            _spread(r.get("spread")) if r["measured_s"] else "-",
            fmt_bytes(r["collective_bytes"] or r["bytes"]) if (r["collective_bytes"] or r["bytes"]) else "-",
        ]
        for r in shown
    ]
    head = ["op", "in the program", "kind", "predicted", "measured", "measured/predicted", "spread", "bytes"]
    return render(head, body)


def _spread(x: float | None) -> str:
    """An op's spread over the repeats (its slowest over its fastest), marked ``!`` past the band's width: its own
    times then differ more than the ratio is judged by."""
    if x is None:
        return "-"
    return f"{x:.2f}x" + (" !" if x > BAND_WIDTH else "")


def named_table(named: list[dict[str, Any]], limit: int = 25) -> str:
    """One row per estimator op: estimated, the roofline of its compiled ops, measured, and FLOPs both ways."""
    shown = sorted(named, key=lambda n: -(n["measured_s"] or n["estimated_s"] or 0.0))[:limit]
    body = []
    for n in shown:
        est_w = n["flops_estimated"] or n["bytes_estimated"]
        got_w = n["flops_compiled"] if n["flops_estimated"] else n["bytes_compiled"]
        unit = "" if n["flops_estimated"] else "B"
        work = f"{fmt_count(est_w)}{unit} / {fmt_count(got_w)}{unit}" if est_w or got_w else "-"
        body.append(
            [
                n["name"] if len(n["name"]) <= 48 else n["name"][:45] + "...",
                n["kind"],
                _s(n["estimated_s"]),
                _s(n["predicted_s"]) if n["hlo_ops"] else "-",
                _s(n["measured_s"]),
                f"{n['ratio']:.2f}" if n["ratio"] is not None else "-",
                work,
                str(n["hlo_ops"]),
            ]
        )
    headers = ["named op", "kind", "estimated", "predicted", "measured", "meas/est", "work est / compiled", "HLO ops"]
    text = render(headers, body)
    lost = [n["name"] for n in shown if n["flops_estimated"] and not n["flops_compiled"]]
    if lost:  # e.g. libtpu fuses mlp/up's matmul into the fusion named for the gate's: the work moved, not vanished
        text += (
            f"\n(work compiled 0 for {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}: no compiled op carries "
            "that scope's name, since XLA fused its matmul into an op named for another scope, whose compiled work "
            "holds it; the audit compares the program's totals)"
        )
    return text


FAR = 3.0  # an elementwise op measured this many times its roofline or more gets the note below
LEDGER_ROWS = 25


def routing_line(r: dict[str, Any]) -> str:
    """The MoE router's load in one line (kernels.moe.load_report)."""
    where = f"layer {r['layer']}: " if "layer" in r else ""  # the Transformer's first expert layer
    return (
        f"{where}{len(r['routed'])} experts, {r['capacity']} slots each in every one of {r['groups']} token groups; "
        f"load imbalance {r['imbalance']:.2f} (the busiest expert's assignments over the mean); "
        f"{r['dropped']} assignments dropped ({100 * r['dropped_fraction']:.1f}%)"
    )


def bubble_line(b: dict[str, Any]) -> str:
    """The pipeline bubble in one line (lab.measure.bubble.measure)."""
    stages = ", ".join("-" if f is None else f"{100 * f:.0f}%" for f in b["per_stage"])
    return (
        f"{100 * b['measured']:.1f}% of the stages' compute went to steps with no work (measured, by stage: "
        f"{stages}); the schedule's (p - 1) / steps = {b['stages'] - 1}/{b['steps']} = {100 * b['predicted']:.1f}%"
    )


def _likely(interval: list[float] | None) -> str:
    """``, likely 5.9-7.9 ms (80%)``; nothing where the estimate has no interval (an emulated host's)."""
    if not interval:
        return ""
    return f", likely {_s(interval[0])}-{_s(interval[1])} (80%)"


def compiled_where(report: dict[str, Any]) -> str:
    """``cross-compiled for v5e:2x4`` or ``compiled only``: what a run that measured nothing did instead."""
    target = report.get("compiled_for")
    return f"cross-compiled for {target['topology']}" if target else "compiled only"


def trust_of(report: dict[str, Any]) -> dict[str, Any]:
    """The run's trust verdict (``summary.trust``), or, for a report written before runs recorded one, the verdict
    of its summary."""
    summary = report["summary"]
    return summary.get("trust") or verdict(summary, BAND_WIDTH, bool(report.get("compile_only")))


def _coverage(report: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """How much of the measured time the predictions cover, and the large ops' ratio; a compiled-only run says that
    nothing ran (not "coverage 0%")."""
    if report.get("compile_only"):
        return [f"- measured: nothing ({compiled_where(report)}: nothing ran, so there is no coverage and no ratio)"]
    ratio = summary["median_ratio_large"]
    return [
        f"- coverage: {100 * report['coverage']:.1f}% of measured op time is in predicted ops"
        + (
            f"; {100 * report['estimate_coverage']:.1f}% of measured matmul and collective time in estimated ops"
            if report.get("estimate_coverage") is not None
            else ""
        ),
        f"- ops of at least 1 MB: median measured/predicted {f'{ratio:.2f}' if ratio is not None else 'none'} "
        f"over {summary['ops_large']} ops",
    ]


def _facts(report: dict[str, Any]) -> list[str]:
    """The run in bullets: where, which spec, the three step times, coverage, ratios, trust, the audit."""
    hw, summary = report["hardware"], report["summary"]
    audit = report["audit"].get("all_match")
    lines = [
        f"- backend: {report['backend']} ({report['devices']} devices), mesh "
        f"{','.join(f'{k}={v}' for k, v in report['mesh'].items())}",
        f"- hardware spec: {spec_words(hw)}",
        f"- step time: measured {_s(report['step_time_measured_s'])}, estimated "
        f"{_s(report['step_time_estimated_s'])}{_likely(report.get('step_time_estimated_interval_s'))} (the "
        f"estimator, from the Plan), predicted {_s(report['step_time_predicted_s'])} (roofline of the compiled ops)",
        *_coverage(report, summary),
    ]
    if report.get("routing"):
        lines.append(f"- routing: {routing_line(report['routing'])}")
    if report.get("pipeline_bubble"):
        lines.append(f"- pipeline bubble: {bubble_line(report['pipeline_bubble'])}")
    trust = trust_of(report)
    lines.append(f"- trust: {verdict_words(trust)}")
    if trust["verdict"] == "UNSTEADY":
        lines.append(
            "- **UNSTEADY**: read this run's measured/predicted ratios as noise (the band a ratio is judged by is "
            f"{BAND_WIDTH:.2f}x wide), and run it again on a quieter host"
        )
    lines.append(
        f"- audit against the estimate: {'all match' if audit else ('MISMATCH' if audit is False else 'none')}"
    )
    return [*lines, ""]


def _elementwise_note(report: dict[str, Any]) -> list[str]:
    """Why elementwise ops far from their roofline on emulated devices are not a model error (when there are any)."""
    far = [r for r in report["ops"] if r["kind"] == "elementwise" and r["ratio"] and r["ratio"] >= FAR]
    if not far or not report["emulated"]:
        return []
    return [
        f"{len(far)} elementwise ops ran {FAR:g}x or more their roofline. The roofline prices their bytes at the "
        "calibrated bandwidth; on emulated devices each device's fusions run on one host thread among "
        f"{report['devices']} device threads sharing the host's cores, so a small op also pays for thread "
        "scheduling and dispatch, which no roofline sees. They are left out of the ratio of ops of 1 MB or more.",
        "",
    ]


def _processes(report: dict[str, Any]) -> list[str]:
    """The processes of a multi-process run: where each ran, its median step, the slowest one's ledger."""
    procs = report.get("processes")
    if not procs:
        return []
    rows = [
        [
            str(p["rank"]),
            p["host"],
            str(p["local_devices"]),
            fmt_seconds(p["step_time_measured_s"] or 0.0),
            p.get("tensorboard") or "-",
        ]
        for p in procs
    ]
    lines = [
        f"## Processes ({len(procs)}; the ledger's measured times are process {report['slowest_process']}'s, the "
        "slowest)",
        "",
        "```",
        render(["rank", "host", "devices", "median step", "trace"], rows),
        "```",
        "",
    ]
    if report["emulated"]:
        lines += [
            "Between emulated processes every collective goes through gloo on loopback, not the in-process copies "
            "the host was calibrated on: their ratios describe this laptop's sockets, not DCN.",
            "",
        ]
    return lines


def _tools(report: dict[str, Any]) -> list[str]:
    """The TensorBoard section: a link per profile tool, and why a tool is empty on emulated devices."""
    links = report.get("tensorboard_tools") or []
    if not links:
        return []
    lines = ["", "## TensorBoard", "", f"`{runnable('tensorboard')} --logdir {report['tensorboard']}`, then:", ""]
    module = report.get("hlo_module")
    for t in links:
        empty = f": empty here, {t['empty_on_cpu']}" if t.get("empty_on_cpu") else ""
        pick = (
            f": pick the module `{module}` in its Modules menu (it shows nothing until one is picked)"
            if module and t["tool"] in ("memory_viewer", "graph_viewer")
            else ""
        )
        lines.append(f"- [{t['name']}]({t['url']}){empty}{pick}")
    if report.get("perfetto_trace") and report.get("perfetto_device_tracks"):
        lines += [
            "",
            f"The trace viewer's threads are XLA:CPU's workers (`tf_XLAEigen/...`), which no device owns: the "
            f"Perfetto copy, `{report['perfetto_trace']}` (open it at ui.perfetto.dev), adds the process "
            f'"{report["perfetto_device_tracks"]}" with one track per emulated device.',
        ]
    if any(t.get("empty_on_cpu") for t in links):
        lines += [
            "",
            "Where a tool is empty here, the lab's own view has the same facts: the ledger above (per-op times "
            "against their roofline), `roofline.png` and `breakdown.png`, and `ops.csv`.",
        ]
    return lines


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    title = (
        report["experiment"]
        if report["run_id"] == report["experiment"]
        else f"{report['experiment']}: {report['run_id']}"
    )
    lines = [f"# {title}", ""]
    if report["emulated"]:
        lines += [
            "**Emulated**: these timings come from CPU devices emulated on one host; the interconnect is memory "
            "copies between threads. Structure (shardings, collectives, bytes, FLOPs) is exact; timings are "
            f"compared against a spec {'calibrated on this host' if hw.get('calibrated') else 'NOT calibrated'}.",
            "",
        ]
    lines += _facts(report) + _processes(report)
    if report.get("estimated_ops"):
        lines += [
            "## Named ops: estimated | predicted | measured",
            "",
            "Each estimator op joined to the compiled ops of its named scope (collectives: the ones the audit "
            "matched to it). Work: FLOPs (compute) or bytes (collectives), estimated / compiled.",
            "",
            "```",
            named_table(report["estimated_ops"]),
            "```",
            "",
        ]
    shown = min(LEDGER_ROWS, len(report["ops"]))
    lines += [
        "## Ledger (HLO ops)",
        "",
        "Measured: each op's own time (rendezvous waits excluded) on its slowest device, median over the repeats; "
        f"spread: its slowest repeat over its fastest, `!` past {BAND_WIDTH:.2f}x (the band's width: its own times "
        "then differ more than its ratio is judged by)"
        + (
            f"; the {shown} heaviest of {len(report['ops'])} ops, all in `ops.csv`."
            if shown < len(report["ops"])
            else "."
        )
        + " The ops' times may add up to more than the step: each is timed on its own slowest device, and ops on "
        f"different devices run at the same time. Every word and mark here: {GLOSSARY}.",
        "",
        "```",
        ledger_table(report["ops"], limit=LEDGER_ROWS),
        "```",
        "",
        *_elementwise_note(report),
        "Plots: `roofline.png`, `predicted_vs_measured.png`, `breakdown.png`."
        + (
            f" Trace: `{runnable('tensorboard')} --logdir {report['tensorboard']}`."
            if report.get("tensorboard")
            else ""
        ),
        "",
    ]
    if report.get("serving"):
        from lab.report import serving

        lines += serving.markdown(report["serving"])
    lines += _tools(report)
    return "\n".join(lines)


def _part(kind: str) -> str:
    if is_collective(kind):
        return "communication"
    return "compute" if kind in ("matmul", "attention") else "other"


def breakdown(rows: list[dict[str, Any]], named: list[dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """Sum of op times by compute (matmul, attention), communication (collectives), other: measured and predicted
    per HLO op, estimated per named op."""
    out = {s: {"compute": 0.0, "communication": 0.0, "other": 0.0} for s in ("measured", "predicted", "estimated")}
    for r in rows:
        if r["measured_s"]:
            out["measured"][_part(r["kind"])] += r["measured_s"]
        if r["predicted_s"]:
            out["predicted"][_part(r["kind"])] += r["predicted_s"]
    for n in named or []:
        out["estimated"][_part(n["kind"])] += n["estimated_s"] or 0.0
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def write_reports(report: dict[str, Any], out: Path) -> list[str]:
    """The text reports: ``report.json``, ``ops.csv`` and ``report.md``."""
    (out / "report.json").write_text(dumps(report))
    write_csv(report["ops"], out / "ops.csv")
    (out / "report.md").write_text(markdown(report))
    return ["report.json", "ops.csv", "report.md"]


def write_all(report: dict[str, Any], out: Path, timings=None) -> list[str]:
    """The plots, then the text reports (``report.json`` last but one: with ``timings()``, what every phase took,
    writing the reports included as far as it can be), then ``ops.csv`` and ``report.md``."""
    from lab.report.plots import plots

    drawn = plots(report, out)
    if timings is not None:
        report["timings"] = timings()
    return [*write_reports(report, out), *drawn]


__all__ = [
    "breakdown",
    "bubble_line",
    "ledger_table",
    "markdown",
    "median",
    "named_table",
    "routing_line",
    "write_all",
    "write_reports",
]
