"""The measured harness's own overhead: `shardlab run EXPERIMENT` N times (see scripts/bench_harness), the medians
of report.json's timings and (parse_s + report_s) / total_s, the report's target for tp_mlp being 0.15."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("startup_s", "prepare_s", "build_s", "compile_s", "profile_s", "parse_s", "report_s", "total_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--experiment", default="experiments/tp_mlp.toml")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    got: dict[str, list[float]] = {p: [] for p in PHASES}
    ratios, loads = [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(a.runs):
            cmd = [sys.executable, "-m", "lab", "run", a.experiment, "--out", out, "--run-id", f"r{i}", "--quiet"]
            subprocess.run(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            report = json.loads((Path(out) / f"r{i}" / "report.json").read_text())
            t = report["timings"]
            for p in PHASES:
                got[p].append(t[p])
            ratios.append((t["parse_s"] + t["report_s"]) / t["total_s"])
            loads.append(report["summary"].get("host_load"))
    med = {p: statistics.median(v) for p, v in got.items()}
    data = {
        "experiment": a.experiment,
        "runs": a.runs,
        "median_s": med,
        "parse_report_over_total": statistics.median(ratios),
        "ratios": ratios,
        "host_load_median": statistics.median([x for x in loads if x is not None]) if any(loads) else None,
        "loadavg_1min": os.getloadavg()[0],
    }
    if a.json:
        print(json.dumps(data, indent=1))
        return
    print(f"{a.experiment}, {a.runs} runs (medians):")
    for p in PHASES:
        print(f"  {p:<10} {med[p]:.3f} s")
    print(
        f"(parse_s + report_s) / total_s: median {data['parse_report_over_total']:.3f} (target 0.15); runs: "
        + ", ".join(f"{r:.3f}" for r in ratios)
    )
    print(
        "other processes' share of the host while profiling: "
        + (f"{100 * data['host_load_median']:.1f}%" if data["host_load_median"] is not None else "not measured")
        + f"; 1-min load {data['loadavg_1min']:.2f}"
    )


if __name__ == "__main__":
    main()
