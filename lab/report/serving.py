"""A ``serve`` run's load in its report: measured (the engine) beside predicted (the scheduler on the estimate of a
step), as a table in ``report.md`` and ``serving.png`` (each request's TTFT and TPOT against its arrival, and the
KV pool over the run)."""

from __future__ import annotations

from typing import Any

from lab.core.table import render
from lab.core.units import fmt_seconds

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end-to-end", "e2e_s"))


def _ratio(measured: float | None, predicted: float | None) -> str:
    return "-" if not measured or predicted is None else f"{measured / predicted:.2f}"


def table(serving: dict[str, Any]) -> str:
    m, p = serving["measured"], serving["predicted"]
    rows = []
    for label, key in LATENCIES:
        for q in ("mean", "p50", "p90", "p99"):
            a, b = m[key][q], p[key][q]
            rows.append(
                [
                    f"{label} {q}",
                    "-" if a is None else fmt_seconds(a),
                    "-" if b is None else fmt_seconds(b),
                    _ratio(a, b),
                ]
            )
    rows.append(
        [
            "throughput",
            f"{m['throughput_tokens_per_s']:,.0f} tok/s",
            f"{p['throughput_tokens_per_s']:,.0f} tok/s",
            _ratio(m["throughput_tokens_per_s"], p["throughput_tokens_per_s"]),
        ]
    )
    rows.append(["steps", f"{m['steps']:,}", f"{p['steps']:,}", _ratio(m["steps"], p["steps"])])
    rows.append(["preemptions", str(m["preemptions"]), str(p["preemptions"]), "-"])
    rows.append(["KV pool peak", f"{m['kv_pool_peak_fraction']:.0%}", f"{p['kv_pool_peak_fraction']:.0%}", "-"])
    return render(["", "measured", "predicted", "measured/predicted"], rows)


def markdown(serving: dict[str, Any]) -> list[str]:
    """The report's serving section."""
    s = serving["step_s"]
    load = serving["load"]
    how = (
        f"Poisson {load['rate']:g} requests/s"
        if "rate" in load
        else (f"{load['concurrency']} clients" if "concurrency" in load else f"from {load['trace']}")
    )
    measured_step = s["measured_median"]
    return [
        "## Serving under load: measured | predicted",
        "",
        f"{load['requests']} requests ({how}; prompts {load['prompt_len']}, outputs {load['output_len']} tokens, seed "
        f"{load['seed']}) through the engine (measured: each step's wall time, packing to reading back) and through "
        "the same scheduler priced per step (predicted: the estimate of one step, every slot computed, plus the "
        "host's work per step measured apart from the model)"
        + (": **emulated**, priced on this host's calibrated spec." if serving["emulated"] else "."),
        "",
        f"Step: predicted {fmt_seconds(s['predicted'])} = device {fmt_seconds(s['estimated_device'])} + host "
        f"{fmt_seconds(s['host_overhead'])}; measured median "
        + ("-" if measured_step is None else fmt_seconds(measured_step))
        + ".",
        "",
        "```",
        table(serving),
        "```",
        "",
        "Each request's times: `report.json` serving.requests; plot: `serving.png`.",
        "",
    ]


def figure(serving: dict[str, Any], tag: str):
    """Each request's TTFT and TPOT, measured and predicted, against its arrival; the KV pool's use over the run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 8), dpi=100)
    ttft_ax, tpot_ax, pool_ax = fig.subplots(3, 1, sharex=True)
    rows = serving["requests"]
    arrival = [r["arrival_s"] for r in rows]
    for ax, key, label in ((ttft_ax, "ttft_s", "TTFT (ms)"), (tpot_ax, "tpot_s", "TPOT (ms)")):
        for which, colour, marker in (("measured", "#4c72b0", "o"), ("predicted", "#dd8452", "x")):
            pts = [(a, r[key][which] * 1e3) for a, r in zip(arrival, rows, strict=True) if r[key][which] is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=14, marker=marker, color=colour, label=which)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.25 * max([*ax.get_ylim()[1:], 1e-9]))  # room above the highest point for the legend
        ax.grid(alpha=0.3)
    ttft_ax.legend(loc="upper left", frameon=False, ncol=2)
    for which, colour in (("measured", "#4c72b0"), ("predicted", "#dd8452")):
        trace = serving["pool_trace"][which]
        if trace:
            ts, used = zip(*trace, strict=True)
            pool_ax.plot(ts, [100 * u for u in used], color=colour, lw=1.0, drawstyle="steps-post", label=which)
    pool_ax.set_ylabel("KV pool in use (%)")
    pool_ax.set_ylim(0, 105)
    pool_ax.set_xlabel("seconds since the first arrival (each request at its arrival)")
    pool_ax.grid(alpha=0.3)
    ttft_ax.set_title(f"serving under load: measured vs predicted per request{tag}")
    fig.subplots_adjust(left=0.08, right=0.98, top=0.95, bottom=0.07, hspace=0.1)
    return fig


__all__ = ["figure", "markdown", "table"]
