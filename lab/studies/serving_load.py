"""``shardlab infer serve``: a load of requests on one deployment, simulated (lab.predict.inference.serve), read as
serving benchmarks report it: TTFT, TPOT and end-to-end percentiles, throughput, the KV pool's use over time; the
highest rate that meets a latency target; the deployment with the fewest chips that holds a rate.

A load the deployment cannot keep up with (a Poisson rate above what it completes with every request already
waiting) is reported as unbounded queueing: over a longer run its TTFT grows without limit, so no percentile of a
finite run means anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.serving import Lengths, PoolConfig, Request, Served, poisson_requests, summarize
from lab.core.table import render
from lab.core.units import fmt_seconds
from lab.predict.inference.allreduce import priced_allreduce
from lab.predict.inference.estimate import InferConfig
from lab.predict.inference.serve import MEMORY_UTILIZATION, Slo, capacity_rps, max_rate, pool_for, simulate

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end-to-end", "e2e_s"))


@dataclass(frozen=True)
class Load:
    """What arrives: a Poisson ``rate`` (or ``concurrency`` clients one request at a time, or a ``trace``)."""

    requests: int
    prompt: Lengths
    output: Lengths
    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0
    trace: tuple[Request, ...] | None = None

    def make(self, rate: float | None = None) -> list[Request]:
        if self.trace is not None:
            return list(self.trace)
        r = rate if rate is not None else (self.rate if self.rate is not None else math.inf)
        return poisson_requests(self.requests, r, self.prompt, self.output, self.seed)

    def describe(self) -> str:
        if self.trace is not None:
            return f"{len(self.trace)} requests from a trace"
        how = (
            f"{self.concurrency} clients, one request each at a time"
            if self.concurrency
            else f"Poisson {self.rate:g} requests/s"
        )
        return f"{how}; prompt {self.prompt}, output {self.output} tokens; {self.requests} requests (seed {self.seed})"


@dataclass
class ServeResult:
    cfg: InferConfig
    load: Load
    pool: PoolConfig
    summary: dict[str, Any]
    served: Served
    capacity_rps: float
    overloaded: bool
    slo: Slo | None = None
    max_rate: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        c = self.cfg
        d: dict[str, Any] = {
            "model": c.model.name,
            "hardware": c.chip.name,
            "chips": c.chips,
            "tp": c.tp,
            "dp": c.dp,
            "ep": c.ep,
            "weights": c.weights,
            "kv": c.kv,
            "load": self.load.describe(),
            "rate": self.load.rate,
            "concurrency": self.load.concurrency,
            "pool": dataclasses.asdict(self.pool) | {"memory_utilization": MEMORY_UTILIZATION},
            "step_overhead_s": c.step_overhead_s,
            "tp_allreduce": priced_allreduce(c) if c.tp > 1 else None,
            "attention_dp": c.attention_dp,
            "capacity_rps": self.capacity_rps,
            "overloaded": self.overloaded,
            "queueing": "unbounded" if self.overloaded else "bounded",
            "emulated": c.chip.kind == "cpu",
        } | self.summary
        if self.overloaded:
            d |= {key: {q: None for q in d[key]} for key in ("ttft_s", "e2e_s")}
        if self.slo is not None:
            d |= {"slo": str(self.slo), "max_rate_meeting_slo": self.max_rate}
        if self.candidates:
            d["search"] = self.candidates
        return d

    def table(self) -> str:
        c, s = self.cfg, self.summary
        head = (
            f"{c.model.name} on {c.chips} x {c.chip.name} (tp={c.tp} dp={c.dp} ep={c.ep}), achievable efficiency\n"
            f"load: {self.load.describe()}\n"
            f"KV pool per replica: {self.pool.pages:,} pages of {self.pool.page_size} tokens "
            f"({MEMORY_UTILIZATION:.0%} of memory less the weights); {self.pool.token_budget} tokens a step, at most "
            f"{self.pool.max_seqs} sequences"
        )
        rows = []
        for label, key in LATENCIES:
            cut = self.overloaded and key != "tpot_s"
            rows.append([label, *("unbounded" if cut else _secs(s[key][q]) for q in ("mean", "p50", "p90", "p99"))])
        lines = [head, "", render(["latency", "mean", "p50", "p90", "p99"], rows)]
        lines.append(
            f"throughput {s['throughput_tokens_per_s']:,.0f} output tokens/s; KV pool peak "
            f"{s['kv_pool_peak_fraction']:.1%}; {s['preemptions']} preemptions; {s['steps']:,} steps"
        )
        lines.append(f"capacity: {self.capacity_rps:.3g} requests/s with every request waiting")
        if self.overloaded:
            lines.append(
                f"OVERLOADED: {self.load.rate:g} requests/s is above that capacity; the queue grows without bound, "
                "so TTFT and end-to-end latency have no steady value (a longer run only waits longer)"
            )
        if self.slo is not None:
            best = "no rate" if self.max_rate is None else f"{self.max_rate:.3g} requests/s"
            lines.append(f"highest Poisson rate meeting {self.slo}: {best}")
        if self.candidates:
            lines += ["", _search_table(self.candidates, self.slo)]
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """The KV pool's use over the run (the fullest replica's), and each request's TTFT at its arrival."""
        from matplotlib.figure import Figure

        path = Path(path)
        fig = Figure(figsize=(10, 6.5), dpi=100)
        top, bottom = fig.subplots(2, 1, sharex=True)
        ts, used = zip(*self.served.pool_trace, strict=True) if self.served.pool_trace else ((), ())
        top.plot(ts, [100 * u for u in used], color="#4c72b0", lw=1.0, drawstyle="steps-post")
        top.set_ylabel("KV pool in use (%)")
        top.set_ylim(0, 105)
        top.set_title(f"{self.cfg.model.name} on {self.cfg.chips} x {self.cfg.chip.name}: {self.load.describe()}")
        arrivals = [q.req.arrival_s for q in self.served.seqs]
        ttft = [(q.first_token_s - q.req.arrival_s) * 1e3 for q in self.served.seqs]
        bottom.scatter(arrivals, ttft, s=6, color="#dd8452", label="TTFT of each request")
        bottom.set_ylabel("TTFT (ms)")
        bottom.set_xlabel("time since the first arrival (s)")
        if self.slo is not None:
            for name, t in self.slo.targets:
                if name == "ttft":
                    bottom.axhline(t * 1e3, color="#c44e52", ls="--", lw=1, label=f"SLO {t * 1e3:g} ms")
        targets = [t * 1e3 for name, t in (self.slo.targets if self.slo else ()) if name == "ttft"]
        bottom.set_ylim(0, 1.3 * max([*ttft, *targets, 1e-3]))  # room above the highest point for the legend
        bottom.legend(loc="upper left", frameon=False)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        fig.subplots_adjust(left=0.09, right=0.98, top=0.93, bottom=0.08, hspace=0.08)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def _secs(x: float | None) -> str:
    return "-" if x is None else fmt_seconds(x)


def serve(cfg: InferConfig, load: Load, pool: PoolConfig | None = None, slo: Slo | None = None) -> ServeResult:
    """Simulate ``load`` on ``cfg``; with ``slo`` also the highest Poisson rate that meets it."""
    pool = pool or pool_for(cfg)
    cap_n = min(load.requests, 1000) if load.trace is None else len(load.trace)
    capacity = capacity_rps(cfg, load.prompt, load.output, pool, cap_n, load.seed)
    requests = load.make()
    served = simulate(cfg, requests, pool, concurrency=load.concurrency)
    overloaded = load.concurrency is None and load.trace is None and load.rate is not None and load.rate > capacity
    best = None
    if slo is not None:
        best = max_rate(cfg, slo, load.prompt, load.output, pool, load.requests, load.seed, capacity)
    return ServeResult(cfg, load, pool, summarize(served), served, capacity, overloaded, slo, best)


def search(
    base: InferConfig, load: Load, slo: Slo, max_chips: int, pool_of=pool_for
) -> tuple[ServeResult | None, list[dict[str, Any]]]:
    """Every deployment of 1, 2, 4, ... ``max_chips`` chips (tensor parallel inside a replica, data-parallel
    replicas) under ``load``: the one with the fewest chips that meets ``slo`` (then the lowest p-latency), and a
    row for each."""
    m = base.model
    rows, best, best_key = [], None, None
    n = 1
    while n <= max_chips:
        for tp in (d for d in range(1, n + 1) if n % d == 0 and m.heads % d == 0):
            cfg = dataclasses.replace(base, tp=tp, dp=n // tp, ep=1, batch=n // tp)
            row: dict[str, Any] = {"chips": n, "tp": tp, "dp": n // tp}
            try:
                result = serve(cfg, load, pool_of(cfg))
            except UserError as exc:  # a layout that cannot hold the model or a request: said in its row
                rows.append(row | {"meets_slo": False, "why": str(exc).split(";")[0]})
                continue
            s = result.summary
            missed = slo.missed(s)
            ok = not result.overloaded and not missed
            key = f"p{slo.percentile}"
            row |= {
                "meets_slo": ok,
                "ttft_s": None if result.overloaded else s["ttft_s"][key],
                "tpot_s": s["tpot_s"][key],
                "capacity_rps": result.capacity_rps,
                "why": "overloaded" if result.overloaded else ("" if ok else f"misses {', '.join(missed)}"),
            }
            rows.append(row)
            rank = (n, row["ttft_s"] or math.inf)
            if ok and (best_key is None or rank < best_key):
                best, best_key = result, rank
        n *= 2
    return best, rows


def _search_table(rows: list[dict[str, Any]], slo: Slo | None) -> str:
    pct = f"p{slo.percentile}" if slo else "p90"
    body = [
        [
            r["chips"],
            r["tp"],
            r["dp"],
            _secs(r.get("ttft_s")),
            _secs(r.get("tpot_s")),
            f"{r['capacity_rps']:.3g}" if r.get("capacity_rps") else "-",
            "yes" if r["meets_slo"] else f"no: {r['why']}",
        ]
        for r in rows
    ]
    return render(["chips", "tp", "dp", f"TTFT {pct}", f"TPOT {pct}", "capacity req/s", "meets SLO"], body)


__all__ = ["LATENCIES", "Load", "ServeResult", "search", "serve"]
