"""The same limit for the same quantity in every command: one table.

A run's calls, the devices a host emulates: each command that takes one of these checks it against the value
here, so ``run``, ``plan --validate``, ``calibrate`` and ``launch`` refuse the same number with the same bound.
"""

# Warm-up or profiled calls of one program: more would take hours and a trace too large to parse.
MAX_CALLS = 10_000

# Host devices one program can span on XLA:CPU; a larger mesh needs real devices (a pod, a cluster). Measured with
# jax 0.10.2 on 2026-12-03: a jitted sum over a mesh of 2048 emulated devices runs; 2049, 3000 and 4096 fail with
# "Multiprocess computations aren't implemented on the CPU backend".
MAX_EMULATED = 2048

# Other processes' share of the host's CPU time above which its timings are not the program's own: a calibration
# is refused past it (in the second before or after measuring), and a profiled run is flagged UNSTEADY. On the
# 2-core hosts this lab is measured on, a busy host measured peak fp32 4-5x low.
HOST_BUSY = 0.25

# Requests one serving simulation takes (infer serve): 10,000 take about 1.7 s on one core of a 2-core host
# (scripts/bench_serve), so the most runs in minutes.
MAX_REQUESTS = 100_000

# Chips a serving search tries up to (infer serve --search): each power of two and each tensor-parallel degree is
# a simulation of its own.
MAX_CHIPS_SEARCHED = 256

__all__ = ["HOST_BUSY", "MAX_CALLS", "MAX_CHIPS_SEARCHED", "MAX_EMULATED", "MAX_REQUESTS"]
