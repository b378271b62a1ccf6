"""Benchmark of serving under load: the simulator's speed, and the executed engine against the simulator.

``scripts/bench_serve`` times the simulator (:func:`lab.predict.inference.serve.simulate`) on 10,000 requests of
Llama 3 8B on one H100 (prompts 100-900, outputs 10-200 tokens) at three loads: every request waiting, 20 and 5
requests/s (more, shorter steps), ``--repeat`` times each (median; the issue's target: under 2 s on one core).
``--runs N`` also runs ``experiments/serve_tp.toml`` N times (each a fresh process: ``shardlab run``) and prints,
for each, the engine's measured p50 TTFT and TPOT beside the simulator's for the same requests on this host's
calibrated spec (emulated), with the medians of the ratios. ``--json`` prints one JSON object. A benchmark, not a
test: nothing here asserts a speed or an agreement; the host's load is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the lab, run as a script from anywhere

from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.serving import Lengths, poisson_requests
from lab.core.table import render
from lab.predict.inference.estimate import InferConfig
from lab.predict.inference.serve import pool_for, simulate

ROOT = Path(__file__).resolve().parent.parent
RATES = (math.inf, 20.0, 5.0)
REQUESTS = 10_000


def simulator(repeat: int) -> list[dict[str, Any]]:
    cfg = InferConfig(model=get_model("llama3-8b"), chip=get_chip("h100"), batch=1, context=4096, achievable=True)
    pool = pool_for(cfg)
    out = []
    for rate in RATES:
        reqs = poisson_requests(REQUESTS, rate, Lengths(100, 900), Lengths(10, 200), seed=3)
        times, steps = [], 0
        for _ in range(repeat):
            t0 = time.process_time()  # one core's CPU time: the simulator is single-threaded
            served = simulate(cfg, reqs, pool)
            times.append(time.process_time() - t0)
            steps = served.steps
        out.append({"rate": rate, "requests": REQUESTS, "steps": steps, "cpu_s": statistics.median(times)})
    return out


def engine_runs(n: int) -> list[dict[str, Any]]:
    exp = ROOT / "experiments" / "serve_tp.toml"
    out = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [str(ROOT / ".venv" / "bin" / "shardlab"), "run", str(exp), "--out", tmp, "--quiet"]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            s = json.loads((Path(tmp) / "serve_tp" / "report.json").read_text())["serving"]
        m, p = s["measured"], s["predicted"]
        out.append(
            {
                "run": i + 1,
                "load": os.getloadavg()[0],
                **{f"{k}_p50_measured": m[f"{k}_s"]["p50"] for k in ("ttft", "tpot")},
                **{f"{k}_p50_predicted": p[f"{k}_s"]["p50"] for k in ("ttft", "tpot")},
                "step_measured": s["step_s"]["measured_median"],
                "step_predicted": s["step_s"]["predicted"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="simulations of each load (median)")
    ap.add_argument("--runs", type=int, default=0, help="runs of experiments/serve_tp.toml (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.runs < 0:
        ap.error("--repeat must be at least 1 and --runs at least 0")
    sim = simulator(args.repeat)
    runs = engine_runs(args.runs)
    data = {"load_before": os.getloadavg()[0], "cpus": os.cpu_count(), "simulator": sim, "engine": runs}
    if runs:
        for k in ("ttft", "tpot"):
            data[f"{k}_p50_measured_over_predicted"] = statistics.median(
                r[f"{k}_p50_measured"] / r[f"{k}_p50_predicted"] for r in runs
            )
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    rows = [
        [
            ("all waiting" if math.isinf(r["rate"]) else f"{r['rate']:g}/s"),
            f"{r['requests']:,}",
            f"{r['steps']:,}",
            f"{r['cpu_s']:.2f} s",
        ]
        for r in sim
    ]
    print(render(["load", "requests", "steps", "CPU time (median)"], rows, title="simulator: llama3-8b on 1 x h100"))
    if runs:
        rows = [
            [r["run"], f"{r['load']:.2f}"]
            + [f"{r[f'{k}_p50_measured'] * 1e3:.2f} / {r[f'{k}_p50_predicted'] * 1e3:.2f} ms" for k in ("ttft", "tpot")]
            + [f"{r['step_measured'] * 1e3:.2f} / {r['step_predicted'] * 1e3:.2f} ms"]
            for r in runs
        ]
        print()
        print(
            render(
                ["run", "load", "TTFT p50 measured / predicted", "TPOT p50", "step"],
                rows,
                title="experiments/serve_tp.toml (emulated): engine vs simulator",
            )
        )
        print(
            f"median measured/predicted: TTFT {data['ttft_p50_measured_over_predicted']:.2f}, "
            f"TPOT {data['tpot_p50_measured_over_predicted']:.2f}"
        )
    print(f"\nhost: {os.cpu_count()} CPUs, load average {data['load_before']:.2f} before")
    return 0


if __name__ == "__main__":
    sys.exit(main())
