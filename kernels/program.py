"""What every builder returns: a jitted program with abstract arguments to lower, and real ones on demand.

``built.fn.lower(*built.abstract).compile()`` compiles without allocating anything (the audit's path, and the
run's one compilation); ``built.args`` places real inputs the first time it is read; ``built.runner(compiled)``
is one call of the program that threads donated state (a train step's parameters and optimizer state) from
call to call, so a profiler can repeat it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any


class Built:
    """A program ready to lower, compile and run.

    Attributes:
        fn: jitted; call ``fn(*args)``.
        abstract: ``jax.ShapeDtypeStruct`` s with shardings, one per argument.
        reference: ``reference(*host_args) -> np.ndarray``, a plain single-device answer (kernels only).
    """

    def __init__(
        self,
        fn: Callable,
        abstract: tuple,
        make_args: Callable[[], tuple],
        *,
        host_args: Callable[[], tuple] | None = None,
        reference: Callable | None = None,
        carry: Callable[[Any, tuple], tuple] | None = None,
        facts: Callable[[], dict[str, Any]] | None = None,
    ):
        self.fn = fn
        self.facts = facts  # what the program's inputs make of it that a report states (the MoE's routing load)
        self.abstract = abstract
        self.reference = reference
        self._make_args = make_args
        self._host_args = host_args
        self._carry = carry

    @cached_property
    def host_args(self) -> tuple:
        """The inputs as numpy arrays (kernels with a reference)."""
        if self._host_args is None:
            raise TypeError("this program has no host inputs (its arguments are initialised on the devices)")
        return self._host_args()

    @cached_property
    def args(self) -> tuple:
        """Device arrays placed with their shardings (allocated on first use)."""
        return self._make_args()

    def runner(self, compiled: Callable | None = None) -> Callable[[], Any]:
        """One call of the program (``compiled`` if given, else ``fn``) on ``args``, carrying donated state."""
        call = compiled or self.fn
        state = {"args": self.args}

        def run() -> Any:
            out = call(*state["args"])
            if self._carry is not None:
                state["args"] = self._carry(out, state["args"])
            return out

        return run


def digest(out: Any) -> dict[str, float | int]:
    """A fingerprint of a program's output, the same on every process: the sum and the sum of squares of all its
    array leaves (in float32, on the devices) and their count. Two runs of one Plan, on one process or several,
    agree on it to float32 rounding (a train step's Adam update moves every parameter, so it is a sharp test)."""
    import jax
    import jax.numpy as jnp

    leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "dtype")]
    if not leaves:
        return {"leaves": 0, "sum": 0.0, "sum_sq": 0.0}

    @jax.jit
    def both(xs):
        f = [x.astype(jnp.float32) for x in xs]
        return sum(jnp.sum(x) for x in f), sum(jnp.sum(x * x) for x in f)

    total, squares = both(leaves)
    return {"leaves": len(leaves), "sum": float(total), "sum_sq": float(squares)}


__all__ = ["Built", "digest"]
