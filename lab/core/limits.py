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

__all__ = ["MAX_CALLS", "MAX_EMULATED"]
