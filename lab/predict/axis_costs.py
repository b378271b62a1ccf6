"""The costs of pipeline, expert and context parallelism, in one place for every estimator that prices them.

The training estimator (:mod:`lab.predict.training.estimate`, what ``train estimate`` and ``plan`` rank layouts
by) and the estimates of the lab's own pipeline, MoE and ring-attention programs
(:mod:`lab.predict.program.axis_programs`, what the audit checks against the compiled HLO) take their bubble,
exchange and ring formulas from here, so the formula the audit verifies is the formula a layout is ranked by.

* **Pipeline bubble**: with ``p`` stages, ``m`` microbatches and ``v`` model chunks per stage (interleaved
  schedule), the fraction of a step each stage idles is ``(p - 1) / (v m + p - 1)``: ``p - 1`` idle slots of the
  ``v m + p - 1`` a stage's schedule spans (GPipe and 1F1B alike; Narayanan et al. 2021, Sec. 2.2).
* **Expert exchange**: dispatch and combine each move every routed token's row to its expert and back: ``n`` ranks
  on the expert axis hold ``k x tokens x capacity_factor`` rows of ``D`` between them per device, ``V = n x rows
  x D x bytes`` in the collective model's convention (an AllToAll's operand times its group). With the experts
  given, the rows are the padded slots ``E x ceil(k t c / E)``, as a fixed-capacity dispatch buffer holds them.
* **Ring passes**: context parallelism over ``c`` ranks passes K and V around the ring ``c - 1`` times per
  direction that needs them (the forward once; the backward twice, K and V with their gradients): each pass one
  block of ``2 x tokens x kv_heads x head_dim x bytes`` on one rank.
"""

from __future__ import annotations


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Fraction of a pipeline step each stage idles: ``(p - 1) / (v m + p - 1)``."""
    return (p - 1) / (v * m + p - 1) if p > 1 else 0.0


def bubble_over_work(p: int, m: int, v: int = 1) -> float:
    """The same bubble as a multiple of the step's work (``(p - 1) / (v m)``): bubble time = this x work time."""
    f = bubble_fraction(p, m, v)
    return f / (1.0 - f)


def moe_slots(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Expert slots a fixed-capacity dispatch buffer holds on one device: ``E x ceil(k t c / E)`` (exact, as the
    lab's MoE kernel sizes it: :func:`lab.core.programs.moe_capacity`)."""
    # imported here: building the program table costs every dense model's estimate about 4 ms of start-up
    from lab.core.programs import moe_capacity

    return experts * moe_capacity(tokens, experts, k, capacity_factor)


def moe_exchange_bytes(
    n: int, tokens: float, k: int, d: int, nbytes: float, capacity_factor: float = 1.0, experts: int | None = None
) -> float:
    """V of one dispatch (or combine) AllToAll over ``n`` expert ranks (module docstring)."""
    rows = moe_slots(int(tokens), experts, k, capacity_factor) if experts else k * tokens * capacity_factor
    return n * rows * d * nbytes


def ring_kv_block_bytes(tokens: float, kv_heads: float, head_dim: int, nbytes: float) -> float:
    """One ring pass on one rank: K and V of its sequence block, ``2 x tokens x kv_heads x head_dim x bytes``."""
    return 2 * tokens * kv_heads * head_dim * nbytes


def ring_passes(c: int, directions: int = 1) -> int:
    """Passes of K and V around a ring of ``c`` ranks: ``c - 1`` for each direction that needs them."""
    return directions * (c - 1)


__all__ = [
    "bubble_fraction",
    "bubble_over_work",
    "moe_exchange_bytes",
    "moe_slots",
    "ring_kv_block_bytes",
    "ring_passes",
]
