"""Benchmark of :func:`lab.predict.planner.layouts.plan`: configurations priced per second on a few real searches.

``scripts/bench_planner`` runs each case ``--repeat`` times (3 by default) as a process's first search, with
no collective priced yet (``cold``: what one ``shardlab plan`` command does), then ``--repeat`` times again
with the collectives the first searches priced held in the process's memo (``training.step.prices``: a
notebook's or a sweep's later searches). It prints the median rates of both (priced and screened configurations
per second of search wall time), the search sizes and the wall time; ``--json`` prints one JSON object instead
(``priced_per_s`` of the later searches, with ``configs_per_s`` its former name, ``cold_priced_per_s``,
``screened_per_s``, ``screened``/``evaluated``/``feasible``). The last case is the issue's target: a full
search for a 405B model on 16,384 H100s in under 2 s. ``--instructions`` counts each search's instructions with
valgrind instead (the same on a busy host as on an idle one: this shared host's speed moves by 3x between days).
A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the lab, run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _callgrind beside it

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.core.table import dumps, render
from lab.core.units import fmt_count, fmt_seconds
from lab.predict.planner.layouts import plan
from lab.predict.training.step import forget_prices

MI = 1024 * 1024

# (model, hardware, chips, batch_tokens, seq_len)
CASES: tuple[tuple[str, str, int, int, int], ...] = (
    ("llama3-70b", "h100", 64, 16 * MI, 8192),
    ("llama3-70b", "h100", 1024, 16 * MI, 8192),
    ("llama3-70b", "h100", 16384, 16 * MI, 8192),
    ("llama3-8b", "tpu-v5e", 256, 4 * MI, 8192),
    ("llama3-405b", "h100", 16384, 16 * MI, 8192),
)


def run_case(model: str, hardware: str, chips: int, batch_tokens: int, seq_len: int, repeat: int) -> dict[str, Any]:
    m, chip = get_model(model), get_chip(hardware)
    cold = []
    for _ in range(repeat):
        forget_prices()
        cold.append(plan(m, chip, chips, batch_tokens, seq_len))
    runs = [plan(m, chip, chips, batch_tokens, seq_len) for _ in range(repeat)]
    last = runs[-1]
    best = last.top[0]
    return {
        "model": model,
        "hardware": hardware,
        "chips": chips,
        "batch_tokens": batch_tokens,
        "seq_len": seq_len,
        "repeat": repeat,
        "screened": last.screened,
        "evaluated": last.evaluated,
        "priced": last.evaluated,
        "feasible": last.feasible,
        "priced_per_s": statistics.median(r.priced_per_s for r in runs),
        "configs_per_s": statistics.median(r.priced_per_s for r in runs),
        "cold_priced_per_s": statistics.median(r.priced_per_s for r in cold),
        "cold_seconds": statistics.median(r.seconds for r in cold),
        "screened_per_s": statistics.median(r.screened_per_s for r in runs),
        "seconds": statistics.median(r.seconds for r in runs),
        "seconds_all": [r.seconds for r in runs],
        "best_layout": best.config.layout.describe(),
        "best_remat": best.config.remat,
        "best_microbatch": best.config.microbatch,
        "best_step_time_s": best.step_time_s,
    }


def _searches(case: int, searches: int) -> None:
    """A counted child: the case's model and chip looked up, then ``searches`` searches of it."""
    model, hardware, chips, batch_tokens, seq_len = CASES[case]
    m, chip = get_model(model), get_chip(hardware)
    for _ in range(searches):
        plan(m, chip, chips, batch_tokens, seq_len)


def count_case(case: int) -> dict[str, Any]:
    """Instructions of the case's first search in a fresh process and of a second one after it (scripts/_callgrind.py:
    three processes making 0, 1 and 2 searches; the differences), and per priced configuration."""
    from _callgrind import instructions

    n = [instructions([str(Path(__file__).resolve()), "--child", f"{case},{k}"]) for k in range(3)]
    model, hardware, chips, batch_tokens, seq_len = CASES[case]
    priced = plan(get_model(model), get_chip(hardware), chips, batch_tokens, seq_len).evaluated
    first, later = n[1] - n[0], n[2] - n[1]
    return {
        "model": model,
        "hardware": hardware,
        "chips": chips,
        "priced": priced,
        "first_instructions": first,
        "later_instructions": later,
        "first_per_priced": first / priced,
        "later_per_priced": later / priced,
    }


def _counted(as_json: bool) -> int:
    results = [count_case(i) for i in range(len(CASES))]
    if as_json:
        print(dumps({"python": platform.python_version(), "instructions": results}))
        return 0
    rows = [
        [
            f"{r['model']} on {r['chips']} {r['hardware']}",
            r["priced"],
            f"{r['first_instructions'] / 1e6:.0f} M",
            f"{r['later_instructions'] / 1e6:.0f} M",
            f"{r['first_per_priced'] / 1e3:.0f} k",
            f"{r['later_per_priced'] / 1e3:.0f} k",
        ]
        for r in results
    ]
    headers = ["search", "priced", "first search", "later search", "per priced, first", "per priced, later"]
    title = "planner benchmark: instructions executed (valgrind callgrind), the same on a busy host as on an idle one"
    print(render(headers, rows, title=title))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_planner", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per case; the median is reported (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count each search's instructions with valgrind instead of timing it (15 processes; minutes)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # CASE,SEARCHES: what --instructions counts
    args = p.parse_args(argv)
    if args.child:
        try:
            case, searches = map(int, args.child.split(","))
            CASES[case]  # an index past the cases is refused here, not inside a search
        except (ValueError, IndexError):
            print(
                f"bench_planner: --child takes CASE,SEARCHES (0-{len(CASES) - 1},0-2), got {args.child!r}",
                file=sys.stderr,
            )
            return 2
        _searches(case, searches)
        return 0
    if args.repeat < 1:
        print(f"bench_planner: --repeat must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2
    try:
        if args.instructions:
            return _counted(args.json)
        results = [run_case(*case, repeat=args.repeat) for case in CASES]
    except UserError as exc:
        print(f"bench_planner: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(dumps({"python": platform.python_version(), "repeat": args.repeat, "cases": results}))
        return 0
    rows = [
        [
            f"{r['model']} on {r['chips']} {r['hardware']}",
            fmt_count(r["batch_tokens"]),
            r["screened"],
            r["evaluated"],
            r["feasible"],
            f"{r['cold_priced_per_s']:.0f}",
            f"{r['priced_per_s']:.0f}",
            f"{r['screened_per_s']:.0f}",
            fmt_seconds(r["cold_seconds"]),
            fmt_seconds(r["seconds"]),
            f"{r['best_layout']}, {r['best_remat']}, mb {r['best_microbatch']}",
        ]
        for r in results
    ]
    headers = [
        "search",
        "tokens",
        "screened",
        "priced",
        "fit",
        "priced/s first",
        "priced/s later",
        "screened/s later",
        "wall first",
        "wall later",
        "best",
    ]
    title = (
        f"planner benchmark: median of {args.repeat} run(s) per search, one core, Python {platform.python_version()};"
        " first: a process's first search (no collective priced yet), later: with those held"
    )
    print(render(headers, rows, title=title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
