"""Where the test suite's XLA compiles go (see scripts/bench_suite_compiles).

Loaded into pytest (``-p _suite_compiles``, with ``SHARDLAB_COMPILE_LOG`` naming a folder) it logs every compile
request of the test processes (the XLA program's name, whether JAX's persistent cache had it, its seconds, the test
running) to one JSON-lines file a worker; run as a script on that folder it prints where the seconds went. A
subprocess a test starts (``shardlab run``, ``launch``) is not counted. It wraps ``jax._src.compiler``'s
``compile_or_get_cached`` and the two functions that log its cache hits and misses, JAX internals of 0.10: where
they are missing it says so and logs nothing.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time
from pathlib import Path

_LOG = os.environ.get("SHARDLAB_COMPILE_LOG")
_out = None


def _record(**row) -> None:
    global _out
    if _out is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(os.path.join(_LOG, f"compiles.{worker}.jsonl"), "a")  # noqa: SIM115 (open for the session)
    row["test"] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    _out.write(json.dumps(row) + "\n")
    _out.flush()


def pytest_configure(config) -> None:
    if not _LOG:
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # pytest-xdist's controller: its workers compile
    import jax._src.compiler as compiler

    names = ("compile_or_get_cached", "log_persistent_cache_hit", "log_persistent_cache_miss")
    if not all(hasattr(compiler, n) for n in names):
        print(f"_suite_compiles: this JAX has no {', '.join(names)}: nothing is logged", file=sys.stderr)
        return
    compile_or_get_cached = compiler.compile_or_get_cached
    hit, miss = compiler.log_persistent_cache_hit, compiler.log_persistent_cache_miss

    def logged(*args, **kwargs):
        seen = {"cache": "none", "program": None}  # none: not looked up (a cross-compilation, the cache off)

        def on_hit(name, key):
            seen.update(cache="hit", program=name)
            return hit(name, key)

        def on_miss(name, key):
            seen.update(cache="miss", program=name)
            return miss(name, key)

        compiler.log_persistent_cache_hit, compiler.log_persistent_cache_miss = on_hit, on_miss
        start = time.perf_counter()
        try:
            return compile_or_get_cached(*args, **kwargs)
        finally:
            compiler.log_persistent_cache_hit, compiler.log_persistent_cache_miss = hit, miss
            _record(seconds=time.perf_counter() - start, **seen)

    compiler.compile_or_get_cached = logged


def _table(title: str, counts: dict[str, list], n: int) -> str:
    rows = sorted(counts.items(), key=lambda kv: -kv[1][1])[:n]
    lines = [f"{'seconds':>8} {'compiles':>8}  {title}"]
    lines += [f"{s:>8.1f} {c:>8}  {k}" for k, (c, s) in rows]
    return "\n".join(lines)


def report(folder: str, top: int = 15) -> str:
    paths = glob.glob(os.path.join(folder, "compiles.*.jsonl"))
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines()]
    if not rows:
        return f"no compiles logged in {folder}"
    kinds = collections.Counter(r["cache"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    by: dict[str, dict[str, list]] = {"program": {}, "file": {}, "test": {}}
    for r in rows:
        program = r["program"] or "(not looked up: a cross-compilation)"
        for what, key in (("program", program), ("file", r["test"].split("::")[0]), ("test", r["test"])):
            c = by[what].setdefault(key, [0, 0.0])
            c[0] += 1
            c[1] += r["seconds"]
    head = (
        f"{len(rows)} compile requests in the test processes, {seconds:.0f} s: {kinds['miss']} compiled "
        f"(persistent-cache misses), {kinds['hit']} read from the cache, {kinds['none']} not looked up"
    )
    parts = [head, _table("by XLA program", by["program"], top), _table("by test file", by["file"], top)]
    parts.append(_table("by test", by["test"], top))
    return "\n\n".join([*parts, f"(every request: {folder}/compiles.*.jsonl)"])


if __name__ == "__main__":
    print(report(sys.argv[1]))
