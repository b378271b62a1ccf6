"""Start-up of analytic commands relative to a bare interpreter start (see scripts/bench_startup)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the lab, run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _callgrind beside it

from _callgrind import MISSING, available, instructions

from lab.core.errors import UserError

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "hardware list": ["-m", "lab", "hardware", "list"],
    "roofline matmul": ["-m", "lab", "roofline", "matmul", "--b", "8", "--d", "8", "--f", "8", "--hardware", "h100"],
    "train estimate": ["-m", "lab", "train", "estimate", "--model", "llama3-8b", "--hardware", "h100", "--chips", "8"],
}


def wall(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def count_instructions(as_json: bool) -> None:
    for args in COMMANDS.values():  # write the bytecode caches first
        wall(args)
    try:
        counts = {name: instructions(args) for name, args in COMMANDS.items()}
    except UserError as exc:
        sys.exit(f"bench_startup: {exc}")
    base = counts["python -c pass"]
    if as_json:
        print(json.dumps({"instructions": counts, "ratio": {k: v / base for k, v in counts.items()}}, indent=2))
        return
    print("instructions executed (valgrind callgrind), against a bare interpreter start")
    for name, n in counts.items():
        print(f"{name:<18} {n / 1e6:>8.1f} M {n / base:>6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--instructions", action="store_true", help="count instructions with valgrind instead of timing (one run each)"
    )
    a = ap.parse_args()
    if a.instructions:
        if not available():
            ap.error(MISSING)
        count_instructions(a.json)
        return
    for args in COMMANDS.values():  # write the bytecode caches first
        wall(args)
    times = {name: [] for name in COMMANDS}
    for _ in range(a.runs):  # interleaved, so a burst of load hits every command alike
        for name, args in COMMANDS.items():
            times[name].append(wall(args))
    base_min, base_med = min(times["python -c pass"]), statistics.median(times["python -c pass"])
    rows = {
        name: {
            "min_ms": 1e3 * min(t),
            "median_ms": 1e3 * statistics.median(t),
            "ratio_min": min(t) / base_min,
            "ratio_median": statistics.median(t) / base_med,
        }
        for name, t in times.items()
    }
    load = os.getloadavg()[0]
    if a.json:
        print(json.dumps({"runs": a.runs, "load_1min": load, "commands": rows}, indent=2))
        return
    print(f"{a.runs} runs each, interleaved; 1-minute load {load:.2f}")
    print(f"{'command':<18} {'min':>8} {'median':>8} {'x bare (min)':>13} {'x bare (median)':>16}")
    for name, r in rows.items():
        print(
            f"{name:<18} {r['min_ms']:>6.1f}ms {r['median_ms']:>6.1f}ms {r['ratio_min']:>13.2f} "
            f"{r['ratio_median']:>16.2f}"
        )


if __name__ == "__main__":
    main()
