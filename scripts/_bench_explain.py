"""Benchmark of ``shardlab explain memory`` on the real-size train step cross-compiled for a TPU.

``scripts/bench_explain`` runs ``shardlab explain memory experiments/llama3_8b_train_2layer.toml --target v5e:2x4
--json`` ``--runs`` times, each a fresh process (as a user runs it: JAX's start, libtpu's compile with XLA's dump,
the reading), and prints each run's wall time, the fastest and the median, with the host's load average before and
after (issue 37's goal: under 60 s on a 2-core machine). ``--json`` prints one JSON object. A benchmark, not a test:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["explain", "memory", "experiments/llama3_8b_train_2layer.toml", "--target", "v5e:2x4", "--json"]


def run_once() -> tuple[float, float]:
    """One fresh process: ``(wall seconds, the held-over-estimated ratio it printed)``."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lab", *COMMAND], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench_explain: the command failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return wall, json.loads(done.stdout)["held_over_estimated"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes to time (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    runs = [run_once() for _ in range(max(1, args.runs))]
    walls = [w for w, _ in runs]
    out = {
        "command": "shardlab " + " ".join(COMMAND),
        "cores": os.cpu_count(),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "wall_s": [round(w, 1) for w in walls],
        "fastest_s": round(min(walls), 1),
        "median_s": round(statistics.median(walls), 1),
        "held_over_estimated": round(runs[0][1], 3),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['command']}  ({out['cores']} cores, load {out['load_before']} before, {out['load_after']} after)")
    print(f"runs: {', '.join(f'{w:.1f} s' for w in walls)}; fastest {out['fastest_s']} s, median {out['median_s']} s")
    print(f"(the device holds {out['held_over_estimated']}x the estimator's memory at the peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
