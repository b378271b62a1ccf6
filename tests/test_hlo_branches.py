"""lab.compile.hlo_branches: a ``conditional`` in a loop counted on the trips that take it, where the program text
determines its predicate (a Pallas kernel's ``pl.when`` on grid indices, interpreted on the CPU), else on every
trip. The synthetic module follows XLA's printed format; its numbers are worked out here from its text. The last
tests compile the lab's interpreted kernels on the CPU."""

from __future__ import annotations

import pytest

from lab.compile.hlo import parse_module
from lab.compile.hlo_branches import branch_shares, evaluate, weighted_walk
from lab.compile.hlo_dots import dots

# A 6-trip loop whose body runs a 4x4x4 matmul (128 FLOPs) under a conditional: branch 1 (the dot) when
# (i * 3) % 4 >= 2, i.e. at i = 1, 2, 5 (3, 6, 15 % 4 = 3, 2, 3); the loop's start is START.
LOOP = """HloModule m, entry_computation_layout={(f32[4,4]{1,0}, s32[])->f32[4,4]{1,0}}

%cond_fn (p.0: (s32[], f32[4,4])) -> pred[] {
  %p.0 = (s32[], f32[4,4]{1,0}) parameter(0)
  %i.0 = s32[] get-tuple-element(%p.0), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.0, %n), direction=LT
}

%pick (a.0: s32[]) -> s32[] {
  %a.0 = s32[] parameter(0)
  %three = s32[] constant(3)
  %mul = s32[] multiply(%a.0, %three)
  %four = s32[] constant(4)
  %rem = s32[] remainder(%mul, %four)
  %two = s32[] constant(2)
  %ge = pred[] compare(%rem, %two), direction=GE
  ROOT %cv = s32[] convert(%ge)
}

%skip (s.0: f32[4,4]) -> f32[4,4] {
  ROOT %s.0 = f32[4,4]{1,0} parameter(0)
}

%mm (m.0: f32[4,4]) -> f32[4,4] {
  %m.0 = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%m.0, %m.0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p.1: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p.1 = (s32[], f32[4,4]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %x.1 = f32[4,4]{1,0} get-tuple-element(%p.1), index=1
  %idx = s32[] fusion(%i.1), kind=kLoop, calls=%pick
  %c = f32[4,4]{1,0} conditional(%idx, %x.1, %x.1), branch_computations={%skip, %mm}
  %one = s32[] constant(1)
  %next = s32[] add(%i.1, %one)
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%next, %c)
}

ENTRY %main (x: f32[4,4], k: s32[]) -> f32[4,4] {
  %x = f32[4,4]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,4]{1,0}) tuple(START, %x)
  %w = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond_fn, body=%body
  ROOT %r = f32[4,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_predicate_of_the_loop_counter_is_counted_trip_by_trip():
    m = parse_module(LOOP.replace("START", "%zero"))
    assert branch_shares(m) == {"c": [0.5, 0.5]}  # 3 of 6 trips take the dot
    (d,) = dots(m)
    assert (d.flops, d.times) == (128.0, 3.0)


def test_a_predicate_the_text_does_not_determine_takes_every_trip():
    """The loop starts from the entry's parameter k: the walk's upper bound, every branch on every trip."""
    m = parse_module(LOOP.replace("START", "%k"))
    assert branch_shares(m) == {}
    (d,) = dots(m)
    assert d.times == 6.0  # the static trip count of the condition, as before
    assert [t for i, t in weighted_walk(m) if i.opcode == "dot"] == [t for i, t in m.walk() if i.opcode == "dot"]


def test_integer_arithmetic_follows_hlo():
    """Division and remainder truncate towards zero (HLO's, not Python's floor)."""
    m = parse_module(LOOP.replace("START", "%zero"))
    assert evaluate(m, "pick", [-3]) == 0  # -9 % 4 = -1 in HLO: not >= 2
    assert evaluate(m, "pick", [2]) == 1  # 6 % 4 = 2
    assert evaluate(m, "pick", [None]) is None


def test_the_interpreted_flash_kernel_counts_its_visible_block_pairs(jax_devices):
    """16 x 8 blocks of a causal 32-token sequence, 2 heads: 6 of the 8 block pairs per head run their two dots."""
    import jax
    import jax.numpy as jnp

    from kernels.pallas.flash_attention import flash_attention
    from lab.core.pallas_cost import flash_cost

    q, k = jnp.zeros((1, 32, 2, 12), jnp.float32), jnp.zeros((1, 32, 1, 12), jnp.float32)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=16, block_k=8, interpret=True))
    module = parse_module(fn.lower(q, k, k).compile().as_text())
    compiled = sum(d.flops * d.times for d in dots(module))
    assert compiled == flash_cost(1, 32, 32, 2, 1, 12, 16, 8, True, 4)["flops"] == 2 * 6 * 4 * 16 * 8 * 12


@pytest.mark.parametrize("length", [5, 64])
def test_the_interpreted_paged_kernel_counts_every_page(jax_devices, length):
    """The decode kernel skips pages past a sequence's length, which is data: the count is the whole table, as
    its cost estimate says, whatever the lengths."""
    import jax
    import jax.numpy as jnp

    from kernels.pallas.paged_decode import paged_decode
    from lab.core.pallas_cost import paged_decode_cost

    q, pages = jnp.zeros((2, 4, 12), jnp.float32), jnp.zeros((8, 16, 2, 12), jnp.float32)
    table, lengths = jnp.arange(8, dtype=jnp.int32).reshape(2, 4), jnp.full((2,), length, jnp.int32)
    fn = jax.jit(lambda *a: paged_decode(*a, interpret=True))
    module = parse_module(fn.lower(q, pages, pages, table, lengths).compile().as_text())
    compiled = sum(d.flops * d.times for d in dots(module))
    assert compiled == paged_decode_cost(2, 4, 2, 12, 4, 16, 4)["flops"]
