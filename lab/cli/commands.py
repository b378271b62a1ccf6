"""The top-level commands: which module registers each, and its one-line help.

Kept free of imports so that ``shardlab COMMAND`` builds the parser of its own command group only, imports
only that group's module, and still lists every command (with this help) under ``shardlab --help``.
"""

from __future__ import annotations

# command -> (module under lab.cli that registers it, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "hardware": ("analytic", "the hardware catalog"),
    "roofline": ("analytic", "roofline costs"),
    "collective": ("analytic", "one collective over one or more mesh axes"),
    "sharded-matmul": ("analytic", 'collectives, bytes and time of a sharded matmul, e.g. "A[I_X,J] * B[J,K_Y]"'),
    "model": ("model", "the model catalog and Transformer accounting"),
    "train": ("train", "training estimates"),
    "plan": ("plan", "search every layout, remat policy and microbatch; rank by predicted step time"),
    "study": ("study", "studies across hardware generations and technologies"),
    "validate": ("validate", "replay published measured runs: calibration, development set and test split"),
    "infer": ("infer", "serving estimates: decode, prefill, KV cache, topology, requests under load"),
    "audit": ("audit", "compile a kernel or experiment and check its collectives and FLOPs against the estimate"),
    "explain": (
        "explain",
        "the compiled program read back in the Plan's names: memory at its peak, overlap, sharding",
    ),
    "run": ("run", "estimate, compile+audit, profile, compare and report an experiment"),
    "launch": ("run", "run an experiment as N local processes over loopback (JAX's distributed runtime, CPU devices)"),
    "calibrate": ("run", "fit this backend's spec from microbenchmarks"),
    "demo": ("run", "the default scenario on 8 emulated devices"),
}
GROUPS = tuple(dict.fromkeys(module for module, _ in COMMANDS.values()))
# Commands that may start JAX (``plan --validate`` compiles); the others are analytic and never import it.
JAX_COMMANDS = frozenset({"audit", "explain", "run", "launch", "calibrate", "demo", "plan"})


def help_of(command: str) -> str:
    return COMMANDS[command][1]


__all__ = ["COMMANDS", "GROUPS", "JAX_COMMANDS", "help_of"]
