import math

import pytest

from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.predict.roofline import default_compute_dtype, matmul, roofline

V5E = get_chip("v5e")
BIG = 1 << 20  # D and F much larger than B, the book's regime for "B > 240"


def test_flops_and_bytes_of_a_small_matmul():
    # 7 x 11 x 13, bf16: 2*7*11*13 FLOPs; bytes 2*(7*11 + 11*13 + 7*13).
    r = matmul(V5E, 7, 11, 13)
    assert r.flops == 2002
    assert r.bytes == 622
    assert r.intensity == pytest.approx(2002 / 622)
    assert r.time_s == max(r.compute_s, r.memory_s)
    assert r.compute_s == pytest.approx(2002 / 1.97e14)
    assert r.memory_s == pytest.approx(622 / 8.2e11)


@pytest.mark.parametrize(
    ("dtype", "weight", "crit_b"),
    [
        ("bf16", None, 240),  # roofline.md: compute-bound iff B > 240 on v5e
        ("bf16", "int8", 120),  # int8 weights, bf16 compute: B > 120
        ("int8", "int8", 240),  # int8 x int8 on int8 units: intensity 2B vs 480, still B > 240
    ],
)
def test_book_critical_batch_on_v5e(dtype, weight, crit_b):
    r = matmul(V5E, 1, BIG, BIG, dtype=dtype, weight_dtype=weight)
    assert r.critical_batch == pytest.approx(crit_b, rel=0.01)
    below = matmul(V5E, math.floor(r.critical_batch * 0.95), BIG, BIG, dtype=dtype, weight_dtype=weight)
    above = matmul(V5E, math.ceil(r.critical_batch * 1.05), BIG, BIG, dtype=dtype, weight_dtype=weight)
    assert below.bound == "memory" and above.bound == "compute"


def test_critical_batch_is_exact_where_bound_flips():
    # At moderate D, F the exact threshold moves above the B << D, F approximation; it must still
    # be exactly where compute and memory times cross.
    r = matmul(V5E, 1, 4096, 14336)
    at = matmul(V5E, round(r.critical_batch), 4096, 14336)
    assert at.compute_s == pytest.approx(at.memory_s, rel=0.01)
    assert r.critical_batch > 240


def test_h100_critical_batch():
    r = matmul(get_chip("h100"), 1, BIG, BIG)
    assert r.critical_batch == pytest.approx(295, rel=0.01)


def test_small_dims_are_never_compute_bound():
    assert matmul(V5E, 1, 64, 64).critical_batch == math.inf


def test_compute_dtype_defaults():
    assert default_compute_dtype("bf16", "int8") == "bf16"
    assert default_compute_dtype("int8", "int8") == "int8"
    assert default_compute_dtype("fp8", "fp8") == "fp8"
    assert default_compute_dtype("fp32", "bf16") == "fp32"


def test_int8_compute_uses_int8_peak():
    r = matmul(V5E, 4096, 8192, 8192, dtype="int8")
    assert r.compute_s == pytest.approx(2 * 4096 * 8192 * 8192 / 3.94e14)
    assert r.bytes == 4096 * 8192 + 8192 * 8192 + 4096 * 8192


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_sizes(bad):
    with pytest.raises(UserError, match="positive integer"):
        matmul(V5E, bad, 8, 8)


def test_roofline_general_op():
    r = roofline(V5E, flops=0, nbytes=8.2e11, compute_dtype="bf16", op="copy")
    assert r.bound == "memory" and r.time_s == pytest.approx(1.0)
    with pytest.raises(UserError):
        roofline(V5E, flops=-1, nbytes=1)
