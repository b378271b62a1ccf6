"""Invariants of the cost model, checked over many generated inputs."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lab.core.hardware import CATALOG
from lab.predict.collectives import KINDS, collective_time
from lab.predict.roofline import matmul

TORUS = [c for c in CATALOG if c.topology == "torus"]
ANY_CHIP = st.sampled_from(CATALOG)
AXES = st.lists(st.integers(1, 16), min_size=1, max_size=3)
BYTES = st.floats(1.0, 1e11, allow_nan=False, allow_infinity=False)
SCOPE = st.sampled_from(["node", "cross-node"])


def _fits(chip, axes, scope):
    """Group shapes the switched model accepts (others are user errors, tested elsewhere)."""
    import math

    g = math.prod(axes)
    if chip.topology != "torus" and scope == "node":
        return g <= chip.node_size
    if chip.topology != "torus" and g > chip.node_size:
        return g % chip.node_size == 0
    return True


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    chip=ANY_CHIP,
    kind=st.sampled_from(KINDS),
    axes=AXES,
    v=BYTES,
    factor=st.floats(1.0, 1e3),
    wrap=st.booleans(),
    scope=SCOPE,
)
def test_time_never_decreases_with_bytes(chip, kind, axes, v, factor, wrap, scope):
    assume(_fits(chip, axes, scope))
    small = collective_time(kind, v, axes, chip, wraparound=wrap, scope=scope)
    large = collective_time(kind, v * factor, axes, chip, wraparound=wrap, scope=scope)
    assert large.time_s >= small.time_s


@settings(max_examples=300, deadline=None, derandomize=True)
@given(chip=ANY_CHIP, axes=AXES, v=BYTES, wrap=st.booleans(), scope=SCOPE)
def test_allreduce_is_reducescatter_plus_allgather(chip, axes, v, wrap, scope):
    assume(_fits(chip, axes, scope))
    kw = {"wraparound": wrap, "scope": scope}
    ar = collective_time("all-reduce", v, axes, chip, **kw)
    rs = collective_time("reduce-scatter", v, axes, chip, **kw)
    ag = collective_time("all-gather", v, axes, chip, **kw)
    assert ar.time_s == pytest.approx(rs.time_s + ag.time_s, rel=1e-12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    chip=st.sampled_from(TORUS),
    kind=st.sampled_from(KINDS),
    axes=AXES,
    v=BYTES,
    wraps=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_wraparound_never_slower(chip, kind, axes, v, wraps):
    ring = collective_time(kind, v, axes, chip, wraparound=True)
    line = collective_time(kind, v, axes, chip, wraparound=False)
    mixed = collective_time(kind, v, axes, chip, wraparound=wraps[: len(axes)])
    assert ring.time_s <= mixed.time_s <= line.time_s


@settings(max_examples=200, deadline=None, derandomize=True)
@given(chip=ANY_CHIP, kind=st.sampled_from(KINDS), axes=AXES, v=BYTES, wrap=st.booleans(), scope=SCOPE)
def test_time_is_the_larger_term_plus_launch(chip, kind, axes, v, wrap, scope):
    assume(_fits(chip, axes, scope) and kind != "all-reduce")
    c = collective_time(kind, v, axes, chip, wraparound=wrap, scope=scope)
    hop_part = c.latency_s - (chip.launch_latency_s if c.hops else 0.0)
    assert c.time_s >= c.bandwidth_s
    assert c.time_s == pytest.approx(c.latency_s - hop_part + max(hop_part, c.bandwidth_s), rel=1e-12, abs=1e-18)
    assert c.latency_bound == (hop_part > c.bandwidth_s)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(chip=ANY_CHIP, b=st.integers(1, 1 << 16), d=st.integers(1, 1 << 14), f=st.integers(1, 1 << 14))
def test_matmul_roofline_invariants(chip, b, d, f):
    dtype = "bf16" if "bf16" in chip.peak_flops else "fp32"
    r = matmul(chip, b, d, f, dtype=dtype)
    assert r.time_s == max(r.compute_s, r.memory_s)
    assert (r.bound == "compute") == (r.intensity >= r.critical_intensity)
    # Doubling the batch never lowers intensity and never shortens the op.
    r2 = matmul(chip, 2 * b, d, f, dtype=dtype)
    assert r2.intensity >= r.intensity and r2.time_s >= r.time_s
